"""ALiBi: each head's scores get -slope * |i + sk - sq - j| added, the slopes a float32 tensor of
(nheads,) or (batch, nheads) given per call (no gradient flows into them). And an additive bias
from a tensor (attn_bias, fp32 (batch, nheads, seqlen_q, seqlen_k), any strides): here a relative
position bias per head and distance, expanded over the batch (stride 0).

Run on a Hopper GPU: python examples/alibi.py
Elsewhere it renders the ALiBi kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import check_builtin_variant, random_qkv, runs_here

import fa3gen


def main() -> None:
    if not runs_here(fa3gen.KernelSpec(head_dim=128, alibi=True), fa3gen.KernelSpec(head_dim=128, causal=True, alibi=True),
                     fa3gen.KernelSpec(head_dim=128, causal=True, bias=True)):
        return
    b, s, h = 2, 4096, 8
    q, k, v = random_qkv(b, s, h, 128)
    # The geometric slopes of the ALiBi paper (2^(-8 i / h)), one per head.
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    out = fa3gen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    print("causal ALiBi:", tuple(out.shape))
    check_builtin_variant("alibi, slopes per head, causal", q, k, v, True, alibi_slopes=slopes)
    check_builtin_variant("alibi, slopes per (batch, head)", q, k, v, False, alibi_slopes=torch.rand(b, h, device="cuda"))
    per_distance = torch.randn(h, 2 * s - 1, device="cuda") * 0.5  # a learned-looking bias per head and distance
    distance = torch.arange(s, device="cuda")[:, None] - torch.arange(s, device="cuda")[None, :] + s - 1
    bias = per_distance[:, distance].unsqueeze(0).expand(b, -1, -1, -1)
    check_builtin_variant("relative position bias (attn_bias), causal", q, k, v, True, attn_bias=bias)


if __name__ == "__main__":
    main()
