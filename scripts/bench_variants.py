"""Times fa3gen's attention variants, forward and backward, beside cuDNN SDPA and FlexAttention, in
one process.

Usage (on a Hopper GPU): python scripts/bench_variants.py [--seqlens 4096,16384] [--pass fwd|bwd|both]
bf16, hdim 128, 16 heads, batch = 16384 / seqlen. TFLOP/s count the FLOPs of the full (or causal)
problem (backward: 2.5x the forward's), so a window's speed-up shows as a higher number; "ms" is
the median time of the pass alone (the backward is timed from saved forward outputs), every
implementation of a pass timed interleaved with the others. FlexAttention
is torch.compile'd flex_attention with the same score_mod / mask_mod and its BlockMask; the
"x flex" columns divide its time by fa3gen's.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen
from fa3gen.bench import attn_bwd_flops, attn_fwd_flops, time_cuda_ms_interleaved
from fa3gen.spec_attention import _bias_dtype

WINDOW = 1024
SOFTCAP = 30.0


def _flex():
    """torch.compile'd flex_attention and create_block_mask, or the reason they are unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # One compiled graph per (variant, shape): more than dynamo's default 8 recompiles, past
        # which it would fall back to the unfused, score-materializing implementation.
        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 256)
        return torch.compile(flex_attention, dynamic=False), create_block_mask, None
    except Exception as e:  # no triton, an older torch
        return None, None, f"{type(e).__name__}: {e}"


def _register_path(bias: torch.Tensor) -> fa3gen.KernelSpec:
    """The hdim 128 bf16 forward spec that reads a bias of this dtype into registers (no bias_staging)."""
    return fa3gen.KernelSpec(head_dim=128, bias=True, bias_dtype=_bias_dtype(bias))


def _variants(slopes: torch.Tensor, bias: torch.Tensor,
              bias16: torch.Tensor) -> list[tuple[str, bool, dict[str, Any], Callable | None, Callable | None]]:
    """Each variant: (name, causal, flash_attn_func keywords, FlexAttention's score_mod and
    mask_mod for the same variant). sq == sk, so Flex's top-left masks equal fa3gen's bottom-right ones.
    `bias` (1, h, s, s, float32) and `bias16` (the same in bf16, read as it is: bias_dtype)
    require grad: the learned-bias rows' backward gives them their gradient too (FlexAttention's
    for a captured buffer that requires grad)."""
    causal = lambda b, h, q, kv: kv <= q  # noqa: E731
    softcap = lambda s, b, h, q, kv: SOFTCAP * torch.tanh(s / SOFTCAP)  # noqa: E731
    return [
        ("learned bias (h, s, s)", False, {"attn_bias": bias}, lambda s, b, h, q, kv: s + bias[0, h, q, kv], None),
        ("learned bias bf16 (h, s, s)", False, {"attn_bias": bias16}, lambda s, b, h, q, kv: s + bias16[0, h, q, kv], None),
        # The same two with the forward reading the bias tiles into registers: the default for rows
        # not 16-byte aligned (aligned, as here, they are staged through shared memory: bias_staging).
        ("learned bias, register path (h, s, s)", False, {"attn_bias": bias, "variant_spec": _register_path(bias)},
         lambda s, b, h, q, kv: s + bias[0, h, q, kv], None),
        ("learned bias bf16, register path (h, s, s)", False, {"attn_bias": bias16, "variant_spec": _register_path(bias16)},
         lambda s, b, h, q, kv: s + bias16[0, h, q, kv], None),
        ("plain", False, {}, None, None),
        ("causal", True, {}, None, causal),
        (f"causal, window ({WINDOW}, 0)", True, {"window_size": (WINDOW, 0)},
         None, lambda b, h, q, kv: (kv <= q) & (q - kv <= WINDOW)),
        (f"window ({WINDOW}, {WINDOW})", False, {"window_size": (WINDOW, WINDOW)},
         None, lambda b, h, q, kv: (q - kv <= WINDOW) & (kv - q <= WINDOW)),
        (f"softcap {SOFTCAP:g}", False, {"softcap": SOFTCAP}, softcap, None),
        (f"causal, softcap {SOFTCAP:g}", True, {"softcap": SOFTCAP}, softcap, causal),
        ("alibi", False, {"alibi_slopes": slopes}, lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs(), None),
    ]


TIMING = (3, 10, 2.0)  # warm-up calls, interleaved rounds (the median counts), ms per round at least


def _backward_timer(forward: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> Callable[[], Any]:
    """A call that runs only the backward of one saved forward (its graph kept across calls)."""
    out = forward()
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--pass", dest="passes", choices=("fwd", "bwd", "both"), default="both")
    ap.add_argument("--no-flex", action="store_true",
                    help="leave FlexAttention out (its compiles run beside the timing otherwise)")
    ap.add_argument("--variants", default="",
                    help="comma-separated prefixes of the variant names to time (default: all), e.g. 'learned,plain'")
    args = ap.parse_args()
    wanted = [w.strip() for w in args.variants.split(",") if w.strip()]
    passes = ("fwd", "bwd") if args.passes == "both" else (args.passes,)
    flex, create_block_mask, flex_missing = _flex() if not args.no_flex else (None, None, "--no-flex")
    if flex_missing:
        print(f"FlexAttention unavailable here ({flex_missing}): its columns are empty")
    d, h = 128, 16
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 16384 // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # (b, h, s, d) for SDPA, flex
        slopes = torch.rand(h, device="cuda")
        bias = torch.randn(1, h, s, s, device="cuda", requires_grad=True)
        bias16 = bias.detach().to(torch.bfloat16).requires_grad_()
        print(f"\n## bf16 hdim {d}, batch {b}, seqlen {s}, {h} heads\n")
        head = "| case |" + "".join(f" {p} ms | {p} TFLOP/s | flex {p} ms | x flex |" for p in passes)
        print(head + "\n|---|" + "---|---|---|---|" * len(passes))
        # (name, causal, forward, the tensors it differentiates, FlexAttention's forward or None)
        # and the tensors Flex's backward differentiates.
        rows: list[tuple[str, bool, Callable[[], torch.Tensor], tuple[torch.Tensor, ...], Callable | None,
                         tuple[torch.Tensor, ...]]] = []
        for name, causal, kw, score_mod, mask_mod in _variants(slopes, bias, bias16):
            if wanted and not any(name.startswith(w) for w in wanted):
                continue
            learned = (kw["attn_bias"],) if "attn_bias" in kw else ()  # the backward differentiates it too
            flex_fwd = None
            if flex is not None:
                block_mask = create_block_mask(mask_mod, b, h, s, s) if mask_mod else None
                flex_fwd = (lambda sm=score_mod, bm=block_mask: flex(qt, kt, vt, score_mod=sm, block_mask=bm))
            rows.append((name, causal, lambda kw=kw, causal=causal: fa3gen.flash_attn_func(q, k, v, causal=causal, **kw),
                         (q, k, v, *learned), flex_fwd, (qt, kt, vt, *learned)))
        for causal, name in ((False, "cuDNN plain"), (True, "cuDNN causal")):
            def cudnn(causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            rows.append((name, causal, cudnn, (qt, kt, vt), None, ()))
        # Every implementation of a pass is timed interleaved with the others (rotated rounds), so
        # none of them gets the GPU's early clocks; their first calls (FlexAttention's compiles,
        # fa3gen's loads) run in the warm-up.
        ms: dict[str, dict[str, float]] = {}  # pass -> implementation -> median ms
        for p in passes:
            fns: dict[str, Callable[[], Any]] = {}
            for name, _, fwd, inputs, flex_fwd, flex_inputs in rows:
                fns[name] = fwd if p == "fwd" else _backward_timer(fwd, inputs)
                if flex_fwd is not None:
                    fns[f"flex {name}"] = flex_fwd if p == "fwd" else _backward_timer(flex_fwd, flex_inputs)
            ms[p] = {name: _ms(name, t) for name, t in time_cuda_ms_interleaved(fns, *TIMING).items()}
        for name, causal, *_ in rows:
            cells = []
            for p in passes:
                flops = (attn_fwd_flops if p == "fwd" else attn_bwd_flops)(b, h, s, s, d, causal)
                t, flex_t = (ms[p].get(key, math.nan) for key in (name, f"flex {name}"))
                cells.append(f" {t:.3f} | {flops / (t * 1e-3) / 1e12:.1f} | {flex_t:.3f} | {flex_t / t:.2f} |")
            print(f"| {name} |" + "".join(cells), flush=True)
        for p in passes:  # block skipping: a window against the same kernels without it
            speedups = [f"{w} {ms[p][base] / ms[p][w]:.1f}x faster than {base}" for w, bases in (
                (f"causal, window ({WINDOW}, 0)", ("causal", "plain")), (f"window ({WINDOW}, {WINDOW})", ("plain",)))
                for base in bases if w in ms[p] and base in ms[p]]
            if speedups:
                print(f"\n{p}: " + "; ".join(speedups))


def _ms(name: str, t: float | Exception) -> float:
    """A timing, or NaN for an implementation that raised (saying why)."""
    if isinstance(t, Exception):
        print(f"{name} failed: {type(t).__name__}: {str(t).splitlines()[0] if str(t) else ''}")
        return math.nan
    return t


if __name__ == "__main__":
    main()
