"""The FA3 paper's accuracy experiment (outlier inputs, block scales + Hadamard, RMSE of O against
float64 attention of the unquantized inputs) with the fp8 kernels of hdim 128 and 256, with and
without lazy rescale. Needs a Hopper GPU.

Usage: python scripts/fp8_lazy_accuracy.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import fa3gen  # noqa: E402
from fa3gen import fp8  # noqa: E402
from fa3gen.reference import attention_reference  # noqa: E402
from test_fp8_gpu import run_poisoned  # noqa: E402

CASES = ((128, 2048, 4), (128, 8192, 2), (256, 2048, 4), (256, 8192, 1))  # head_dim, seqlen, nheads

for d, s, h in CASES:
    for seed in (0, 1):
        q, k, v = fp8.outlier_inputs(1, s, h, d, seed=seed, device="cuda")
        inputs = fp8.prepare(q, k, v, "block", hadamard=True)
        ref, _ = attention_reference(q.double(), k.double(), v.double(), None, False)
        errors = []
        for lazy in (False, True):
            kernel = fa3gen.compile(fa3gen.KernelSpec(head_dim=d, dtype="e4m3", lazy_rescale=lazy))
            out, _ = run_poisoned(inputs, False, kernel=kernel)
            errors.append(fp8.rmse(out, ref))
        print(f"d{d} s{s} h{h} seed {seed}: RMSE eager {errors[0]:.4e}, lazy {errors[1]:.4e}", flush=True)
