"""FP8 forward beside the bf16 forward, cuDNN and the fp8 GEMM ceiling, in one process.

FA3 setup: 16k tokens (batch = 16384 / seqlen), hidden 2048 (nheads = 2048 / head_dim). For
each case: fa3gen's e4m3 kernel on prepared inputs (per-block scales, Hadamard applied
beforehand, as a model would keep them; also per-(batch, head) scales), fa3gen's bf16 kernel and torch SDPA's cuDNN backend
on the bf16 inputs; plus a torch._scaled_mm e4m3 8192³ GEMM and a bf16 8192³ matmul, and the
cost of the input preparation (v_kernel_layout alone, and all of fa3gen.fp8.prepare). The
attention implementations of a case are timed interleaved (fa3gen.bench.time_cuda_ms_interleaved).

Usage: python scripts/bench_fp8.py [--hdim 64,128,256] [--seqlens 4096,16384] [--json out.json]
                                  [--v-alternating]  # V's block scales alternate between two powers of two
                                  [--tiles]   # also time the alternative tiles in TILE_CANDIDATES
                                  [--spec JSON ...]  # and these e4m3 specs, each on its head dim
                                  [--candidate-blocks tile|prepare]  # the candidates' scale blocks
The default runs on `prepare`'s default blocks (every registry kernel's tiles divide them; at
hdim 64 and 128 that picks the 192 x 128 kernels of registry.FP8_SEQLEN_TILES by query length),
candidates on inputs with one scale per tile of their own tiles, or with
--candidate-blocks prepare on the default's inputs where their tiles divide its blocks (the
overlap loops run slower on K/V blocks of one key block: the two effects apart); each prints its
output's difference from the bf16 kernel's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import fa3gen  # noqa: E402
from fa3gen import fp8, fp8_ops  # noqa: E402
from fa3gen.bench import (attn_fwd_flops, bench_cases, error_line, matmul_bf16_tflops,  # noqa: E402
                          time_cuda_ms, time_cuda_ms_interleaved)
from fa3gen.ops import flash_attn_func  # noqa: E402


# Tiles and schedules to compare with the defaults (FP8_TILES, pingpong), same process and inputs
# (each on inputs with one scale per tile of its own tiles): --tiles.
TILE_CANDIDATES = {
    64: [dict(block_n=128), dict(block_m=192, block_n=128)],
    128: [dict(block_n=128), dict(block_n=256), dict(pingpong=False)],
    256: [dict(block_n=96), dict(pingpong=False)],
}
CAUSAL_CANDIDATES = [dict(pingpong=False)]


def candidate_specs(d: int, causal: bool, tiles: bool, extra: tuple[dict, ...] = ()) -> list[fa3gen.KernelSpec]:
    """The specs timed beside the default on one case: TILE_CANDIDATES / CAUSAL_CANDIDATES (with
    --tiles) and the --spec field sets of this head dim and mask."""
    field_sets = list(CAUSAL_CANDIDATES if causal else TILE_CANDIDATES.get(d, [])) if tiles else []
    field_sets += [{k: v for k, v in f.items() if k not in ("head_dim", "causal", "dtype")} for f in extra
                   if f.get("head_dim") == d and bool(f.get("causal", False)) == causal]
    out = []
    for fields in field_sets:
        try:
            out.append(fa3gen.KernelSpec(head_dim=d, dtype="e4m3", causal=causal, **fields))
        except ValueError as e:  # a tile that does not fit is reported, not timed
            print(f"skip d{d} {fields}: {str(e).splitlines()[0]}")
    return out


TIMING = (5, 20, 20.0)  # warm-up calls, repetitions (the median counts), ms per repetition at least


def timed(fn) -> float:
    return time_cuda_ms(fn, *TIMING)


def gemm_ceilings() -> dict[str, float]:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major B, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    ms_fp8 = timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return {"scaled_mm_fp8": 2 * n**3 / ms_fp8 / 1e9, "matmul_bf16": matmul_bf16_tflops("cuda", *TIMING)}


def run_case(d: int, s: int, b: int, h: int, causal: bool, tiles: bool, extra: tuple[dict, ...] = (),
             v_alternating: bool = False, candidate_blocks: str = "tile") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    if v_alternating:  # V's magnitude 1x / 2x in alternate key blocks: their power-of-two scales alternate
        rows = fp8.default_block_rows(d)[1]
        v = v * (1 + (torch.arange(s, device="cuda") // rows % 2))[None, :, None, None].to(v.dtype)
    scale = 1 / math.sqrt(d)
    inputs = fp8.prepare(q, k, v, "block", hadamard=True)  # prepare's default blocks
    flops = attn_fwd_flops(b, h, s, s, d, causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    out8 = fp8_ops.flash_attn_fp8_func(inputs, scale, causal)
    ref = flash_attn_func(q, k, v, scale, causal)
    rel = float((out8.float() - ref.float()).norm() / ref.float().norm())
    v8 = fp8.quantize_e4m3(v, "block").data  # fp8 V as (b, s, h, d): what v_kernel_layout converts
    # The attention implementations run interleaved (rotated rounds), so none gets the GPU's
    # early clocks; the conversions are timed on their own.
    fns = {
        "fp8": lambda: fp8_ops.flash_attn_fp8_func(inputs, scale, causal),
        "bf16": lambda: flash_attn_func(q, k, v, scale, causal),
        "cudnn_bf16": cudnn,
        # From bf16 q, k, v: fp8.prepare (fused kernels on Hopper) and the fp8 kernel, per call.
        "fp8_end_to_end": lambda: fp8_ops.fp8_attention(q, k, v, scale, causal),
    }
    per_head = fp8.prepare(q, k, v, "head", hadamard=True)  # K's factor folds into the softmax scale
    fns["fp8 per-(batch, head) scales"] = lambda: fp8_ops.flash_attn_fp8_func(per_head, scale, causal)
    # Each candidate runs on inputs scaled per tile of its own tiles (and with V as the model holds
    # it for a kernel that transposes V itself), or on prepare's blocks (the default's inputs)
    # where its tiles divide them.
    prepare_rows = fp8.default_block_rows(d)
    per_tile = {(prepare_rows, True): inputs}
    for spec in candidate_specs(d, causal, tiles, extra):
        try:
            kernel = fa3gen.compile(spec)
        except Exception as e:  # noqa: BLE001 - not prebuilt: reported, the rest still runs
            print(f"{spec.name}: {error_line(e)}")
            continue
        fits_prepare = prepare_rows[1] % spec.block_n == 0  # (its Q rows, 128, any kernel takes)
        rows = prepare_rows if candidate_blocks == "prepare" and fits_prepare else (spec.block_m, spec.block_n)
        if candidate_blocks == "prepare" and not fits_prepare:
            print(f"  {spec.name}: its key blocks do not divide prepare's {prepare_rows[1]} rows: on its own tile's blocks")
        key = (rows, not spec.v_transpose_in_kernel)
        if key not in per_tile:
            per_tile[key] = fp8.prepare(q, k, v, "block", key[0], hadamard=True, kernel_v_layout=key[1])
        fn = fns[f"fp8 {spec.name}"] = lambda kernel=kernel, x=per_tile[key]: fp8_ops.flash_attn_fp8_func(
            x, scale, causal, kernel=kernel)
        diff = float((fn().float() - ref.float()).norm() / ref.float().norm())
        print(f"  {spec.name}: rel diff vs the bf16 kernel {diff:.2e} (default: {rel:.2e})")
    ms = {}
    for name, t in time_cuda_ms_interleaved(fns, *TIMING).items():
        if isinstance(t, Exception):
            print(f"{name}: {error_line(t)}")
        else:
            ms[name] = t
    ms["v_kernel_layout"] = timed(lambda: fp8.v_kernel_layout(v8))
    ms["prepare"] = timed(lambda: fp8.prepare(q, k, v, "block", hadamard=True))  # fused kernels on Hopper
    ms["prepare_torch"] = timed(lambda: fp8.prepare(q, k, v, "block", hadamard=True, fused=False))
    tf = {name: flops / t / 1e9 for name, t in ms.items() if name.startswith(("fp8", "bf16", "cudnn_bf16"))}
    for name, value in tf.items():
        if name.startswith("fp8 "):
            print(f"  {name[4:]}: {value:.1f} TFLOP/s (the default kernel: {tf['fp8']:.1f})")
    return {"head_dim": d, "seqlen": s, "batch": b, "nheads": h, "causal": causal, "ms": ms, "tflops": tf,
            "fp8_vs_bf16_rel_diff": rel}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hdim", default="64,128,256")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--tiles", action="store_true", help="also time the tiles in TILE_CANDIDATES")
    ap.add_argument("--v-alternating", action="store_true",
                    help="V's magnitude doubles in every other key block (its scales alternate between two powers of two)")
    ap.add_argument("--candidate-blocks", choices=("tile", "prepare"), default="tile",
                    help="the candidates' scale blocks: one tile of their own tiles, or prepare's default blocks")
    ap.add_argument("--spec", action="append", default=[],
                    help="also time this e4m3 spec (JSON fields) on the cases of its head_dim and causal")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__}")
    ceil = gemm_ceilings()
    print(f"torch._scaled_mm e4m3 8192^3: {ceil['scaled_mm_fp8']:.1f} TFLOP/s · bf16 matmul: {ceil['matmul_bf16']:.1f}")
    print("| case | fa3gen fp8 | fa3gen bf16 | cuDNN bf16 | fp8/bf16 | fp8/scaled_mm | fp8 from bf16 inputs (prepare + attention) | "
          "its ratio to cuDNN bf16 | V layout ms | prepare ms (fused) | prepare ms (torch ops) | fp8 vs bf16 rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    hdims, seqlens = ([int(x) for x in a.split(",")] for a in (args.hdim, args.seqlens))
    for d, s, b, h, causal in bench_cases(hdims, seqlens, (False, True)):
        r = run_case(d, s, b, h, causal, args.tiles, tuple(json.loads(x) for x in args.spec), args.v_alternating,
                     args.candidate_blocks)
        rows.append(r)
        tf, ms = r["tflops"], r["ms"]
        print(f"| d{d} s{s} b{b} h{h}{' causal' if causal else ''} | {tf['fp8']:.1f} | "
              f"{tf['bf16']:.1f} | {tf['cudnn_bf16']:.1f} | {tf['fp8'] / tf['bf16']:.2f}x | "
              f"{tf['fp8'] / ceil['scaled_mm_fp8']:.2f} | {tf['fp8_end_to_end']:.1f} | "
              f"{tf['fp8_end_to_end'] / tf['cudnn_bf16']:.2f}x | {ms['v_kernel_layout']:.3f} | {ms['prepare']:.3f} | {ms['prepare_torch']:.3f} | "
              f"{r['fp8_vs_bf16_rel_diff']:.1e} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
