"""Times e4m3 forward specs side by side on given shapes, one process, with cuDNN's bf16 beside them.

For each shape (batch x seqlen_q x seqlen_k x heads), head dim and causality of the given specs: inputs
prepared once (fa3gen.fp8.prepare, per-block scales, Hadamard; K/V blocks that every spec's key
blocks divide), each spec's kernel and torch SDPA's
cuDNN backend on the bf16 inputs timed interleaved (fa3gen.bench.time_cuda_ms_interleaved, median
of rounds); each kernel's output is checked against the first spec's (max difference 1e-2, causal
0.15).

Usage: python scripts/compare_fp8_shapes.py --shapes 1x4096x4096x8,... SPEC_JSON [SPEC_JSON ...]
       python scripts/compare_fp8_shapes.py --shapes ... @specs.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen import fp8, fp8_ops  # noqa: E402
from fa3gen.bench import _fwd_fns, attn_fwd_flops, time_cuda_ms_interleaved  # noqa: E402
from fa3gen.variant_args import VariantArgs  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], fromfile_prefix_chars="@")
    parser.add_argument("--shapes", required=True, help="BxSQxSKxH,... (batch, seqlen_q, seqlen_k, heads)")
    parser.add_argument("--qk-max-abs", type=float, default=None,
                        help="quantize Q and K to |x| <= this (prepare's qk_max_abs; default: prepare's)")
    parser.add_argument("specs", nargs="+", help="e4m3 spec JSON")
    args = parser.parse_args(argv)
    specs = [fa3gen.KernelSpec.from_json(s) for s in args.specs]
    failures = 0
    for d, causal in sorted({(s.head_dim, s.causal) for s in specs}):
        group = [s for s in specs if (s.head_dim, s.causal) == (d, causal)]
        kernels = [fa3gen.compile(s) for s in group]
        # K/V scale blocks that every spec's key blocks divide (the registry's default, or a multiple).
        q_rows, kv_rows = fp8.default_block_rows(d)
        block_rows = (q_rows, math.lcm(kv_rows, *(s.block_n for s in group)))
        print(f"\n### e4m3 d{d} {'causal' if causal else 'not causal'} (TFLOP/s; cuDNN on the bf16 inputs; "
              f"scale blocks of {block_rows[0]} query and {block_rows[1]} key rows)")
        print("| b x sq x sk x h | cuDNN bf16 | " + " | ".join(s.name for s in group) + " |")
        print("|---" * (2 + len(group)) + "|")
        for shape in args.shapes.split(","):
            b, sq, sk, h = (int(x) for x in shape.split("x"))
            gen = torch.Generator(device="cuda").manual_seed(sq + sk + d)
            q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            inputs = fp8.prepare(q, k, v, "block", block_size=block_rows, hadamard=True, seed=0,
                                 qk_max_abs=args.qk_max_abs)
            scale = 1 / math.sqrt(d)
            fns = {"cudnn": _fwd_fns(q, k, v, scale, causal)[0]["cudnn"]}
            outs = []
            for kernel in kernels:
                out = torch.empty(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(b, h, sq, device="cuda")
                fns[kernel.spec.name] = lambda out=out, lse=lse, kernel=kernel: fp8_ops._launch(
                    inputs, out, lse, scale, kernel, VariantArgs())
                fns[kernel.spec.name]()
                outs.append(out.clone())
            diffs = [float((o.float() - outs[0].float()).abs().max()) for o in outs]
            # A causal row of a few keys averages no rounding away: each kernel's P, rounded to e4m3
            # (2^-4 relative) under its own running max, moves O by up to ~5% of V's spread there.
            failures += sum(x > (0.15 if causal else 1e-2) for x in diffs)
            ms = time_cuda_ms_interleaved(fns, 5, 20, 2.0)
            flops = attn_fwd_flops(b, h, sq, sk, d, causal)
            cells = [f"{flops / ms[s.name] / 1e9:.1f}" for s in group]
            print(f"| {b} x {sq} x {sk} x {h} | {flops / ms['cudnn'] / 1e9:.1f} | " + " | ".join(cells) + " |"
                  + f" max diff vs the first: {max(diffs):.1e}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
