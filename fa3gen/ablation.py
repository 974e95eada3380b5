"""`fa3gen bench --ablation`: the FA3 paper's forward ablation, on this GPU, through spec switches.

One shape (hdim 128, batch 4, seqlen 8448, 16 heads, bf16, not causal). Each variant is the
default spec with one switch changed, compiled like any other spec, launched into the same
inputs, checked against the default's output and timed with the bench's interleaved CUDA-event
timer beside cuDNN SDPA in this process.
"""

from __future__ import annotations

import math
from typing import Any

from .spec import KernelSpec

CUDNN = "cuDNN SDPA (reference)"
SHAPE = {"batch": 4, "seqlen": 8448, "nheads": 16, "head_dim": 128}


def variants(dtype: str = "bf16") -> dict[str, KernelSpec | None]:
    """Name -> spec; None marks a variant the spec cannot express."""
    def spec(**switches: Any) -> KernelSpec:  # the default spec with some switches changed, validated
        return KernelSpec(head_dim=SHAPE["head_dim"], dtype=dtype, **switches)

    return {
        "default (intra-warpgroup and inter-tile overlap, pingpong, persistent static, TMA-store epilogue, "
        "lazy rescale, two reduction chains per row, programmatic launch)": spec(),
        "row sums on the tensor cores (P·1 WGMMAs; the e4m3 default, slower in 16-bit)": spec(row_sums_mma=True),
        "no lazy rescale (O rescaled every key block)": spec(lazy_rescale=False),
        "one reduction chain per row (softmax max and sum)": spec(row_reduce_chains=1),
        "no programmatic dependent launch": spec(programmatic_launch=False),
        "no pingpong": spec(pingpong=False),
        "no inter-tile overlap": spec(inter_tile_overlap=False),
        "no inter-tile overlap, no pingpong": spec(inter_tile_overlap=False, pingpong=False),
        "no intra-warpgroup overlap (so no inter-tile overlap; pingpong off)": spec(intra_wg_overlap=False),
        "no intra-warpgroup overlap, + pingpong": spec(intra_wg_overlap=False, pingpong=True),
        "one CTA per tile (no persistence, so no inter-tile overlap)": spec(scheduler="grid"),
        "dynamic lpt scheduler instead of static": spec(scheduler="lpt"),
        "O stored from registers (no TMA-store epilogue)": spec(epilogue="direct"),
        "one Q buffer (so no inter-tile overlap)": spec(q_buffers=1),
        # Every fa3gen kernel has a TMA producer warpgroup: there is no spec without it.
        "no warp specialization": None,
    }


def run(args: Any, time_ms) -> int:
    """Runs the ablation; `time_ms({name: fn})` is the bench's interleaved timer (milliseconds per
    name). Returns a process exit code."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from . import build_many, compile
    from .bench import attn_fwd_flops, error_line
    from .ops import _launch_params

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    b, s, h, d = SHAPE["batch"], SHAPE["seqlen"], SHAPE["nheads"], SHAPE["head_dim"]
    flops = attn_fwd_flops(b, h, s, s, d, False)
    specs = variants(args.dtype)
    build_many([sp for sp in specs.values() if sp], jobs=args.jobs,
               progress=lambda line: print(f"  {line}", flush=True))

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    stream = torch.cuda.current_stream().cuda_stream
    reference = None
    failed = False
    rows: dict[str, str] = {}
    fns, alive = {}, []  # name -> launch; launch params and outputs kept alive while timed
    for name, spec in specs.items():
        if spec is None:
            rows[name] = f"| {name} | n/a | spec cannot express it |"
            continue
        kernel = compile(spec)
        out = torch.full((b, s, h, d), float("nan"), device="cuda", dtype=dtype)
        lse = torch.empty((b, h, s), device="cuda", dtype=torch.float32)
        params, workspace = _launch_params(kernel.workspace_bytes, q, k, v, out, lse, scale)
        kernel.fwd(params, stream)
        torch.cuda.synchronize()
        if reference is None:
            reference = out.clone()
        diff = float((out.float() - reference.float()).abs().max())
        ok = bool(torch.isfinite(out).all()) and diff < 1e-2
        failed |= not ok
        alive.append((params, workspace, out, lse))
        fns[name] = lambda kernel=kernel, params=params: kernel.fwd(params, stream)
        rows[name] = f"`{spec.name}`, max diff vs default {diff:.1e}{'' if ok else ' FAILED'}"
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, scale=scale)

    fns[CUDNN] = cudnn
    rows[CUDNN] = "same inputs, same process"
    for name, ms in time_ms(fns).items():
        failed |= isinstance(ms, Exception)
        tflops = error_line(ms) if isinstance(ms, Exception) else f"{flops / ms / 1e9:.1f}"
        rows[name] = f"| {name} | {tflops} | {rows[name]} |"
    print(f"\nablation: hdim {d}, batch {b}, seqlen {s}, {h} heads, {args.dtype}, not causal; "
          f"TFLOP/s, median of {args.reps}\n")
    print("\n".join(["| variant | TFLOP/s | spec |", "|---|---|---|", *rows.values()]), flush=True)
    return 1 if failed else 0
