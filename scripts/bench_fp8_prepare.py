"""FP8 input preparation on the GPU: fa3gen.fp8.prepare with the fused kernels against the same
call with torch ops (``fused=False``), and the fused steps one at a time with the memory
bandwidth they reach, in the FA3 setup's shapes (16k tokens, hidden 2048, bf16 inputs).

    python scripts/bench_fp8_prepare.py --hdim 64,128,256 --seqlens 4096,16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fa3gen import fp8, fp8_prepare  # noqa: E402
from fa3gen.bench import bench_cases, time_cuda_ms_interleaved  # noqa: E402

TIMING = (5, 20, 20.0)  # warm-up calls, repetitions (the median counts), ms per repetition at least


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hdim", default="64,128,256")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--profile", type=int, metavar="HDIM", help="then the GPU time of each kernel at this head dim, s16k")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__}")
    print("| case | prepare, fused (ms) | prepare, torch ops (ms) | speedup | Q: Hadamard + quantize (ms, GB/s) | "
          "V: quantize into the kernel layout (ms, GB/s) |")
    print("|---|---|---|---|---|---|")
    hdims, seqlens = ([int(x) for x in a.split(",")] for a in (args.hdim, args.seqlens))
    for d, s, b, h, _ in bench_cases(hdims, seqlens, (False,)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        q_rows, kv_rows = fp8.default_block_rows(d)
        fused = fp8.prepare(q, k, v, fused=True)
        ops = fp8.prepare(q, k, v, fused=False)
        agree = float((fused.q.dequantize() - ops.q.dequantize()).norm() / ops.q.dequantize().norm())
        fns = {
            "fused": lambda: fp8.prepare(q, k, v, fused=True),
            "torch": lambda: fp8.prepare(q, k, v, fused=False),
            "q": lambda: fp8_prepare.quantize(q, "block", q_rows, True, hadamard_seed=0),
            "v": lambda: fp8_prepare.quantize(v, "block", kv_rows, True, kernel_v_layout=True),
        }
        ms = time_cuda_ms_interleaved(fns, *TIMING)
        # Each fused step reads its input twice (amax, then the cast) and writes one byte per value.
        traffic_gb = (2 * q.numel() * q.element_size() + q.numel()) / 1e9
        print(f"| d{d} s{s} b{b} h{h} | {ms['fused']:.3f} | {ms['torch']:.3f} | {ms['torch'] / ms['fused']:.1f}x | "
              f"{ms['q']:.3f}, {traffic_gb / ms['q'] * 1e3:.0f} | {ms['v']:.3f}, {traffic_gb / ms['v'] * 1e3:.0f} |"
              f"  (fused vs torch-ops Q, dequantized: {agree:.1e} relative)", flush=True)
    if args.profile:
        profile_kernels(args.profile)
    return 0


def profile_kernels(head_dim: int) -> None:
    """GPU time of each fused kernel (torch.profiler, CUPTI), at s16k: what the timed calls spend
    on the GPU apart from the host's launch overhead."""
    from torch.profiler import ProfilerActivity, profile

    d, s, b, h, _ = next(iter(bench_cases([head_dim], [16384], (False,))))
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        fp8.prepare(q, k, v, fused=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fp8.prepare(q, k, v, fused=True)
        torch.cuda.synchronize()
    print(f"# d{d} s{s} b{b} h{h}: 10 calls of fp8.prepare(fused=True)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    sys.exit(main())
