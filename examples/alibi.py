"""ALiBi: each head's scores get -slope * |i + sk - sq - j| added, the slopes a float32 tensor of
(nheads,) or (batch, nheads) given per call (no gradient flows into them).

Run on a Hopper GPU: python examples/alibi.py
Elsewhere it renders the ALiBi kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import autograd_grads, random_qkv, report, report_grads, runs_here

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads


def main() -> None:
    if not runs_here(fa3gen.KernelSpec(head_dim=128, alibi=True), fa3gen.KernelSpec(head_dim=128, causal=True, alibi=True)):
        return
    b, s, h = 2, 4096, 8
    q, k, v = random_qkv(b, s, h, 128)
    # The geometric slopes of the ALiBi paper (2^(-8 i / h)), and per-(batch, head) slopes.
    per_head = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    per_batch_head = torch.rand(b, h, device="cuda")
    for causal, slopes in ((True, per_head), (False, per_batch_head)):
        what = f"alibi slopes {tuple(slopes.shape)}{' causal' if causal else ''}"
        out = fa3gen.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
        report(what, out, attention_reference(q, k, v, None, causal, alibi_slopes=slopes)[0])
        dout = torch.randn_like(out)
        grads = autograd_grads(lambda x, y, z: fa3gen.flash_attn_func(x, y, z, causal=causal, alibi_slopes=slopes),
                               q, k, v, dout)
        report_grads(what, grads, attention_reference_grads(q, k, v, dout, None, causal, alibi_slopes=slopes))


if __name__ == "__main__":
    main()
