"""Separates host cost from kernel time: each call timed eagerly and as a replayed CUDA graph.

For each (head_dim, causal) case at one seqlen (the bench's setup: 16k tokens, hidden 2048, bf16),
fa3gen.flash_attn_func and torch SDPA's cuDNN backend run eagerly and as a CUDA graph of 10 calls,
all four interleaved with the bench's timer in one process. The graph replays carry no host cost
per call, so graph-vs-graph compares the kernels and eager-vs-graph shows what the launch path adds.

Usage (on the GPU machine): python scripts/graph_vs_eager.py [--seqlen 512] [--cases 128c,256c,128,64c]
"""

from __future__ import annotations

import argparse
import math

import torch

from fa3gen.bench import (CALLS_PER_GRAPH, _fwd_fns, attn_fwd_flops, bench_cases, cuda_graph_of,
                          time_cuda_ms_interleaved)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--cases", default="128c,256c,128,64c", help="head dims, 'c' for causal")
    args = ap.parse_args()
    s = args.seqlen
    for case in args.cases.split(","):
        d, causal = int(case.rstrip("c")), case.endswith("c")
        ((_, _, b, h, _),) = bench_cases([d], [s], [causal])
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        peers, _ = _fwd_fns(q, k, v, 1 / math.sqrt(d), causal)  # the bench's fa3gen and cuDNN calls
        fns = {f"{name} eager": peers[name] for name in ("fa3gen", "cudnn")}
        fns.update({f"{name} graph": cuda_graph_of(peers[name], CALLS_PER_GRAPH) for name in ("fa3gen", "cudnn")})
        ms = time_cuda_ms_interleaved(fns, 5, 20, 2.0)
        flops = attn_fwd_flops(b, h, s, s, d, causal)
        tflops = {n: flops * (CALLS_PER_GRAPH if "graph" in n else 1) / t / 1e9 for n, t in ms.items()}
        print(f"d{d} s{s} causal={causal}: " + ", ".join(f"{n} {v:.1f}" for n, v in tflops.items())
              + f" TFLOP/s; graph ratio {tflops['fa3gen graph'] / tflops['cudnn graph']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
