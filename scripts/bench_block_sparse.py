"""Block sparsity for a mask_mod (KernelSpec.block_sparse): the block-sparse forward beside the same
mask evaluated on every key block (the dense mask_mod kernel), FlexAttention with its BlockMask, and
cuDNN's causal attention, in one process, interleaved.

Usage (on a Hopper GPU): python scripts/bench_block_sparse.py [--seqlens 4096,16384] [--doc-len 2048]
                                                    [--candidate JSON ...]  # block-sparse spec changes, A/B
                                                    [--backward]  # also the backward passes, a table of their own
bf16, hdim 128, 16 heads, batch = 16384 / seqlen. Masks: packed documents of --doc-len tokens,
causal within each (causal=True in the spec, the documents in the mask_mod); prefix-LM with a
prefix of a quarter of the sequence. ms is the median of the interleaved rounds; "x dense" and
"x flex" divide their time by the block-sparse kernel's. The first call's classification (the
block ranges, cached per problem) is timed apart. Each --candidate (spec fields, e.g.
'{"scheduler": "lpt"}') runs the block-sparse spec with those changes in the same interleaved
rounds, on a row of its own: its ms and the default block-sparse kernel's ms divided by it.
--backward times the backward of each case after the forward table: the block-sparse kernel's
backward_spec() (block-sparse too), the dense one's, Flex's and cuDNN causal's (torch.autograd.grad
of their outputs with the graph kept), from the same saved forward outputs and dout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fa3gen  # noqa: E402
from bench_variants import _flex  # noqa: E402
from fa3gen import block_sparsity  # noqa: E402
from fa3gen.bench import time_cuda_ms_interleaved  # noqa: E402

DOCUMENTS = dict(causal=True, mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx)"},
                 params=[{"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"}])
PREFIX_LM = dict(mask_mod={"expr": "kv_idx <= q_idx || kv_idx < prefix(b)"},
                 params=[{"kind": "tensor", "name": "prefix", "ndim": 1, "dtype": "int32"}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--candidate", action="append", default=[], help="spec fields for the block-sparse kernel (JSON)")
    ap.add_argument("--backward", action="store_true", help="also time the backward passes")
    args = ap.parse_args()
    candidates = [json.loads(c) for c in args.candidate]
    flex, create_block_mask, why = _flex()
    if flex is None:
        print(f"FlexAttention unavailable: {why}")
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__}")
    print("| case | block-sparse ms | dense mask_mod ms | x dense | flex ms | x flex | cuDNN causal ms | first call's ranges ms |")
    print("|---|---|---|---|---|---|---|---|")
    d, h = 128, 16
    backward_rows = []
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 16384 // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        doc = (torch.arange(s, device="cuda") // args.doc_len).int().expand(b, s).contiguous()
        prefix = torch.full((b,), s // 4, device="cuda", dtype=torch.int32)
        cases = [(f"documents of {args.doc_len}", DOCUMENTS, {"doc": doc}, lambda bb, hh, i, j: (doc[bb, i] == doc[bb, j]) & (j <= i)),
                 (f"prefix-LM, prefix {s // 4}", PREFIX_LM, {"prefix": prefix}, lambda bb, hh, i, j: (j <= i) | (j < prefix[bb]))]
        for name, fields, params, mask in cases:
            sparse = fa3gen.compile(fa3gen.KernelSpec(head_dim=d, block_sparse=True, **fields))
            tried = [fa3gen.compile(fa3gen.KernelSpec(head_dim=d, block_sparse=True, **{**fields, **c})) for c in candidates]
            dense = fa3gen.compile(fa3gen.KernelSpec(head_dim=d, **fields))
            block_sparsity.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sparse(q, k, v, **params)  # classifies (and runs) once
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - t0) * 1e3
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

            fns = {"sparse": lambda: sparse(q, k, v, **params), "dense": lambda: dense(q, k, v, **params), "cudnn": cudnn}
            for i, kernel in enumerate(tried):
                fns[f"candidate {i}"] = lambda kernel=kernel: kernel(q, k, v, **params)
            if flex is not None:
                block_mask = create_block_mask(mask, b, h, s, s, device="cuda")
                fns["flex"] = lambda: flex(qt, kt, vt, block_mask=block_mask)
                ref = fns["flex"]().transpose(1, 2).float()
                diff = float((fns["sparse"]().float() - ref).norm() / ref.norm())
                print(f"  {name} s{s}: rel diff vs FlexAttention {diff:.2e}")
            ms = time_cuda_ms_interleaved(fns, 5, 20, 20.0)
            if failed := {n: t for n, t in ms.items() if isinstance(t, Exception)}:
                print(f"  {name} s{s}: failed: {failed}")
                continue
            flex_ms = ms.get("flex")
            flex_cols = f"{flex_ms:.3f} | {flex_ms / ms['sparse']:.2f}" if isinstance(flex_ms, float) else "- | -"
            print(f"| {name}, s{s} b{b} | {ms['sparse']:.3f} | {ms['dense']:.3f} | {ms['dense'] / ms['sparse']:.2f} | "
                  f"{flex_cols} | {ms['cudnn']:.3f} | {first_ms:.2f} |", flush=True)
            for i, (kernel, changes) in enumerate(zip(tried, candidates)):
                t = ms[f"candidate {i}"]
                print(f"|   {json.dumps(changes)} ({kernel.spec.name}) | {t:.3f} | x default {ms['sparse'] / t:.3f} |", flush=True)
            if args.backward:
                flex_backward = None
                if flex is not None:
                    flex_backward = lambda qg, kg, vg, block_mask=block_mask: flex(qg, kg, vg, block_mask=block_mask)  # noqa: E731
                backward_rows.append(f"| {name}, s{s} b{b} | " + backward_times(sparse, dense, q, k, v, params, flex_backward))
    if backward_rows:
        print("\n| backward | block-sparse ms | dense mask_mod ms | x dense | flex ms | x flex | cuDNN causal ms |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(backward_rows), flush=True)


def backward_times(sparse, dense, q, k, v, params, flex_fn) -> str:
    """The backward of one case: the kernels' backward_spec() kernels beside Flex's and cuDNN
    causal's autograd backward, interleaved, on the same dout; the table row's cells."""
    sparse_bwd, dense_bwd = (fa3gen.compile(kernel.spec.backward_spec()) for kernel in (sparse, dense))
    out, lse = sparse(q, k, v, return_lse=True, **params)
    dout = torch.randn_like(out)
    fns = {"sparse": lambda: sparse_bwd.backward(dout, q, k, v, out, lse, **params),
           "dense": lambda: dense_bwd.backward(dout, q, k, v, out, lse, **params)}
    leaves = tuple(x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dout_t = dout.transpose(1, 2)
    if flex_fn is not None:
        flex_out = flex_fn(*leaves)
        fns["flex"] = lambda: torch.autograd.grad(flex_out, leaves, dout_t, retain_graph=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    fns["cudnn"] = lambda: torch.autograd.grad(cudnn_out, leaves, dout_t, retain_graph=True)
    ms = time_cuda_ms_interleaved(fns, 3, 20, 20.0)
    if failed := {n: t for n, t in ms.items() if isinstance(t, Exception)}:
        return f"failed: {failed} |"
    flex_ms = ms.get("flex")
    flex_cols = f"{flex_ms:.3f} | {flex_ms / ms['sparse']:.2f}" if isinstance(flex_ms, float) else "- | -"
    return (f"{ms['sparse']:.3f} | {ms['dense']:.3f} | {ms['dense'] / ms['sparse']:.2f} | {flex_cols} | "
            f"{ms['cudnn']:.3f} |")


if __name__ == "__main__":
    main()
