"""Custom mask_mods from the spec: packed documents that attend only within themselves and within
a causal window (document ids as an int32 tensor), and prefix-LM (a bidirectional prefix of
per-sequence length, causal after it; also built in: examples/documents_and_prefix_lm.py). A
mask_mod is a C++ boolean expression over b, h, q_idx, kv_idx, seqlen_q, seqlen_k and declared
params. With block_sparse=True a classifier kernel finds, once per problem, the key blocks it
hides entirely (never loaded) and those it shows entirely (not masked per element).
The first one runs through flash_attn_func (variant_spec=, variant_params=) and autograd.

Run on a Hopper GPU: python examples/custom_mask_mod.py
Elsewhere it renders the kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import random_qkv, report, report_grads, runs_here

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads

DOCUMENTS_IN_A_WINDOW = fa3gen.KernelSpec(
    head_dim=64,
    mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx && q_idx - kv_idx < window"},
    params=[{"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"},
            {"kind": "scalar", "name": "window", "dtype": "int32"}],
    block_sparse=True,
)
PREFIX_LM = fa3gen.KernelSpec(
    head_dim=128,
    mask_mod={"expr": "kv_idx <= q_idx || kv_idx < prefix(b)"},
    params=[{"kind": "tensor", "name": "prefix", "ndim": 1, "dtype": "int32"}],
    block_sparse=True,
)


def main() -> None:
    if not runs_here(DOCUMENTS_IN_A_WINDOW, DOCUMENTS_IN_A_WINDOW.backward_spec(), PREFIX_LM):
        return
    b, s, h = 2, 4096, 8
    q, k, v = (t.requires_grad_() for t in random_qkv(b, s, h, 64))
    doc = (torch.arange(s, device="cuda") // 1500).int().expand(b, s).contiguous()  # documents of 1500 tokens
    ids = doc.long()

    def in_document_window(bb, hh, i, j):
        return (ids[bb, i] == ids[bb, j]) & (j <= i) & (i - j < 1024)

    out = fa3gen.flash_attn_func(q, k, v, variant_spec=DOCUMENTS_IN_A_WINDOW,
                                 variant_params={"doc": doc, "window": 1024})
    detached = (q.detach(), k.detach(), v.detach())
    report("documents within a window", out, attention_reference(*detached, mask_mod=in_document_window)[0])
    dout = torch.randn_like(out)
    out.backward(dout)
    report_grads("documents within a window", (q.grad, k.grad, v.grad),
                 attention_reference_grads(*detached, dout, mask_mod=in_document_window))

    q, k, v = random_qkv(b, s, h, 128)
    prefix = torch.tensor([512, 1500], device="cuda", dtype=torch.int32)  # per sequence
    lengths = prefix.long()
    out = fa3gen.compile(PREFIX_LM)(q, k, v, prefix=prefix)
    ref = attention_reference(q, k, v, mask_mod=lambda bb, hh, i, j: (j <= i) | (j < lengths[bb]))[0]
    report("prefix-LM", out, ref)


if __name__ == "__main__":
    main()
