"""A tiny FP8 forward workload for compute-sanitizer: ragged, GQA, sq != sk, causal and not, each
scale granularity, pingpong or not, hdim 64 to 256, V transposed in the kernel or before it.
Prints one line per case.

Usage: python scripts/sanitize_fp8.py [--only FIELD]   # FIELD: only the cases whose spec sets it
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen import fp8, fp8_ops  # noqa: E402

CASES = [  # b, sq, sk, hq, hkv, d, causal, granularity, spec changes
    (1, 77, 200, 4, 2, 128, True, "block", {}),
    (2, 150, 70, 2, 1, 64, True, "head", {}),
    (1, 300, 130, 2, 2, 256, False, "tensor", {}),
    (1, 200, 333, 4, 2, 128, False, "block", {"pingpong": True}),
    (1, 260, 260, 2, 1, 128, True, "block", {"pingpong": True}),
    # hdim 256 rescales O lazily (its V unit changes with the block scales), chained or not.
    (2, 300, 700, 4, 2, 256, False, "block", {}),
    (1, 500, 500, 2, 1, 256, True, "block", {}),
    (1, 333, 500, 4, 2, 128, True, "block", {"lazy_rescale": True}),
    (1, 400, 300, 2, 2, 192, False, "block", {}),
    # V as the model holds it, transposed in shared memory by the producer warpgroup.
    (1, 333, 500, 4, 2, 128, True, "block", {"v_transpose_in_kernel": True}),
    (2, 300, 700, 4, 2, 128, False, "head", {"v_transpose_in_kernel": True}),
    # Three consumer warpgroups (fwd_d128_e4m3_long): 128-row Q scale blocks span its 192-row tiles.
    (2, 450, 700, 4, 2, 128, False, "block", {"block_m": 192, "block_n": 128}),
    # hdim 64 (fwd_d64_e4m3_long, fwd_d64_e4m3_causal_long): the same tiles, with the row sums on
    # the tensor cores.
    (2, 450, 700, 4, 2, 64, False, "block", {"block_m": 192, "block_n": 128}),
    (1, 500, 500, 2, 1, 64, True, "block", {"block_m": 192, "block_n": 128}),
    # The other 192 x 128 kernels of registry.FP8_SEQLEN_TILES: hdim 64 on the serial loop, hdim 64
    # and 128 causal with per-warpgroup key trimming.
    (2, 450, 700, 4, 2, 64, False, "block", {"block_m": 192, "block_n": 128, "intra_wg_overlap": False}),
    (1, 500, 500, 2, 1, 64, True, "block", {"block_m": 192, "block_n": 128, "warpgroup_key_trim": True, "stages": 3}),
    (1, 700, 500, 4, 2, 128, True, "block", {"block_m": 192, "block_n": 128, "warpgroup_key_trim": True}),
    # Each key block's factors stored by the producer beside its K (kv_factors_in_smem): pingpong
    # (hdim 256, chained; hdim 128 causal, Q in registers) and three warpgroups, trimmed.
    (2, 300, 700, 4, 2, 256, False, "block", {"kv_factors_in_smem": True}),
    (1, 333, 500, 4, 2, 128, True, "block", {"kv_factors_in_smem": True}),
    (1, 500, 500, 2, 1, 64, True, "block", {"block_m": 192, "block_n": 128, "warpgroup_key_trim": True, "stages": 3,
                                            "kv_factors_in_smem": True}),
]
only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None

for b, sq, sk, hq, hkv, d, causal, granularity, changes in CASES:
    if only is not None and only not in changes:
        continue
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    inputs = fp8.prepare(q, k, v, granularity, kernel_v_layout=not changes.get("v_transpose_in_kernel", False))
    kernel = fa3gen.compile(fa3gen.KernelSpec(head_dim=d, dtype="e4m3", causal=causal, **changes))
    out = fp8_ops.flash_attn_fp8_func(inputs, causal=causal, kernel=kernel)
    torch.cuda.synchronize()
    print("ok", (b, sq, sk, hq, hkv, d, causal, granularity, changes), "finite:", bool(torch.isfinite(out).all()),
          flush=True)
