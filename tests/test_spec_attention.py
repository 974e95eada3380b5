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
        if kernel.spec.bias_grad:  # as the kernel does: added into the zeroed, broadcasting gradient
            grad = variant.params["attn_bias_grad"]
            full = reference_bias_grad(q, k, v, dout, scale, causal, variant.params["attn_bias"],
                                       mask_mod=mods["mask_mod"], window_size=mods["window_size"])
            shared = [d for d, stride in enumerate(grad.stride()) if stride == 0]
            distinct = grad[tuple(slice(0, 1) if d in shared else slice(None) for d in range(4))]
            distinct.add_((full.sum(dim=shared, keepdim=True) if shared else full).float())  # dim=[]: all
        return tuple(g.to(q.dtype) for g in attention_reference_grads(q, k, v, dout, scale, causal, **mods))

    monkeypatch.setattr(ops, "_forward_impl", forward)
    monkeypatch.setattr(ops, "_backward_impl", backward)
    return calls


def reference_bias_grad(q, k, v, dout, scale, causal, bias, **mods) -> torch.Tensor:
    """d(loss)/d(attn_bias) of the float64 reference, by autograd, in the bias's full shape."""
    with torch.enable_grad():
        bias = bias.detach().double().requires_grad_()
        out, _ = attention_reference(q.detach(), k.detach(), v.detach(), scale, causal, attn_bias=bias, **mods)
        return torch.autograd.grad(out, bias, dout.double())[0]


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


def test_attn_bias_runs_the_bias_kernels(reference_kernels):
    q, k, v = qkv(b=2, s=8, hq=4)
    bias = torch.randn(1, 4, 8, 8).expand(2, -1, -1, -1)
    out = fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), attn_bias=bias)
    # (the routed kernels add it as a score_mod; the reference's attn_bias must agree)
    check_against_reference(q, k, v, out, True, window_size=(3, 0), attn_bias=bias)
    fwd_spec = reference_kernels[0][1]
    assert fwd_spec.bias and fwd_spec.window and fwd_spec.causal and not fwd_spec.block_sparse
    assert reference_kernels[1][1] == fwd_spec.backward_spec()  # no gradient for the bias: no bias_grad
    spec = KernelSpec(head_dim=64, bias=True)
    with pytest.raises(ValueError, match=r"attn_bias must have shape \(batch, nheads_q, seqlen_q, seqlen_k\)"):
        ops._fill_variant(ops.FwdParams(), types.SimpleNamespace(spec=spec),
                          ops.VariantArgs(params={"attn_bias": torch.zeros(2, 4, 8, 9)}), q, k, False)


@pytest.mark.parametrize("bias_shape", [(2, 4, 8, 8), (1, 4, 8, 8), (1, 1, 8, 8), (2, 1, 8, 8), "expanded"], ids=str)
def test_attn_bias_that_requires_grad_gets_its_gradient(reference_kernels, bias_shape):
    """The backward spec with bias_grad adds d(loss)/d(attn_bias) into a zeroed float32 tensor of
    the caller's shape, expanded as the bias (a size-1 batch or head dim adds into one element);
    an expand()ed bias gets the gradient of its full shape, which autograd sums to its base."""
    q, k, v = qkv(b=2, s=8, hq=4)
    base = torch.randn((1, 4, 8, 8) if bias_shape == "expanded" else bias_shape, requires_grad=True)
    bias = base.expand(2, 4, 8, 8) if bias_shape == "expanded" else base
    out = fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), attn_bias=bias)
    dout = torch.randn_like(out)
    (out.float() * dout.float()).sum().backward()
    (_, fwd_spec, _, fwd_variant), (_, bwd_spec, _, bwd_variant) = reference_kernels
    assert bwd_spec == fwd_spec.backward_spec(bias_grad=True)
    assert fwd_variant.params["attn_bias"].shape == (2, 4, 8, 8)  # the kernels read the full shape
    grad = bwd_variant.params["attn_bias_grad"]
    assert grad.dtype == torch.float32 and grad.shape == (2, 4, 8, 8)
    assert [stride == 0 for stride in grad.stride()] == [size == 1 for size in bias.shape]
    with torch.enable_grad():
        base64 = base.detach().double().requires_grad_()
        ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), None, True, window_size=(3, 0),
                                     attn_bias=base64.expand(2, 4, 8, 8))
        ref_grad = torch.autograd.grad(ref, base64, dout.double())[0]
    assert base.grad is not None and base.grad.shape == base.shape
    torch.testing.assert_close(base.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.grad.float(), attention_reference_grads(
        q.detach(), k.detach(), v.detach(), dout, None, True, window_size=(3, 0),
        attn_bias=bias.expand(2, 4, 8, 8))[0].to(q.dtype).float())


def test_staged_bias_padded_rows_still_get_their_gradient(reference_kernels):
    """A bias_staging kernel reads a padded copy of rows that are not 16-byte aligned (9 float32 keys:
    36 bytes); the caller's bias, not the copy, is autograd's input, so it gets d(loss)/d(attn_bias)."""
    q, k, v = qkv(b=2, s=9, hq=4)
    base = torch.randn(1, 4, 9, 9, requires_grad=True)
    spec = KernelSpec(head_dim=64, bias=True, bias_staging=True, causal=True)
    out = fa3gen.flash_attn_func(q, k, v, attn_bias=base, variant_spec=spec)
    dout = torch.randn_like(out)
    (out.float() * dout.float()).sum().backward()
    (_, _, _, fwd_variant), (_, bwd_spec, _, _) = reference_kernels
    assert fwd_variant.params["attn_bias"].stride()[1:] == (9 * 12, 12, 1)  # the padded copy
    assert bwd_spec.bias_grad
    with torch.enable_grad():
        base64 = base.detach().double().requires_grad_()
        ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), None, True, attn_bias=base64.expand(2, 4, 9, 9))
        ref_grad = torch.autograd.grad(ref, base64, dout.double())[0]
    assert base.grad is not None
    torch.testing.assert_close(base.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_bias_gradient_rows_are_padded_for_the_vector_atomics(reference_kernels):
    """The unmasked bias backward adds d(bias) four keys per 16-byte atomic: flash_attn_func's
    gradient tensor has rows padded to 16 bytes (9 keys: a row stride of 12), and a kernel called
    with unaligned rows refuses them; masked kernels (scalar atomics) take any rows."""
    q, k, v = qkv(b=2, s=9, hq=4)
    base = torch.randn(1, 4, 9, 9, requires_grad=True)
    fa3gen.flash_attn_func(q, k, v, attn_bias=base).sum().backward()
    _, (_, bwd_spec, _, bwd_variant) = reference_kernels
    grad = bwd_variant.params["attn_bias_grad"]
    assert bwd_spec.bwd_bias_under_gemms and grad.stride() == (0, 9 * 12, 12, 1)
    assert base.grad.shape == base.shape
    unaligned = torch.zeros(2, 4, 9, 9)
    with pytest.raises(ValueError, match="adds attn_bias_grad four keys per 16-byte atomic"):
        ops._fill_variant(ops.BwdParams(), types.SimpleNamespace(spec=bwd_spec),
                          ops.VariantArgs(params={"attn_bias": unaligned, "attn_bias_grad": unaligned}), q, k, False)
    causal = types.SimpleNamespace(spec=KernelSpec(head_dim=64, causal=True, bias=True).backward_spec(bias_grad=True))
    assert not causal.spec.bwd_bias_under_gemms
    ops._fill_variant(ops.BwdParams(), causal, ops.VariantArgs(params={"attn_bias": unaligned, "attn_bias_grad": unaligned}),
                      q, k, True)


def test_attn_bias_gradient_refusals(reference_kernels):
    q, k, v = qkv(b=2, s=8, hq=4)
    bias = torch.zeros(2, 4, 8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="attn_bias requires grad, but its gradient is not available: .*not deterministic"):
        fa3gen.flash_attn_func(q, k, v, attn_bias=bias, deterministic=True)
    capped = KernelSpec(head_dim=64, softcap=True, bias=True, score_mod={"expr": "score * 2", "grad": "2"})
    with pytest.raises(ValueError, match="both softcap and a score_mod is not available"):
        fa3gen.flash_attn_func(q, k, v, softcap=5.0, attn_bias=bias, variant_spec=capped)
    with torch.no_grad():  # no gradient asked for: the plain backward spec, nothing refused
        fa3gen.flash_attn_func(q, k, v, attn_bias=bias, deterministic=True)
    spec = KernelSpec(head_dim=64, mask_mod={"expr": "table(h, q_idx) > 0"},
                      params=[{"kind": "tensor", "name": "table", "ndim": 2, "dtype": "float32"}])
    with pytest.raises(NotImplementedError, match="table require.* grad, but param tensors other than attn_bias"):
        fa3gen.flash_attn_func(q, k, v, variant_spec=spec, variant_params={"table": torch.ones(4, 8, requires_grad=True)})
    bwd = types.SimpleNamespace(spec=KernelSpec(head_dim=64, bias=True).backward_spec(bias_grad=True))
    ok = torch.zeros(2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"attn_bias_grad must have shape \(batch, nheads_q, seqlen_q, seqlen_k\) = \(2, 4, 8, 8\)"):
        ops._fill_variant(ops.BwdParams(), bwd, ops.VariantArgs(params={"attn_bias": ok, "attn_bias_grad": ok[:, :, :7]}),
                          q, k, False)
    with pytest.raises(ValueError, match="attn_bias must have contiguous keys"):
        ops._fill_variant(ops.BwdParams(), bwd, ops.VariantArgs(params={"attn_bias": ok.transpose(2, 3), "attn_bias_grad": ok}),
                          q, k, False)
    with pytest.raises(ValueError, match="attn_bias_grad's row stride .* too large"):
        huge = torch.empty(8 * 2**26, device="meta").as_strided((2, 4, 8, 8), (0, 0, 2**26, 1))  # no storage
        ops._fill_variant(ops.BwdParams(), bwd, ops.VariantArgs(params={"attn_bias": ok.to("meta"), "attn_bias_grad": huge}),
                          q.to("meta"), k.to("meta"), False)


def test_attn_bias_keys_are_made_contiguous_and_broadcast(reference_kernels):
    """flash_attn_func hands the kernels attn_bias in the full shape with contiguous keys: a
    transposed bias is copied, a (1, h) one expanded (stride 0) without a copy."""
    q, k, v = qkv(b=2, s=8, hq=4)
    shared = torch.randn(1, 4, 8, 8)
    fa3gen.flash_attn_func(q, k, v, attn_bias=shared)
    fa3gen.flash_attn_func(q, k, v, attn_bias=shared.transpose(2, 3))
    given = [variant.params["attn_bias"] for kind, _, _, variant in reference_kernels if kind == "fwd"]
    assert given[0].stride() == (0, 64, 8, 1) and given[0].data_ptr() == shared.data_ptr()
    assert given[1].stride()[1:] == (64, 8, 1) and given[1].stride(0) == 0
    torch.testing.assert_close(given[1][0], shared[0].transpose(1, 2))


def test_hdim_128_default_stages_a_bias_with_aligned_rows(reference_kernels):
    """At hdim 128 the default forward stages attn_bias through shared memory (bias_staging) when
    its rows start on 16-byte boundaries (no copy needed); other rows take the register path."""
    for s, transpose, staged in ((8, False, True), (9, False, False), (8, True, False)):
        q, k, v = qkv(s=s, d=128)
        bias = torch.randn(1, 4, s, s)
        fa3gen.flash_attn_func(q, k, v, attn_bias=bias.transpose(2, 3) if transpose else bias)
        _, spec, _, variant = reference_kernels[-1]
        assert spec.bias_staging == staged, (s, transpose)
        assert variant.params["attn_bias"].stride(2) == s  # never a padded copy here
    q, k, v = qkv(s=8, d=64)
    fa3gen.flash_attn_func(q, k, v, attn_bias=torch.randn(1, 4, 8, 8))
    assert not reference_kernels[-1][1].bias_staging


def test_repeated_calls_compile_each_spec_once(reference_kernels, monkeypatch):
    """After a call signature's first call, its spec, backward spec and kernels come from memos:
    rebuilt every call they cost ~0.5 ms of host time (pydantic, the registry, compile's cache key),
    more than some kernels run. Another signature gets its own spec."""
    compiled: list[KernelSpec] = []

    def compile_(spec):
        compiled.append(spec)
        return types.SimpleNamespace(spec=spec)

    monkeypatch.setattr(fa3gen, "compile", compile_)
    q, k, v = qkv()
    bias = torch.randn(1, 4, 9, 9, requires_grad=True)
    for _ in range(3):
        fa3gen.flash_attn_func(q, k, v, attn_bias=bias).sum().backward()
    assert [s.kind for s in compiled] == ["fwd", "bwd"] and compiled[1].bias_grad
    fa3gen.flash_attn_func(q, k, v, causal=True, attn_bias=bias.detach())
    assert len(compiled) == 3 and compiled[2].causal and compiled[2].bias
    assert len([c for c in reference_kernels if c[0] == "fwd"]) == 4  # every call still ran
