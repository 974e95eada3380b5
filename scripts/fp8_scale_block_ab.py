"""fp8 hdim 128: kernels on scale blocks of one of their tiles against coarser blocks, one process.

Where a scale block spans several kernel tiles the kernel divides the key-block index by the
tiles per block (TileDescale::block); this times what that costs. The default e4m3 kernels, plus
any spec given as JSON (not causal), each on `prepare`'s blocks of one own tile and of --rows
rows (Q blocks of --q-rows, by default as many), N(0,1) bf16 inputs, FA3 setup (16k tokens, 16
heads), interleaved CUDA-event timing.

Usage: python scripts/fp8_scale_block_ab.py [--rows 384] [--q-rows 128] [--seqlens 4096,16384] [SPEC_JSON ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402
from fa3gen import KernelSpec, fp8, fp8_ops, registry  # noqa: E402
from fa3gen.bench import attn_fwd_flops, time_cuda_ms_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=384, help="rows per coarse scale block of K/V (and Q)")
    parser.add_argument("--q-rows", type=int, help="rows per coarse scale block of Q (default: --rows)")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("specs", nargs="*", help="extra e4m3 hdim 128 specs (JSON, not causal)")
    args = parser.parse_args()
    extra = {f"spec{i}": fa3gen.compile(KernelSpec.model_validate_json(s)) for i, s in enumerate(args.specs)}
    for causal in (False, True):
        kernels = {"default": fa3gen.compile(registry.default_fp8_spec(128, 128, "bf16", causal))}
        kernels |= {} if causal else extra
        for s in (int(x) for x in args.seqlens.split(",")):
            b, h = 16384 // s, 16
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            fns = {}
            for name, kernel in kernels.items():
                coarse = (args.q_rows or args.rows, args.rows)
                for label, rows in (("one tile", (kernel.spec.block_m, kernel.spec.block_n)),
                                    (f"{coarse[0]}/{coarse[1]} rows", coarse)):
                    inputs = fp8.prepare(q, k, v, "block", block_size=rows)
                    fns[f"{name}, {label}"] = (lambda inputs=inputs, kernel=kernel:
                                               fp8_ops.flash_attn_fp8_func(inputs, causal=causal, kernel=kernel))
            ms = time_cuda_ms_interleaved(fns, 3, 20, 20.0)
            flops = attn_fwd_flops(b, h, s, s, 128, causal)
            print(f"s{s} causal={causal}: " + " | ".join(
                f"{n} {flops / m / 1e9:.1f}" if isinstance(m, float) else f"{n} {m!r}" for n, m in ms.items()), flush=True)


if __name__ == "__main__":
    main()
