"""Times forward or backward specs side by side with cuDNN and FA2 (torch SDPA), one process, the FA3 setup.

For each (dtype, head_dim, causal) group of the given specs and each seqlen (16k tokens, hidden
2048), every spec's kernel and both peers run on the same inputs with the bench's CUDA-event
timer, interleaved (median of rounds that each run every implementation once, in rotated
order); each kernel's output is checked against cuDNN's first. A quick way to choose
between tiles or switches by measurement. --graph times every implementation as replays of a
CUDA graph of 10 calls instead, which takes the host's per-call cost out: the kernels alone.
--variant JSON gives the built-in variants' values for specs that compile them in (window_size,
softcap, and "alibi": true for per-head slopes in [0, 1)); each kernel's output is then checked
against fa3gen.flash_attn_func's with the same values (the default kernel of that variant), and
the peers, timed without the variant, count the same FLOPs (the full or causal problem's).
Backward specs (kind "bwd") time fa3gen's op-level backward with that kernel against autograd
through each SDPA backend, as `fa3gen bench --pass bwd` does, on the same q, k, v and dout; each
kernel's dq, dk, dv are checked against cuDNN's (with --variant: against the default backward
kernel's with the same values, after fa3gen's forward with them).

--shapes BxSQxSKxH,... times those shapes (batch, seqlen_q, seqlen_k, heads) instead; causal with
seqlen_q != seqlen_k counts the bottom-right mask's FLOPs and leaves SDPA out (it masks top-left),
checking each kernel against the first.

Usage: python scripts/compare_specs.py [--seqlens 512,1024,2048] [--graph] [--variant JSON] SPEC_JSON [SPEC_JSON ...]
       python scripts/compare_specs.py @specs.jsonl   # one spec JSON per line
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from itertools import groupby
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen.variant_args import VariantArgs  # noqa: E402
from fa3gen.bench import (CALLS_PER_GRAPH, _bwd_fns, _fwd_fns, attn_bwd_flops, attn_fwd_flops,  # noqa: E402
                          bench_cases, cuda_graph_of, time_cuda_ms_interleaved)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def variant_kwargs(variant: dict, h: int) -> dict:
    """flash_attn_func / kernel keywords for --variant's values (alibi: per-head slopes)."""
    out = {k: v for k, v in variant.items() if k != "alibi"}
    if "window_size" in out:
        out["window_size"] = tuple(out["window_size"])
    if variant.get("alibi"):
        out["alibi_slopes"] = torch.rand(h, device="cuda")  # as scripts/bench_variants.py
    return out


def _fwd_kernel_fns(kernels: list, q, k, v, scale: float, causal: bool, variant: dict | None,
                    tol: float) -> tuple[dict, int]:
    """The peers' and each forward kernel's {name: fn}, and how many kernels' outputs mismatched."""
    peers, _ = _fwd_fns(q, k, v, scale, causal)
    kw = variant_kwargs(variant, q.shape[2]) if variant else {}
    if variant:
        ref = fa3gen.flash_attn_func(q, k, v, scale, causal, **kw)
    elif causal and q.shape[1] != k.shape[1]:
        ref = kernels[0](q, k, v, softmax_scale=scale)  # SDPA's causal mask is top-left there: the first kernel's
    else:
        ref = peers["cudnn"]().transpose(1, 2)
    fns, failed = {"cudnn": peers["cudnn"], "flash": peers["flash"]}, 0
    for kernel in kernels:
        fn = lambda kernel=kernel: kernel(q, k, v, softmax_scale=scale, **kw)  # noqa: E731
        diff = float((fn().float() - ref.float()).abs().max())
        if diff > tol:
            failed += 1
            print(f"MISMATCH {kernel.spec.name} s{q.shape[1]}: max abs diff vs {'the default' if variant else 'cuDNN'} "
                  f"{diff:.1e}", flush=True)
        fns[kernel.spec.name] = fn
    return fns, failed


def _bwd_kernel_fns(kernels: list, q, k, v, scale: float, causal: bool, seed: int,
                    tol: float, variant: dict | None) -> tuple[dict, int]:
    """The peers' and each backward kernel's {name: fn} on one dout (the same seed), and how many
    kernels' gradients mismatched cuDNN's (with a variant: the default kernel's with its values)."""
    values = VariantArgs(**variant_kwargs(variant, q.shape[2])) if variant else None
    fns, ref, failed = {}, None, 0
    for kernel in kernels:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        impls, outputs = _bwd_fns(q, k, v, scale, causal, gen, kernel, values)
        if ref is None:
            fns.update(cudnn=impls["cudnn"], flash=impls["flash"])
            if values is None:
                ref = outputs["cudnn"]()
            else:
                gen = torch.Generator(device="cuda").manual_seed(seed)
                ref = _bwd_fns(q, k, v, scale, causal, gen, None, values)[1]["fa3gen"]()
        # Largest error relative to the largest gradient entry, over dq, dk and dv.
        diff = max(float((g.float() - r.float()).abs().max() / r.float().abs().max())
                   for g, r in zip(outputs["fa3gen"](), ref))
        if not diff <= tol:
            failed += 1
            print(f"MISMATCH {kernel.spec.name} s{q.shape[1]}: dq/dk/dv vs {'the default' if variant else 'cuDNN'}: "
                  f"max abs diff / max abs {diff:.1e}",
                  flush=True)
        fns[kernel.spec.name] = impls["fa3gen"]
    return fns, failed


def compare(specs: list[fa3gen.KernelSpec], seqlens: list[int], warmup: int = 5, reps: int = 20,
            graph: bool = False, variant: dict | None = None,
            shapes: list[tuple[int, int, int, int]] | None = None) -> int:
    failures = 0
    key = lambda s: (s.kind, s.dtype, s.head_dim, s.causal)  # noqa: E731
    for (kind, dt, d, causal), group in groupby(sorted(specs, key=key), key=key):
        group = list(group)
        kernels = [fa3gen.compile(s) for s in group]
        names = [s.name for s in group]
        how = f", CUDA graphs of {CALLS_PER_GRAPH} calls" if graph else ""
        print(f"\n### {kind} {dt} d{d} {'causal' if causal else 'full'} (TFLOP/s{how}; ratio to the best peer)")
        print(f"| {'b x sq x sk x h' if shapes else 'seqlen'} | cuDNN | FA2 | " + " | ".join(names) + " |")
        print("|---" * (3 + len(names)) + "|")
        cases = shapes or [(b, s, s, h) for _, s, b, h, _ in bench_cases([d], seqlens, [causal])]
        for b, s, sk, h in cases:
            gen = torch.Generator(device="cuda").manual_seed(s + d)
            q = torch.randn(b, s, h, d, device="cuda", dtype=DTYPES[dt], generator=gen)
            k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=DTYPES[dt], generator=gen) for _ in range(2))
            scale = 1 / math.sqrt(d)
            tol = (2e-2 if dt == "bf16" else 4e-3) * 4
            if kind == "bwd":
                fns, failed = _bwd_kernel_fns(kernels, q, k, v, scale, causal, s + d, tol / 2, variant)
                flops = attn_bwd_flops(b, h, s, sk, d, causal)
            else:
                fns, failed = _fwd_kernel_fns(kernels, q, k, v, scale, causal, variant, tol)
                flops = attn_fwd_flops(b, h, s, sk, d, causal)
                if causal and s != sk:  # the keys each query sees, the diagonal aligned bottom-right
                    flops = 4.0 * b * h * d * sum(max(0, min(sk, sk - s + i + 1)) for i in range(s))
                    fns = {name: fn for name, fn in fns.items() if name not in ("cudnn", "flash")}  # top-left masks
            failures += failed
            calls = CALLS_PER_GRAPH if graph else 1
            if graph:
                fns = {name: cuda_graph_of(fn, calls) for name, fn in fns.items()}
            ms = time_cuda_ms_interleaved(fns, warmup, reps, 2.0)
            # A peer that refuses the problem (SDPA's causal mask with seqlen_q != seqlen_k) reads n/a;
            # the ratios are then to the first spec's kernel.
            tflops = {name: flops * calls / t / 1e9 for name, t in ms.items() if isinstance(t, float)}
            peers = [tflops[p] for p in ("cudnn", "flash") if p in tflops]
            best = max(peers) if peers else tflops[names[0]]
            cells = [f"{tflops[name]:.1f} ({tflops[name] / best:.2f}x)" for name in names]
            peer_cells = " | ".join(f"{tflops[p]:.1f}" if p in tflops else "n/a" for p in ("cudnn", "flash"))
            print(f"| {f'{b} x {s} x {sk} x {h}' if shapes else s} | {peer_cells} | " + " | ".join(cells) + " |", flush=True)
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], fromfile_prefix_chars="@")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,16384")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host cost per call)")
    parser.add_argument("--variant", type=json.loads, default=None,
                        help='the variants\' values, e.g. \'{"window_size": [1024, 0]}\'')
    parser.add_argument("--shapes", default=None,
                        help="these shapes instead of the FA3 setup: BxSQxSKxH,... (batch, seqlen_q, seqlen_k, heads)")
    parser.add_argument("specs", nargs="+", help="spec JSON")
    args = parser.parse_args(argv)
    specs = [fa3gen.KernelSpec.from_json(s) for s in args.specs]
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")] if args.shapes else None
    return compare(specs, [int(x) for x in args.seqlens.split(",")], graph=args.graph, variant=args.variant,
                   shapes=shapes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
