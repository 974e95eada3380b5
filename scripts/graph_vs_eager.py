"""Separates host cost from kernel time: each call timed eagerly and as a replayed CUDA graph.

For each (head_dim, causal) case at one seqlen (the bench's setup: 16k tokens, hidden 2048, bf16),
fa3gen.flash_attn_func and torch SDPA's cuDNN backend run eagerly and as a CUDA graph of 10 calls,
all four interleaved with the bench's timer in one process. The graph replays carry no host cost
per call, so graph-vs-graph compares the kernels and eager-vs-graph shows what the launch path adds.

Usage (on the GPU machine): python scripts/graph_vs_eager.py [--seqlen 512] [--cases 128c,256c,128,64c]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen
from fa3gen.bench import attn_fwd_flops, time_cuda_ms_interleaved

CALLS_PER_GRAPH = 10


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--cases", default="128c,256c,128,64c", help="head dims, 'c' for causal")
    args = ap.parse_args()
    s = args.seqlen
    for case in args.cases.split(","):
        d, causal = int(case.rstrip("c")), case.endswith("c")
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def fa3() -> torch.Tensor:
            return fa3gen.flash_attn_func(q, k, v, causal=causal)

        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        graphs = {"fa3gen": graph_of(fa3), "cudnn": graph_of(cudnn)}
        fns = {"fa3gen eager": fa3, "cudnn eager": cudnn,
               "fa3gen graph": graphs["fa3gen"].replay, "cudnn graph": graphs["cudnn"].replay}
        ms = time_cuda_ms_interleaved(fns, 5, 20, 2.0)
        flops = attn_fwd_flops(b, h, s, s, d, causal)
        tflops = {n: flops * (CALLS_PER_GRAPH if "graph" in n else 1) / t / 1e9 for n, t in ms.items()}
        print(f"d{d} s{s} causal={causal}: " + ", ".join(f"{n} {v:.1f}" for n, v in tflops.items())
              + f" TFLOP/s; graph ratio {tflops['fa3gen graph'] / tflops['cudnn graph']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
