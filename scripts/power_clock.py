"""Sustained throughput, SM clock and power of one kernel at a time: is it power-limited?

Each case runs alone for --seconds in batches of 20 calls (CUDA events; the median batch), while
`nvidia-smi` samples the SM clock and the board power every 100 ms. A kernel whose power sits at
the board's limit runs at whatever clock that power allows: there, energy per cycle (instructions,
L2 traffic), not the schedule alone, decides its speed. ncu's single launches do not show this:
they run at the unthrottled clock.

Cases (the FA3 setup, 16k tokens, hidden 2048): mm_fp8 (torch._scaled_mm e4m3 8192³), mm_bf16
(bf16 8192³ matmul), fp8_D (fa3gen's e4m3 forward at hdim D on fa3gen.fp8.prepare'd inputs),
bf16_D (fa3gen's bf16 forward), cudnn_D (torch SDPA's cuDNN backend); a --spec JSON (extra fields
of the fp8/bf16 kernel's spec, e.g. '{"kv_multicast": true}') times that kernel instead.

Usage: python scripts/power_clock.py [--seconds 5] [--seqlen 16384] [--spec JSON] CASE [CASE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen import fp8, fp8_ops  # noqa: E402

GEMM_N = 8192


def case_fn(case: str, seqlen: int, spec: dict) -> tuple[Callable[[], object], float]:
    """The case's call and its FLOPs."""
    kind, _, dim = case.partition("_")
    if kind == "mm":
        n = GEMM_N
        if dim == "fp8":
            a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            return (lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), 2 * n**3
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return (lambda: a @ b), 2 * n**3
    d = int(dim)
    batch, heads = max(1, 16384 // seqlen), 2048 // d
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * heads * seqlen * seqlen * d
    if kind == "fp8":
        inputs = fp8.prepare(q, k, v, "block", hadamard=True)
        kernel = fa3gen.compile(fa3gen.KernelSpec(head_dim=d, dtype="e4m3", **spec)) if spec else None
        return (lambda: fp8_ops.flash_attn_fp8_func(inputs, kernel=kernel)), flops
    if kind == "bf16":
        kernel = fa3gen.compile(fa3gen.KernelSpec(head_dim=d, **spec)) if spec else None
        return (lambda: kernel(q, k, v) if kernel else fa3gen.flash_attn_func(q, k, v)), flops
    if kind == "cudnn":
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
        return cudnn, flops
    raise SystemExit(f"unknown case {case!r}")


def sustained(fn: Callable[[], object], seconds: float) -> float:
    """Median ms per call over batches of 20 back-to-back calls for `seconds`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    stop = time.time() + seconds
    while time.time() < stop:
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 20)
    return statistics.median(per_call)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--spec", default="{}", help="extra spec fields for the fp8_D / bf16_D kernel")
    args = ap.parse_args()
    spec = json.loads(args.spec)
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__} · spec {spec or 'default'}")
    for case in args.cases:
        fn, flops = case_fn(case, args.seqlen, spec)
        fn()
        torch.cuda.synchronize()
        sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                    "-lms", "100"], stdout=subprocess.PIPE, text=True)
        ms = sustained(fn, args.seconds)
        sampler.terminate()
        samples = [tuple(float(x) for x in line.split(",")) for line in sampler.communicate()[0].splitlines()
                   if line.count(",") == 1 and line.replace(",", "").replace(".", "").replace(" ", "").isdigit()]
        busy = [s for s in samples if s[1] > 250]  # skip the samples before the first batch lands
        clock = statistics.median(s[0] for s in busy) if busy else float("nan")
        power = statistics.median(s[1] for s in busy) if busy else float("nan")
        print(f"{case}: {ms:.4f} ms, {flops / ms / 1e9:.1f} TFLOP/s, SM clock {clock:.0f} MHz, {power:.0f} W "
              f"({len(busy)} samples)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
