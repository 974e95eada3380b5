"""flash_attn_func's spec path (fa3gen.spec_attention) on the CPU: the built-ins that take a tensor
(document_ids, prefix_lengths, attn_bias) and a caller's variant_spec pick their kernels' specs,
their values reach the launches, and autograd wires the forward and backward kernels (routed here
to the float64 reference with the same variant, so the gradients are checked as values)."""

from __future__ import annotations

import types

import pytest
import torch

import fa3gen
from fa3gen import KernelSpec, ops
from fa3gen.reference import attention_reference, attention_reference_grads


def qkv(b=2, s=9, hq=4, hkv=2, d=64, dtype=torch.bfloat16):
    q = torch.randn(b, s, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, s, hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, s, hkv, d, dtype=dtype, requires_grad=True)
    return q, k, v


def mask_of(spec: KernelSpec, params: dict):
    """The kernel's mask (built-in masks, and the test's custom mask_mod) as a torch function."""
    def mask(b, h, i, j):
        shown = torch.ones((), dtype=torch.bool)
        sq = sk = params["_seqlen"]
        if spec.documents:
            ids = params["document_ids"].long()
            shown = shown & (ids[b, i] == ids[b, j])
        if spec.prefix_lm:
            shown = shown & ((j <= i + sk - sq) | (j < params["prefix_lengths"].long()[b]))
        if spec.mask_mod is not None:  # the test's custom spec: keys within `span` of the query
            shown = shown & ((i - j).abs() <= params["span"])
        return shown
    return mask


@pytest.fixture
def reference_kernels(monkeypatch):
    """fa3gen.compile records the specs; the forward and backward implementations run the float64
    reference of the kernel's mask and record the values they got."""
    calls = []
    monkeypatch.setattr(fa3gen, "compile", lambda spec: types.SimpleNamespace(spec=spec))

    def reference_variant(spec: KernelSpec, variant, seqlen: int) -> dict:
        mods = {"mask_mod": mask_of(spec, {**variant.params, "_seqlen": seqlen}), "window_size": variant.window_size}
        if spec.bias:
            bias = variant.params["attn_bias"]
            mods["score_mod"] = lambda score, b, h, i, j: score + bias[b, h, i, j].double()
        return mods

    def forward(q, k, v, scale, causal, kernel, variant, meta_checked=False):
        calls.append(("fwd", kernel.spec, causal, variant))
        out, lse = attention_reference(q, k, v, scale, causal, **reference_variant(kernel.spec, variant, q.shape[1]))
        return out.to(q.dtype), lse.float()

    def backward(dout, q, k, v, out, lse, scale, causal, deterministic, kernel, variant):
        calls.append(("bwd", kernel.spec, causal, variant))
        mods = reference_variant(kernel.spec, variant, q.shape[1])
        return tuple(g.to(q.dtype) for g in attention_reference_grads(q, k, v, dout, scale, causal, **mods))

    monkeypatch.setattr(ops, "_forward_impl", forward)
    monkeypatch.setattr(ops, "_backward_impl", backward)
    return calls


def check_against_reference(q, k, v, out, causal, mask=None, **mods):
    dout = torch.randn_like(out)
    (out.float() * dout.float()).sum().backward()
    ref_out, _ = attention_reference(q.detach(), k.detach(), v.detach(), None, causal, mask_mod=mask, **mods)
    ref = attention_reference_grads(q.detach(), k.detach(), v.detach(), dout, None, causal, mask_mod=mask, **mods)
    torch.testing.assert_close(out.float(), ref_out.to(q.dtype).float())
    for g, r in zip((q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(g.float(), r.to(q.dtype).float())


def test_document_ids_run_the_documents_kernels_forward_and_backward(reference_kernels):
    q, k, v = qkv()
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    out = fa3gen.flash_attn_func(q, k, v, causal=True, document_ids=doc)
    ids = doc.long()
    check_against_reference(q, k, v, out, True, lambda b, h, i, j: ids[b, i] == ids[b, j])
    (_, fwd_spec, causal, variant), (_, bwd_spec, _, bwd_variant) = reference_kernels
    assert fwd_spec.documents and fwd_spec.causal and causal and fwd_spec.block_sparse  # skipping on by default
    assert bwd_spec == fwd_spec.backward_spec() and bwd_spec.block_sparse
    assert variant.params == {"document_ids": doc} and bwd_variant is variant


def test_prefix_lengths_run_prefix_lm_causal_or_not(reference_kernels):
    """prefix_lengths means causal after the prefix: causal=True and False pick the same kernel."""
    q, k, v = qkv(b=2, s=8)
    prefix = torch.tensor([3, 0], dtype=torch.int32)
    out = fa3gen.flash_attn_func(q, k, v, causal=True, prefix_lengths=prefix)
    lengths = prefix.long()
    check_against_reference(q, k, v, out, False, lambda b, h, i, j: (j <= i) | (j < lengths[b]))
    fa3gen.flash_attn_func(q, k, v, prefix_lengths=prefix)
    specs = [spec for kind, spec, _, _ in reference_kernels if kind == "fwd"]
    assert specs[0] == specs[1] and specs[0].prefix_lm and not specs[0].causal


def test_variant_spec_with_its_params(reference_kernels):
    spec = KernelSpec(head_dim=64, mask_mod={"expr": "abs(q_idx - kv_idx) <= span"},
                      params=[{"kind": "scalar", "name": "span", "dtype": "int32"}])
    q, k, v = qkv()
    out = fa3gen.flash_attn_func(q, k, v, variant_spec=spec, variant_params={"span": 2})
    check_against_reference(q, k, v, out, False, lambda b, h, i, j: (i - j).abs() <= 2)
    assert [s for _, s, _, _ in reference_kernels] == [spec, spec.backward_spec()]
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"missing \['span'\]"):
        fa3gen.flash_attn_func(q, k, v, variant_spec=spec)
    with pytest.raises(ValueError, match="causal=True, but variant_spec .* is not causal"):
        fa3gen.flash_attn_func(q, k, v, causal=True, variant_spec=spec, variant_params={"span": 2})
    with pytest.raises(ValueError, match="takes bf16 with head_dim 64"):
        fa3gen.flash_attn_func(q.half(), k.half(), v.half(), variant_spec=spec, variant_params={"span": 2})
    with pytest.raises(TypeError, match="16-bit forward KernelSpec"):
        fa3gen.flash_attn_func(q, k, v, variant_spec=spec.backward_spec(), variant_params={"span": 2})
    with pytest.raises(ValueError, match="does not take window_size"):
        fa3gen.flash_attn_func(q, k, v, window_size=(4, 0), variant_spec=spec, variant_params={"span": 2})


def test_built_in_mask_values_are_checked(reference_kernels):
    q, k, v = qkv(b=2, s=9)
    doc = torch.zeros(2, 9, dtype=torch.int32)
    with pytest.raises(ValueError, match="document_ids is given twice"):
        fa3gen.flash_attn_func(q, k, v, document_ids=doc, variant_params={"document_ids": doc})
    documents = types.SimpleNamespace(spec=KernelSpec(head_dim=64, documents=True))
    with pytest.raises(ValueError, match="must be a 2-d torch.int32 tensor"):
        ops._fill_variant(ops.FwdParams(), documents, ops.VariantArgs(params={"document_ids": doc.long()}), q, k, False)
    with pytest.raises(ValueError, match=r"document_ids must have shape \(batch, seqlen\) = \(2, 9\)"):
        ops._fill_variant(ops.FwdParams(), documents, ops.VariantArgs(params={"document_ids": doc[:, :5]}), q, k, False)
    with pytest.raises(ValueError, match="seqlen_q must equal seqlen_k"):
        ops._fill_variant(ops.FwdParams(), documents, ops.VariantArgs(params={"document_ids": doc}), q, k[:, :5], False)
    with pytest.raises(ValueError, match=r"prefix_lengths must have shape \(batch,\) = \(2,\)"):
        ops._fill_variant(ops.FwdParams(), types.SimpleNamespace(spec=KernelSpec(head_dim=64, prefix_lm=True)),
                          ops.VariantArgs(params={"prefix_lengths": torch.zeros(3, dtype=torch.int32)}), q, k, False)


def test_attn_bias_runs_the_bias_kernels_and_refuses_a_bias_that_wants_a_gradient(reference_kernels):
    q, k, v = qkv(b=2, s=8, hq=4)
    bias = torch.randn(1, 4, 8, 8).expand(2, -1, -1, -1)
    out = fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), attn_bias=bias)
    # (the routed kernels add it as a score_mod; the reference's attn_bias must agree)
    check_against_reference(q, k, v, out, True, window_size=(3, 0), attn_bias=bias)
    fwd_spec = reference_kernels[0][1]
    assert fwd_spec.bias and fwd_spec.window and fwd_spec.causal and not fwd_spec.block_sparse
    assert reference_kernels[1][1] == fwd_spec.backward_spec()
    with pytest.raises(NotImplementedError, match="attn_bias require.* grad, but param tensors get no gradient"):
        fa3gen.flash_attn_func(q, k, v, attn_bias=torch.zeros(2, 4, 8, 8, requires_grad=True))
    with torch.no_grad():  # no gradient asked for: fine
        fa3gen.flash_attn_func(q, k, v, attn_bias=torch.zeros(2, 4, 8, 8, requires_grad=True))
    spec = KernelSpec(head_dim=64, bias=True)
    with pytest.raises(ValueError, match=r"attn_bias must have shape \(batch, nheads_q, seqlen_q, seqlen_k\)"):
        ops._fill_variant(ops.FwdParams(), types.SimpleNamespace(spec=spec),
                          ops.VariantArgs(params={"attn_bias": torch.zeros(2, 4, 8, 9)}), q, k, False)
