"""A/B of a template change: the same specs rendered from two template trees, timed in one process.

A spec switch is how most kernel changes are measured (scripts/compare_specs.py); a change inside
a shared header or partial has no switch. Copy templates/ aside before the change, then give the
copy as --old: every spec is compiled from both trees (the cache keys differ by the sources) and
the two kernels run interleaved on the same inputs (FA3 setup: 16k tokens, hidden 2048), outputs
compared. e4m3 specs run on fa3gen.fp8.prepare'd inputs (--granularity of their scales; with
"block", --block-rows: scale blocks of one tile, prepare's default, or Q:KV rows). --variant JSON
gives the built-in variants' values for specs that compile them in, as in compare_specs.py
(window_size, softcap, "alibi": true); TFLOP/s then count the full or causal problem's FLOPs.

Usage: cp -r templates /tmp/templates_old; (edit templates/); then on the GPU machine
       python scripts/compare_templates.py --old /tmp/templates_old [--new TREE] [--seqlens 4096,16384]
              [--granularity block,head] [--block-rows tile,prepare,128:128] [--variant JSON]
              SPEC [SPEC ...]     # registry names or spec JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen import fp8, fp8_ops, registry  # noqa: E402
from fa3gen.bench import attn_fwd_flops, bench_cases, time_cuda_ms_interleaved  # noqa: E402

from compare_specs import variant_kwargs  # noqa: E402  (scripts/ is on the path: this script's directory)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.bfloat16}  # e4m3: prepared from bf16


def compile_from(templates: Path | None, spec: fa3gen.KernelSpec):
    """fa3gen.compile(spec) rendered from `templates` (None: the current tree)."""
    if templates is None:
        return fa3gen.compile(spec)
    os.environ["FA3GEN_TEMPLATES_DIR"] = str(templates.resolve())
    try:
        return fa3gen.compile(spec)
    finally:
        del os.environ["FA3GEN_TEMPLATES_DIR"]


def call_of(spec: fa3gen.KernelSpec, kernel, inputs, variant: dict):
    """One launch of kernel on inputs: (q, k, v) with the variant's keywords, or Fp8Inputs for an e4m3 spec."""
    if spec.is_fp8:
        return lambda: fp8_ops.flash_attn_fp8_func(inputs, None, spec.causal, kernel=kernel)
    return lambda: kernel(*inputs, **variant)


def scalings(spec: fa3gen.KernelSpec, granularities: str, block_rows: str) -> list[tuple[str, tuple[int, int] | None]]:
    """(granularity, block scales' (Q, KV) rows) to time an e4m3 spec on; ("-", None) for 16-bit."""
    if not spec.is_fp8:
        return [("-", None)]
    rows = {"tile": (spec.block_m, spec.block_n), "prepare": fp8.default_block_rows(spec.head_dim)}
    out: list[tuple[str, tuple[int, int] | None]] = []
    for granularity in granularities.split(","):
        if granularity != "block":
            out.append((granularity, None))
            continue
        for r in block_rows.split(","):
            pair = rows[r] if r in rows else tuple(int(x) for x in r.split(":"))
            if (granularity, pair) not in out:  # one tile may be prepare's default
                out.append((granularity, pair))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="the template tree before the change")
    ap.add_argument("--new", type=Path, default=None, help="the template tree after it (default: the current one)")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--granularity", default="block", help="e4m3 scales, comma-separated: tensor, head, block")
    ap.add_argument("--block-rows", default="tile",
                    help="block scales' rows, comma-separated: tile (one tile of the spec), prepare (its default), Q:KV")
    ap.add_argument("--variant", type=json.loads, default=None, help="built-in variants' values, e.g. "
                    "'{\"window_size\": [1024, 0]}' (see compare_specs.py)")
    ap.add_argument("specs", nargs="+")
    args = ap.parse_args(argv)
    print("| spec | seqlen | scales | old TFLOP/s | new TFLOP/s | new/old | rel diff |")
    print("|---|---|---|---|---|---|---|")
    for spec in (registry.resolve(s) for s in args.specs):
        if spec.kind != "fwd":
            raise SystemExit(f"{spec.name}: forward specs only")
        old, new = compile_from(args.old, spec), compile_from(args.new, spec)
        for d, s, b, h, causal in bench_cases([spec.head_dim], [int(x) for x in args.seqlens.split(",")], [spec.causal]):
            gen = torch.Generator(device="cuda").manual_seed(s + d)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=DTYPES[spec.dtype], generator=gen) for _ in range(3))
            for granularity, rows in scalings(spec, args.granularity, args.block_rows):
                # Both kernels on the same inputs (fp8: quantized once).
                inputs = fp8.prepare(q, k, v, granularity, rows, hadamard=True) if spec.is_fp8 else (q, k, v)
                variant = variant_kwargs(args.variant, h) if args.variant else {}
                fns = {name: call_of(spec, kern, inputs, variant) for name, kern in (("old", old), ("new", new))}
                out_old, out_new = (fns[name]().float() for name in ("old", "new"))
                diff = float((out_old - out_new).norm() / out_old.norm())
                ms = time_cuda_ms_interleaved(fns, 5, 20, 20.0)
                tf = {name: attn_fwd_flops(b, h, s, s, d, causal) / t / 1e9 for name, t in ms.items()}
                scales = granularity if granularity != "block" else f"block {rows[0]}:{rows[1]}"
                print(f"| {spec.name} | {s} | {scales} | {tf['old']:.1f} | {tf['new']:.1f} | "
                      f"{tf['new'] / tf['old']:.3f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
