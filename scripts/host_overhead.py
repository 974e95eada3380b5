"""Host-side cost of one call, beside the GPU time: tells whether a short case is launch-bound.

Usage (on the GPU machine): python scripts/host_overhead.py
For bf16 hdim 128 at seqlen 512 (the bench's batch 32 x 16 heads), causal and not: the CPU time per
call of fa3gen.flash_attn_func and of torch SDPA (cuDNN) when queueing 200 calls without waiting,
and the GPU time per call from CUDA events.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen


def per_call_us(fn, n: int = 200) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    stop.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(stop) / n * 1e3


def main() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(32, 512, 16, 128, device="cuda", dtype=dtype) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for causal in (False, True):
            host, gpu = per_call_us(lambda: fa3gen.flash_attn_func(q, k, v, causal=causal))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                host_c, gpu_c = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            print(f"{dtype} causal={causal}: fa3gen host {host:.1f} us/call, GPU {gpu:.1f} us/call | "
                  f"cuDNN host {host_c:.1f}, GPU {gpu_c:.1f}", flush=True)


if __name__ == "__main__":
    main()
