"""Built-in masks that take a tensor, through flash_attn_func and autograd: packed documents (a
query sees the keys of its own document: document_ids, here with causal) and prefix-LM (every
query sees its sequence's first prefix_lengths[b] keys, and causally after them). Both kernels are
block-sparse: key blocks of other documents, and past both the prefix and the diagonal, are never
loaded (a classifier kernel finds them once per problem; the ranges are cached).

Run on a Hopper GPU: python examples/documents_and_prefix_lm.py
Elsewhere it renders the kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import random_qkv, report, report_grads, runs_here

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads

DOCUMENTS = fa3gen.default_spec(128, 128, "bf16", True, documents=True)
PREFIX_LM = fa3gen.default_spec(128, 128, "bf16", False, prefix_lm=True)


def check(what: str, mask, **mask_args) -> None:
    """Forward and gradients through flash_attn_func against float64 with the same mask."""
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 4096, 8, 128))
    out = fa3gen.flash_attn_func(q, k, v, **mask_args)
    detached = (q.detach(), k.detach(), v.detach())
    report(what, out, attention_reference(*detached, mask_mod=mask)[0])
    dout = torch.randn_like(out)
    out.backward(dout)
    report_grads(what, (q.grad, k.grad, v.grad), attention_reference_grads(*detached, dout, mask_mod=mask))


def main() -> None:
    if not runs_here(DOCUMENTS, DOCUMENTS.backward_spec(), PREFIX_LM, PREFIX_LM.backward_spec()):
        return
    doc = (torch.arange(4096, device="cuda") // 1500).int().expand(2, -1)  # documents of 1500 tokens, both rows
    ids = doc.long()
    check("packed documents, causal", lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (j <= i),
          causal=True, document_ids=doc)
    prefix = torch.tensor([512, 1500], device="cuda", dtype=torch.int32)  # per sequence
    lengths = prefix.long()
    check("prefix-LM", lambda b, h, i, j: (j <= i) | (j < lengths[b]), prefix_lengths=prefix)


if __name__ == "__main__":
    main()
