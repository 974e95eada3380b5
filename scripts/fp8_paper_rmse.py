"""The FA3 paper's fp8 accuracy experiment on the GPU, through fp8.prepare's fused kernels and
through its torch ops: inputs N(0,1) + N(0,100)·Bernoulli(0.001), hdim 128, batch 1, RMSE of O
against float64 attention of the unquantized inputs, per-tensor scales (the paper's baseline)
and per-block scales with the Hadamard.

Usage: python scripts/fp8_paper_rmse.py [--shapes 2048x4,8192x2] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fa3gen import fp8, fp8_ops  # noqa: E402
from fa3gen.reference import attention_reference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x4,8192x2", help="seqlen x nheads, comma-separated")
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    print("| shape, seed | scheme | fused prepare | torch-ops prepare |")
    print("|---|---|---|---|")
    for shape in args.shapes.split(","):
        seqlen, nheads = (int(x) for x in shape.split("x"))
        for seed in (int(x) for x in args.seeds.split(",")):
            q, k, v = fp8.outlier_inputs(1, seqlen, nheads, 128, seed=seed, device="cuda")
            ref, _ = attention_reference(q.double(), k.double(), v.double(), None, False)
            for granularity, hadamard in (("tensor", False), ("block", True)):
                rmse = [fp8.rmse(fp8_ops.flash_attn_fp8_func(
                            fp8.prepare(q, k, v, granularity, hadamard=hadamard, fused=fused)), ref)
                        for fused in (True, False)]
                scheme = granularity + (" + Hadamard" if hadamard else "")
                print(f"| s{seqlen} h{nheads}, {seed} | {scheme} | {rmse[0]:.4e} | {rmse[1]:.4e} |", flush=True)


if __name__ == "__main__":
    main()
