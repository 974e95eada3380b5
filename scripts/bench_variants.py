"""Times fa3gen's attention variants beside the plain kernels and cuDNN SDPA, in one process.

Usage (on a Hopper GPU): python scripts/bench_variants.py [--seqlens 4096,16384]
bf16, hdim 128, 16 heads, batch = 16384 / seqlen. TFLOP/s count the FLOPs of the full (or causal)
problem, so a window's speed-up shows as a higher number; "ms" is the median time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen
from fa3gen.bench import attn_fwd_flops, time_cuda_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="4096,16384")
    args = ap.parse_args()
    d, h = 128, 16
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 16384 // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        slopes = torch.rand(h, device="cuda")
        cases = {
            "plain": (False, lambda: fa3gen.flash_attn_func(q, k, v)),
            "causal": (True, lambda: fa3gen.flash_attn_func(q, k, v, causal=True)),
            "causal, window (1024, 0)": (True, lambda: fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(1024, 0))),
            "window (1024, 1024)": (False, lambda: fa3gen.flash_attn_func(q, k, v, window_size=(1024, 1024))),
            "softcap 30": (False, lambda: fa3gen.flash_attn_func(q, k, v, softcap=30.0)),
            "causal, softcap 30": (True, lambda: fa3gen.flash_attn_func(q, k, v, causal=True, softcap=30.0)),
            "alibi": (False, lambda: fa3gen.flash_attn_func(q, k, v, alibi_slopes=slopes)),
        }

        def cudnn(causal):
            def run():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return run

        cases["cuDNN plain"] = (False, cudnn(False))
        cases["cuDNN causal"] = (True, cudnn(True))
        print(f"\n## bf16 hdim {d}, batch {b}, seqlen {s}, {h} heads\n\n| case | ms | TFLOP/s (full-problem FLOPs) |\n|---|---|---|")
        for name, (causal, fn) in cases.items():
            fn()
            ms = time_cuda_ms(fn, 3, 10, 2.0)
            tflops = attn_fwd_flops(b, h, s, s, d, causal) / (ms * 1e-3) / 1e12
            print(f"| {name} | {ms:.3f} | {tflops:.1f} |", flush=True)


if __name__ == "__main__":
    main()
