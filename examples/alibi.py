"""ALiBi: each head's scores get -slope * |i + sk - sq - j| added, the slopes a float32 tensor of
(nheads,) or (batch, nheads) given per call (no gradient flows into them). And an additive bias
from a tensor (attn_bias, fp32 (batch or 1, nheads or 1, seqlen_q, seqlen_k)): here a
relative position bias per head and distance, shared by the batch, then learned: its table requires
grad, and the gradient flows through attn_bias into it (FlexAttention's learnable bias buffer).

Run on a Hopper GPU: python examples/alibi.py
Elsewhere it renders the ALiBi kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import check_builtin_variant, random_qkv, rel_err, runs_here

import fa3gen
from fa3gen.reference import attention_reference


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
    bias = per_distance[:, distance].unsqueeze(0)  # (1, h, s, s): shared by the batch
    check_builtin_variant("relative position bias (attn_bias), causal", q, k, v, True, attn_bias=bias)
    learn_relative_position_bias()


def learn_relative_position_bias(b: int = 2, s: int = 1024, h: int = 8) -> None:
    """The table's gradient through attn_bias (the backward adds d(loss)/d(bias) into a (1, h, s, s)
    float32 gradient, then autograd gathers it back to the table) against float64 autograd."""
    q, k, v = random_qkv(b, s, h, 128)
    table = (torch.randn(h, 2 * s - 1, device="cuda") * 0.5).requires_grad_()
    distance = torch.arange(s, device="cuda")[:, None] - torch.arange(s, device="cuda")[None, :] + s - 1
    out = fa3gen.flash_attn_func(q, k, v, causal=True, attn_bias=table[:, distance].unsqueeze(0))
    dout = torch.randn_like(out)
    out.backward(dout)
    table64 = table.detach().double().requires_grad_()
    ref, _ = attention_reference(q, k, v, None, True, attn_bias=table64[:, distance].unsqueeze(0))
    ref.backward(dout.double())
    print(f"learned relative position bias: table gradient relative error vs float64 {rel_err(table.grad, table64.grad):.2e}")


if __name__ == "__main__":
    main()
