"""Runs one benchmark case through fa3gen and torch SDPA's cuDNN backend, for a profiler to watch.

Usage (on the GPU machine): ncu [options] python scripts/profile_case.py --hdim 128 --seqlen 512 [--causal]
Each backend runs --calls times on the same inputs (16k tokens, hidden 2048, bf16: the bench's setup),
after one untimed call that loads the kernel; the profiler picks the launches it wants by name.
--fp8 runs fa3gen's e4m3 kernel on fa3gen.fp8.prepare'd inputs instead (its default blocks), and
--spec JSON its kernel for a spec with these extra fields (e.g. '{"block_n": 128}'), each
after the default kernel; --granularity their scales (block, the default).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen
from fa3gen import fp8, fp8_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--spec", action="append", default=[])
    ap.add_argument("--granularity", default="block", choices=["tensor", "head", "block"], help="--fp8's scales")
    args = ap.parse_args()
    d, s = args.hdim, args.seqlen
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if args.fp8:
        profile_fp8(q, k, v, args.causal, args.calls, [json.loads(x) for x in args.spec], args.granularity)
        print(f"profiled fp8 d{d} s{s} b{b} h{h} causal={args.causal}: {args.calls} calls per kernel")
        return
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


def profile_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, calls: int,
                extra: list[dict], granularity: str = "block") -> None:
    d = q.shape[-1]
    specs = [fa3gen.KernelSpec(head_dim=d, dtype="e4m3", causal=causal, **f) for f in extra]
    # Each candidate on inputs with one scale per tile of its own tiles; the default kernel (None) on
    # prepare's default blocks.
    runs = [(None, fp8.prepare(q, k, v, granularity, hadamard=True))]
    runs += [(fa3gen.compile(s), fp8.prepare(q, k, v, granularity, (s.block_m, s.block_n), hadamard=True))
             for s in specs]
    for kernel, inputs in runs:
        fp8_ops.flash_attn_fp8_func(inputs, None, causal, kernel=kernel)
    torch.cuda.synchronize()
    for kernel, inputs in runs:
        for _ in range(calls):
            fp8_ops.flash_attn_fp8_func(inputs, None, causal, kernel=kernel)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
