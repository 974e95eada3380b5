"""Backward kernels on the GPU: float64 checks on ragged/GQA shapes, then TFLOP/s beside torch SDPA's
cuDNN and flash backends (FA3 setup: 16k tokens, hidden 2048), all in this process.

A quick loop for kernel authors; the real suite is tests/gpu/test_bwd_gpu.py and `fa3gen bench`.
Usage: python scripts/bwd_smoke.py [--time] [--hdims 64,96,128,192,256] [--dtypes bf16,fp16]
       python scripts/bwd_smoke.py --spec JSON [--spec JSON ...]   # check and time these bwd specs
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen.bench import PEERS, _bwd_fns, attn_bwd_flops, time_cuda_ms  # noqa: E402
from fa3gen.ops import _backward_impl, _forward_impl  # noqa: E402
from fa3gen.reference import attention_reference_grads  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [  # b, sq, sk, hq, hkv
    (1, 128, 128, 1, 1), (2, 200, 333, 4, 2), (1, 1000, 517, 6, 2), (2, 257, 1031, 2, 1), (1, 2048, 2048, 4, 4),
]


def check(d: int, dtype: str, causal: bool, deterministic: bool, kernel=None) -> bool:
    ok = True
    for b, sq, sk, hq, hkv in SHAPES:
        torch.manual_seed(sq * 7 + sk)
        dt = DTYPES[dtype]
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
        dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
        scale = 1 / math.sqrt(d)
        out, lse = _forward_impl(q, k, v, scale, causal)
        dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, scale, causal, deterministic, kernel)
        torch.cuda.synchronize()
        refs = attention_reference_grads(q, k, v, dout, scale, causal)
        errs = []
        for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
            rel = float((g.double() - r).norm() / r.norm().clamp_min(1e-30))
            errs.append(f"{name} {rel:.2e}")
            ok &= bool(torch.isfinite(g).all()) and rel < 2e-2
        print(f"{kernel.spec.name + ' ' if kernel else ''}d{d} {dtype} causal={causal} det={deterministic} b{b} sq{sq} sk{sk} h{hq}/{hkv}: "
              + ", ".join(errs), flush=True)
    return ok


def time_bwd(d: int, dtype: str, causal: bool, kernel=None) -> None:
    """TFLOP/s of fa3gen's backward (`kernel`, else the registry's) beside SDPA's cuDNN and flash
    backward on the FA3 setup, through the bench's own implementations."""
    for s in (512, 2048, 8192, 16384):
        b, h = 16384 // s, 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=DTYPES[dtype], generator=gen) for _ in range(3))
        fns, _ = _bwd_fns(q, k, v, 1 / math.sqrt(d), causal, gen, kernel)
        flops = attn_bwd_flops(b, h, s, s, d, causal)
        row = [f"{kernel.spec.name + ' ' if kernel else ''}d{d} {dtype} s{s}{' causal' if causal else ''}"]
        for impl in ("fa3gen", *PEERS):
            try:
                row.append(f"{impl} {flops / time_cuda_ms(fns[impl], 3, 10, 50.0) / 1e9:.0f}")
            except Exception as e:  # e.g. a backend that does not take the case
                row.append(f"{impl} n/a ({(str(e).splitlines() or [type(e).__name__])[0][:40]})")
        print(" | ".join(row), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--hdims", default="64,96,128,192,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--spec", action="append", default=[], help="a bwd KernelSpec as JSON (repeatable)")
    args = ap.parse_args()
    ok = True
    if args.spec:
        for text in args.spec:
            kernel = fa3gen.compile(text)
            spec = kernel.spec
            ok &= check(spec.head_dim, spec.dtype, spec.causal, spec.deterministic, kernel)
            time_bwd(spec.head_dim, spec.dtype, spec.causal, kernel)
        print("ALL OK" if ok else "FAILURES", flush=True)
        return 0 if ok else 1
    for d in (int(x) for x in args.hdims.split(",")):
        for dtype in args.dtypes.split(","):
            for causal in (False, True):
                ok &= check(d, dtype, causal, deterministic=(d == 128 and causal))
    if args.time:
        for d in (int(x) for x in args.hdims.split(",")):
            for causal in (False, True):
                time_bwd(d, "bf16", causal)
    print("ALL OK" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
