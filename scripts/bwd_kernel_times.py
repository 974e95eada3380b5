"""Where a backward's time goes: each GPU kernel (and memset) of fa3gen's backward and of the SDPA
peers' (cuDNN, flash), timed by torch.profiler on the same inputs, in the bench's setup.

For each case the per-call device time of every kernel is printed (mean over --calls calls after a
warm-up), with the main kernel's share and TFLOP/s, so the fixed costs around the main kernel
(dQ accumulator zeroing, preprocess, dQ conversion) can be told from the main kernel itself.
--spec JSON times that backward spec for fa3gen instead of the registry's (e.g. a scheduler).
--under-ncu only runs each implementation --calls + 1 times, for ncu to profile (no torch.profiler).

Usage (on the GPU machine): python scripts/bwd_kernel_times.py --hdim 64,128 --seqlens 4096,16384 [--causal]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen.bench import _bwd_fns, _int_list, attn_bwd_flops, bench_cases  # noqa: E402


def kernel_times(fn, calls: int) -> dict[str, float]:
    """{kernel name: mean device ms per call} of fn's GPU work."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us() / 1e3
    return {name: ms / calls for name, ms in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--spec", default=None, help="backward spec JSON for fa3gen (default: the registry's)")
    ap.add_argument("--under-ncu", action="store_true", help="just run the calls (ncu profiles them)")
    args = ap.parse_args()
    for d, s, b, h, _ in bench_cases(_int_list(args.hdim), _int_list(args.seqlens), [args.causal]):
        kernel = None
        if args.spec:
            fields = {**json.loads(args.spec), "kind": "bwd", "head_dim": d, "causal": args.causal}
            kernel = fa3gen.compile(fa3gen.KernelSpec(**fields))
        gen = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        fns, _ = _bwd_fns(q, k, v, 1 / math.sqrt(d), args.causal, gen, kernel)
        flops = attn_bwd_flops(b, h, s, s, d, args.causal)
        print(f"\n### d{d} s{s} b{b} h{h}{' causal' if args.causal else ''}: device ms per call")
        for impl, fn in fns.items():
            if args.under_ncu:
                for _ in range(args.calls + 1):
                    fn()
                torch.cuda.synchronize()
                continue
            times = kernel_times(fn, args.calls)
            total = sum(times.values())
            main_name, main_ms = max(times.items(), key=lambda kv: kv[1])
            print(f"- {impl}: total {total:.3f} ms ({flops / total / 1e9:.1f} TFLOP/s); main kernel "
                  f"{main_ms:.3f} ms ({flops / main_ms / 1e9:.1f} TFLOP/s, {main_ms / total:.1%} of the total)")
            for name, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"    {ms:8.3f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
