"""Host-side cost of one call, beside the GPU time: tells whether a short case is launch-bound,
and where fa3gen's host time goes.

Usage (on the GPU machine): python scripts/host_overhead.py [--seqlen 512] [--hdim 128]
For bf16 and fp16 at the bench's shape (16k tokens, hidden 2048), causal and not:
  * the CPU time per call of fa3gen.flash_attn_func and of torch SDPA (cuDNN) when queueing calls
    without waiting, and the GPU time per call from CUDA events;
  * the calls of training and of the attn_bias path: q, k, v requiring grad (fa3gen, cuDNN), and
    fa3gen with a (1, h, s, s) float32 attn_bias, with and without grad;
  * fa3gen's call taken apart: a repeated signature (launched from its plan, fa3gen.launch) and a
    first one (the full path), and each step of both timed on its own (checks, output allocation,
    kernel lookup, parameter packing, scratch, the library's launcher).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen
from fa3gen import launch, ops
from fa3gen.variant_args import VariantArgs


def per_call_us(fn: Callable[[], Any], n: int = 200) -> tuple[float, float]:
    """(host µs per call while queueing n calls, GPU µs per call)."""
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


def host_us(fn: Callable[[], Any], n: int = 200, repeats: int = 7) -> float:
    """Median over `repeats` of the host µs per call of n calls (synchronized between repeats, so
    a step that launches work never waits on a full queue)."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def breakdown(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> list[tuple[str, float]]:
    """Host µs of each step of the eager flash_attn_func path, and of the whole call."""
    b, sq, hq, d = q.shape
    scale = 1.0 / math.sqrt(d)
    variant = VariantArgs()
    kernel = ops._kernel_for(d, d, ops._DTYPES[q.dtype], causal, seqlen_q=sq)
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    params = ops._make_params(q, k, v, out, lse, scale)
    stream = launch.current_stream(q.device)
    launch.attach_workspace(params, kernel.workspace_bytes, q.device, stream)
    fa3gen.flash_attn_func(q, k, v, causal=causal)  # the signature's plan
    key = launch.plan_key(q, k, v, None, causal, (-1, -1), 0.0, None)
    plan = launch.plan_for(key)

    def first_call():
        launch.forget_plans()
        fa3gen.flash_attn_func(q, k, v, causal=causal)

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("flash_attn_func, repeated signature (plan)", lambda: fa3gen.flash_attn_func(q, k, v, causal=causal)),
        ("  _eager_fast_path", lambda: ops._eager_fast_path(q, k, v, None)),
        ("  launch.plan_key + plan_for", lambda: launch.plan_for(launch.plan_key(q, k, v, None, causal, (-1, -1), 0.0,
                                                                                  None))),
        ("  plan.run", lambda: plan.run(q, k, v)),
        ("flash_attn_func, first call of a signature (full path)", first_call),
        ("  _check_meta", lambda: ops._check_meta(q, k, v)),
        ("  VariantArgs + check", lambda: VariantArgs((-1, -1), 0.0, None).check()),
        ("  _check_device + _check_alignment + _check_gpu",
         lambda: (ops._check_device(q, k, v), ops._check_alignment(q, k, v), ops._check_gpu(q.device))),
        ("  torch.empty out + lse", lambda: (torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device),
                                             torch.empty((b, hq, sq), dtype=torch.float32, device=q.device))),
        ("  _kernel_for", lambda: ops._kernel_for(d, d, ops._DTYPES[q.dtype], causal, seqlen_q=sq)),
        ("  _make_params", lambda: ops._make_params(q, k, v, out, lse, scale)),
        ("  launch.current_stream", lambda: launch.current_stream(q.device)),
        ("  torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream(q.device).cuda_stream),
        ("  launch.attach_workspace", lambda: launch.attach_workspace(params, kernel.workspace_bytes, q.device,
                                                                     stream)),
        ("  _fill_variant", lambda: ops._fill_variant(params, kernel, variant, q, k, causal)),
        ("  kernel.fwd (ctypes + library launcher)", lambda: kernel.fwd(params, stream)),
        ("torch: x.add_(1) (one small launch)", lambda: lse.add_(1)),
    ]
    return [(name, host_us(fn)) for name, fn in steps]


def grad_and_bias_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       causal: bool) -> list[tuple[str, float, float]]:
    """(name, host µs, GPU µs) per call of the calls that leave the plain eager path: q, k, v
    requiring grad (fa3gen's _EagerAttention, cuDNN through SDPA) and fa3gen's attn_bias path."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (qg, kg, vg))
    bias = torch.randn(1, q.shape[2], q.shape[1], k.shape[1], device=q.device)
    rows = [("fa3gen, q, k, v requiring grad", lambda: fa3gen.flash_attn_func(qg, kg, vg, causal=causal)),
            ("fa3gen, attn_bias (1, h, s, s) fp32",
             lambda: fa3gen.flash_attn_func(q, k, v, causal=causal, attn_bias=bias)),
            ("fa3gen, attn_bias, q, k, v requiring grad",
             lambda: fa3gen.flash_attn_func(qg, kg, vg, causal=causal, attn_bias=bias))]
    out = [(name, *per_call_us(fn)) for name, fn in rows]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out.append(("cuDNN, q, k, v requiring grad",
                    *per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--hdim", type=int, default=128)
    args = parser.parse_args()
    s, d = args.seqlen, args.hdim
    b, h = 16384 // s, 2048 // d
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for causal in (False, True):
            host, gpu = per_call_us(lambda: fa3gen.flash_attn_func(q, k, v, causal=causal))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                host_c, gpu_c = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
            print(f"{dtype} hdim {d} seqlen {s} causal={causal}: fa3gen host {host:.1f} us/call, GPU {gpu:.1f} "
                  f"us/call | cuDNN host {host_c:.1f}, GPU {gpu_c:.1f}", flush=True)
            if dtype is torch.bfloat16:
                for name, host_g, gpu_g in grad_and_bias_rows(q, k, v, causal):
                    print(f"    {name:50s} host {host_g:7.1f} us/call, GPU {gpu_g:7.1f} us/call", flush=True)
                for name, us in breakdown(q, k, v, causal):
                    print(f"    {name:50s} {us:7.2f} us", flush=True)


if __name__ == "__main__":
    main()
