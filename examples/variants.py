"""Attention variants with fa3gen: built-ins (sliding window, soft-capping, ALiBi) and two custom
ones from spec expressions, each checked against the float64 reference, and their gradients:
built-ins through autograd, a custom one through its backward kernel.

Run on a Hopper GPU: python examples/variants.py
Elsewhere it renders and validates the custom specs and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads

DOCUMENTS_IN_A_WINDOW = fa3gen.KernelSpec(
    head_dim=64,
    mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx && q_idx - kv_idx < window"},
    params=[{"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"},
            {"kind": "scalar", "name": "window", "dtype": "int32"}],
)
SCALED_RELATIVE_BIAS = fa3gen.KernelSpec(
    head_dim=128,
    score_mod={"expr": "score + gain * bias(h, q_idx - kv_idx + seqlen_k - 1)", "grad": "1.f"},
    params=[{"kind": "scalar", "name": "gain"}, {"kind": "tensor", "name": "bias", "ndim": 2}],
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def main() -> None:
    for spec in (DOCUMENTS_IN_A_WINDOW, SCALED_RELATIVE_BIAS):
        print(f"{spec.name}: {len(fa3gen.render(spec))} characters of CUDA")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("running the variants needs a Hopper GPU (H100/H200); the specs above are valid and render")
        return
    b, s, h = 2, 4096, 8
    q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(1024, 0))
    print("sliding window:", rel_err(out, attention_reference(q, k, v, None, True, window_size=(1024, 0))[0]))
    out = fa3gen.flash_attn_func(q, k, v, softcap=30.0)
    print("softcap:", rel_err(out, attention_reference(q, k, v, None, False, softcap=30.0)[0]))
    slopes = torch.rand(h, device="cuda")
    out = fa3gen.flash_attn_func(q, k, v, alibi_slopes=slopes)
    print("alibi:", rel_err(out, attention_reference(q, k, v, None, False, alibi_slopes=slopes)[0]))

    bias = torch.randn(h, 2 * s - 1, device="cuda")
    out = fa3gen.compile(SCALED_RELATIVE_BIAS)(q, k, v, gain=0.5, bias=bias)
    ref = attention_reference(q, k, v, None, False,
                              score_mod=lambda sc, bb, hh, i, j: sc + 0.5 * bias.double()[hh, i - j + s - 1])[0]
    print("custom score_mod (relative bias):", rel_err(out, ref))

    q64, k64, v64 = (t[..., :64].contiguous() for t in (q, k, v))
    doc = (torch.arange(s, device="cuda") // 1500).int().expand(b, s).contiguous()  # documents of 1500 tokens
    out = fa3gen.compile(DOCUMENTS_IN_A_WINDOW)(q64, k64, v64, doc=doc, window=1024)
    ids = doc.long()
    ref = attention_reference(q64, k64, v64, None, False,
                              mask_mod=lambda bb, hh, i, j: (ids[bb, i] == ids[bb, j]) & (j <= i) & (i - j < 1024))[0]
    print("custom mask_mod (documents within a window):", rel_err(out, ref))

    # Gradients. Built-ins: autograd through flash_attn_func runs the variant's backward kernel.
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    variant = dict(window_size=(1024, 0), softcap=30.0)
    out = fa3gen.flash_attn_func(qg, kg, vg, causal=True, **variant)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = attention_reference_grads(q, k, v, dout, None, True, **variant)
    print("sliding window + softcap backward (dq, dk, dv):",
          *(f"{rel_err(g, r):.2e}" for g, r in zip((qg.grad, kg.grad, vg.grad), ref)))
    # A custom spec's backward is the backward spec of the same problem (spec.backward_spec()).
    fwd = fa3gen.compile(DOCUMENTS_IN_A_WINDOW)
    bwd = fa3gen.compile(DOCUMENTS_IN_A_WINDOW.backward_spec())
    out, lse = fwd(q64, k64, v64, return_lse=True, doc=doc, window=1024)
    dout = torch.randn_like(out)
    grads = bwd.backward(dout, q64, k64, v64, out, lse, doc=doc, window=1024)
    ref = attention_reference_grads(q64, k64, v64, dout, None, False,
                                    mask_mod=lambda bb, hh, i, j: (ids[bb, i] == ids[bb, j]) & (j <= i) & (i - j < 1024))
    print("custom mask_mod backward (dq, dk, dv):", *(f"{rel_err(g, r):.2e}" for g, r in zip(grads, ref)))


if __name__ == "__main__":
    main()
