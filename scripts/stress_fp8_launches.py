"""Launches fp8 kernels back to back, without a sync between them, and says whether the sequence
finishes: the reproducer of the hang the lazy hdim 256 causal window kernel showed (BENCHMARKS.md,
2026-12-02). A hang ends the process after --timeout seconds with Python's stack (faulthandler)
and exit status 1. Run each sequence in its own process: a hung GPU context does not recover.

Usage: python scripts/stress_fp8_launches.py SEQ [--repeats 30] [--causal] [--window 1024,0]
                                               [--seqlen 4096] [--batch 4] [--hdim 256] [--timeout 12] [--time]
  SEQ: one letter a launch, e.g. L, E, LE. L: the window kernel with lazy rescale, E: its eager
  twin; P and Q: the kernels without a window (P lazy where that is the default, Q eager).
  --time: afterwards, the kernels of SEQ timed interleaved on the same inputs (median ms).
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen import fp8, fp8_ops  # noqa: E402
from fa3gen.bench import time_cuda_ms_interleaved  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seq")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", default="1024,0")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hdim", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=12.0)
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    d, causal = args.hdim, args.causal
    window = tuple(int(x) for x in args.window.split(","))

    def spec(window_kernel: bool, lazy: bool) -> fa3gen.KernelSpec:
        return fa3gen.KernelSpec(head_dim=d, dtype="e4m3", causal=causal, window=window_kernel, lazy_rescale=lazy)

    kernels = {"L": (spec(True, True), window), "E": (spec(True, False), window),
               "P": (fa3gen.registry.default_fp8_spec(d, d, "bf16", causal), (-1, -1)),
               "Q": (spec(False, False), (-1, -1))}
    compiled = {c: (fa3gen.compile(kernels[c][0]), kernels[c][1]) for c in set(args.seq)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = 2048 // d
    q, k, v = (torch.randn(args.batch, args.seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    inputs = fp8.prepare(q, k, v, "block", hadamard=True)
    torch.cuda.synchronize()
    for _ in range(args.repeats):
        for c in args.seq:
            kernel, win = compiled[c]
            fp8_ops.flash_attn_fp8_func(inputs, None, causal, window_size=win, kernel=kernel)
    torch.cuda.synchronize()
    print(f"finished: {args.repeats} x {args.seq} ({', '.join(compiled[c][0].spec.name for c in sorted(compiled))})")
    if args.time:
        faulthandler.cancel_dump_traceback_later()
        fns = {c: (lambda k=compiled[c][0], w=compiled[c][1]: fp8_ops.flash_attn_fp8_func(inputs, None, causal, window_size=w,
                                                                                       kernel=k)) for c in sorted(compiled)}
        ms = time_cuda_ms_interleaved(fns, 5, 20, 20.0)
        print(f"b{args.batch} s{args.seqlen} d{d} causal={causal} window={window}: " +
              ", ".join(f"{c} {compiled[c][0].spec.name} {ms[c]:.4f} ms" for c in sorted(compiled)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
