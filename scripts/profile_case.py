"""Runs one benchmark case through fa3gen and torch SDPA's cuDNN backend, for a profiler to watch.

Usage (on the GPU machine): ncu [options] python scripts/profile_case.py --hdim 128 --seqlen 512 [--causal]
Each backend runs --calls times on the same inputs (16k tokens, hidden 2048, bf16: the bench's setup),
after one untimed call that loads the kernel; the profiler picks the launches it wants by name.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    d, s = args.hdim, args.seqlen
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    fa3gen.flash_attn_func(q, k, v, causal=args.causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
    torch.cuda.synchronize()
    for _ in range(args.calls):
        fa3gen.flash_attn_func(q, k, v, causal=args.causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(args.calls):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
    torch.cuda.synchronize()
    print(f"profiled d{d} s{s} b{b} h{h} causal={args.causal}: fa3gen and cuDNN, {args.calls} calls each")


if __name__ == "__main__":
    main()
