"""A tiny workload of the fused fp8 prepare kernels for compute-sanitizer: every head dim and
input dtype, each scale granularity, the Hadamard transform or not, both output layouts, ragged
lengths (not multiples of 32 or of a scale block), and strided inputs. Prints one line per case.

Usage: compute-sanitizer --tool memcheck python scripts/sanitize_fp8_prepare.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fa3gen import fp8_prepare  # noqa: E402

for d in (64, 96, 128, 192, 256):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for b, s, h, granularity, seed, v_layout in ((2, 77, 3, "block", 0, False), (1, 300, 2, "head", None, True),
                                                     (1, 33, 1, "tensor", 1, False), (2, 161, 2, "block", None, True)):
            packed = torch.randn(b, s, 2, h, d, device="cuda").to(dtype)
            x = packed[:, :, 1]  # strided rows
            out = fp8_prepare.quantize(x, granularity, 64, True, hadamard_seed=seed, kernel_v_layout=v_layout)
            torch.cuda.synchronize()
            print("ok", (d, dtype, b, s, h, granularity, seed, v_layout), tuple(out.data.shape), flush=True)
