"""Variants in the spec (window, softcap, alibi, score_mod, mask_mod): validation, rendering, call
arguments, and the float64 reference that the GPU tests compare against."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fa3gen import KernelSpec, render
from fa3gen.reference import attention_reference
from fa3gen.variant_args import VariantArgs

DOC_WINDOW = dict(
    mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx && q_idx - kv_idx < window"},
    params=[{"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"},
            {"kind": "scalar", "name": "window", "dtype": "int32"}],
)
REL_BIAS = dict(
    score_mod={"expr": "score + bias(h, bucket(q_idx - kv_idx + seqlen_k - 1))", "grad": "1.f"},
    params=[{"kind": "tensor", "name": "bias", "ndim": 2}, {"kind": "tensor", "name": "bucket", "ndim": 1, "dtype": "int32"}],
)


@pytest.mark.parametrize("fields, message", [
    ({"mask_mod": {"expr": "q_idx >= kv_idx; return 1"}}, "contains ';'"),
    ({"mask_mod": {"expr": "q_idx >= kv_idx // hidden"}}, "contains '//'"),
    ({"mask_mod": {"expr": "(q_idx >= kv_idx"}}, "unbalanced parentheses"),
    ({"mask_mod": {"expr": "q_idx >= kv_idx - wnd"}}, "unknown name\\(s\\) wnd"),
    ({"mask_mod": {"expr": "score > 0"}}, "unknown name\\(s\\) score"),
    ({"score_mod": {"expr": "score * gain"}, "params": [{"kind": "scalar", "name": "q_idx"}]}, "reserved"),
    ({"score_mod": {"expr": "score * gain"}, "params": [{"kind": "scalar", "name": "gain"},
                                                        {"kind": "scalar", "name": "gain"}]}, "unique"),
    ({"score_mod": {"expr": "score * g0"}, "params": [{"kind": "scalar", "name": f"g{i}"} for i in range(9)]},
     "at most 8 float32 scalars"),
    ({"params": [{"kind": "scalar", "name": "gain"}]}, "neither score_mod nor mask_mod"),
    ({"score_mod": {"expr": "score * t(h)"}, "params": [{"kind": "tensor", "name": "t", "ndim": 5}]}, "less than or equal to 4"),
    ({"score_mod": {"expr": ""}}, "score_mod is empty"),
])
def test_bad_variant_specs_fail_with_a_clear_error(fields, message):
    with pytest.raises(ValidationError, match=message):
        KernelSpec(head_dim=128, **fields)


def test_variant_specs_name_serialize_and_round_trip():
    spec = KernelSpec(head_dim=128, causal=True, window=True, softcap=True, alibi=True, **REL_BIAS)
    assert "_win_cap_alibi_smod" in spec.name
    assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert spec.has_score_mod and not KernelSpec(head_dim=128, window=True).has_score_mod
    slots = [(p.name, array, slot) for p, array, slot in KernelSpec(head_dim=64, **DOC_WINDOW).param_slots]
    assert slots == [("doc", "tensor_args", 0), ("window", "int_args", 0)]  # each array counts its own slots


def test_builtin_variants_render_their_code_and_only_then():
    plain = render(KernelSpec(head_dim=128))
    for marker in ("first_visible_key", "tanh_approx(", "alibi_slopes[", "score_mod(p,", "mask_mod(p,"):
        assert marker not in plain
    assert "return p.scale_log2; }" in plain  # the scale stays folded into exp2
    window = render(KernelSpec(head_dim=128, window=True))
    assert "range.begin = max(first_visible_key(p, m_block * kBlockM), 0) / kBlockN;" in window
    assert "crosses_left_edge" in window and "p.variant.window_right" in window
    softcap = render(KernelSpec(head_dim=128, softcap=True))
    assert "fa3gen::tanh_approx(score * p.variant.softcap_inv)" in softcap and "{ return float(M_LOG2E); }" in softcap
    assert "variant.alibi_slopes[t.batch * p.variant.alibi_batch_stride + t.head]" in render(KernelSpec(head_dim=128, alibi=True))


def test_custom_mods_render_the_users_expressions():
    src = render(KernelSpec(head_dim=128, **REL_BIAS))
    assert "return float(score + bias(h, bucket(q_idx - kv_idx + seqlen_k - 1)));" in src
    assert "fa3gen::TensorArg<int, 1> const bucket{static_cast<int const*>(p.variant.tensor_args[1]), p.variant.tensor_strides[1]};" in src
    src = render(KernelSpec(head_dim=64, **DOC_WINDOW))
    assert "return bool(doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx && q_idx - kv_idx < window);" in src
    assert "int const window = p.variant.int_args[0];" in src
    assert "return true;  // the spec's mask_mod" in src  # every block is masked element-wise


def test_variant_args_must_match_the_spec():
    spec = KernelSpec(head_dim=64, window=True, **DOC_WINDOW)
    doc = torch.zeros(1, 8, dtype=torch.int32)
    VariantArgs((16, 0), params={"doc": doc, "window": 4}).check(spec)
    with pytest.raises(ValueError, match="needs window_size"):
        VariantArgs(params={"doc": doc, "window": 4}).check(spec)
    with pytest.raises(ValueError, match="does not take softcap"):
        VariantArgs((16, 0), softcap=30.0, params={"doc": doc, "window": 4}).check(spec)
    with pytest.raises(ValueError, match=r"missing \['window'\], unknown \['wnd'\]"):
        VariantArgs((16, 0), params={"doc": doc, "wnd": 4}).check(spec)
    with pytest.raises(ValueError, match="window_size must be two ints"):
        VariantArgs((16, -2)).check()
    with pytest.raises(ValueError, match="softcap must be a number >= 0"):
        VariantArgs(softcap=-1.0).check()
    q = torch.zeros(1, 8, 2, 64)
    with pytest.raises(ValueError, match="param window is a int32 scalar"):
        VariantArgs((16, 0), params={"doc": doc, "window": 4.5}).check_tensors(spec, q, q)
    with pytest.raises(ValueError, match="param doc must be a 2-d torch.int32 tensor"):
        VariantArgs((16, 0), params={"doc": doc.float(), "window": 4}).check_tensors(spec, q, q)
    alibi = KernelSpec(head_dim=64, alibi=True)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\) or \(1, 2\)"):
        VariantArgs(alibi_slopes=torch.zeros(3)).check_tensors(alibi, q, q)


def test_reference_variants_agree_with_their_definitions():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 32, generator=gen, dtype=torch.float64) for n in (40, 50, 50))
    causal, _ = attention_reference(q, k, v, None, True)
    as_window, _ = attention_reference(q, k, v, None, False, window_size=(-1, 0))
    as_mask, _ = attention_reference(q, k, v, None, False, mask_mod=lambda b, h, i, j: j <= i + 10)
    assert torch.equal(causal, as_window) and torch.equal(causal, as_mask)
    capped, _ = attention_reference(q, k, v, None, False, softcap=5.0)
    as_mod, _ = attention_reference(q, k, v, None, False, score_mod=lambda s, b, h, i, j: 5 * torch.tanh(s / 5))
    assert torch.equal(capped, as_mod)
    slopes = torch.rand(4, dtype=torch.float64)
    alibi, _ = attention_reference(q, k, v, None, False, alibi_slopes=slopes)
    as_bias, _ = attention_reference(
        q, k, v, None, False, score_mod=lambda s, b, h, i, j: s - slopes.view(1, -1, 1, 1) * (i + 10 - j).abs())
    assert torch.allclose(alibi, as_bias)
    # A window of (2, 1) keeps exactly 4 keys for rows whose band lies inside the keys.
    _, lse = attention_reference(q, torch.zeros_like(k), v, 1.0, False, window_size=(2, 1))
    assert torch.allclose(lse[:, :, 5:35], torch.full_like(lse[:, :, 5:35], float(torch.log(torch.tensor(4.0)))))


def test_per_element_variants_get_two_consumer_warpgroups_at_hdim_64():
    """hdim 64 defaults to three consumer warpgroups (160 registers each); ALiBi and custom mods
    spilled there, so those variants default to two (232 each). Soft-capping alone fits in three."""
    assert KernelSpec(head_dim=64).num_consumer_warpgroups == 3
    assert KernelSpec(head_dim=64, softcap=True).num_consumer_warpgroups == 3
    for fields in ({"alibi": True}, DOC_WINDOW):
        spec = KernelSpec(head_dim=64, **fields)
        assert (spec.block_m, spec.num_consumer_warpgroups) == (128, 2)
    assert KernelSpec(head_dim=64, alibi=True, block_m=192).num_consumer_warpgroups == 3  # explicit wins


def test_block_sparse_mask_mod_specs_render_the_classifier_and_the_ranges():
    """block_sparse (opt-in, absent from the canonical JSON when off): the forward library gains the
    classifier kernel and its C entry point; every tile's key range (producer and consumers alike)
    comes from the ranges in the last tensor param slot, and the mask_mod runs only on the blocks
    outside the full run (or ragged, or on a causal edge). Refused without a mask_mod and with all
    tensor slots taken. (The backward's: the next test.)"""
    dense = KernelSpec(head_dim=64, **DOC_WINDOW)
    sparse = KernelSpec(head_dim=64, block_sparse=True, **DOC_WINDOW)
    assert not dense.block_sparse and "block_sparse" not in dense.canonical_json()
    # its tiles differ in length (their ranges): the lpt scheduler, where the dense kernel's are equal
    assert sparse.name == dense.name.replace("_static_", "_lpt_") + "_bsp" and '"block_sparse":true' in sparse.canonical_json()
    assert (dense.scheduler, KernelSpec(head_dim=64, block_sparse=True, scheduler="static", **DOC_WINDOW).scheduler) == \
        ("static", "static")
    code, plain = render(sparse), render(dense)
    assert "__global__ void __launch_bounds__(kRangeThreads) block_ranges_kernel(" in code
    assert 'extern "C" int fa3gen_fwd_block_ranges(const Fa3genFwdParams* a, int32_t* ranges, void* stream)' in code
    assert f"constexpr int kSlot = {sparse.block_ranges_slot};" in code
    assert f"a->variant.tensor_args[{sparse.block_ranges_slot}] == nullptr" in code
    # the producer's and the consumers' range lookups all take the tile's coordinates; only the
    # sparse lookup itself starts from the static range of t.m_block
    assert code.count("key_block_range(p, t)") >= 2 and "key_block_range(p, t_next)" in code
    assert code.count("key_block_range(p, t.m_block)") == 1 and "key_block_range(p, t_next.m_block)" not in code
    assert "bool const partial = n_block < blocks.full_begin || n_block >= blocks.full_end;" in code
    assert "return true;  // the spec's mask_mod can hide any element" in plain and "block_ranges" not in plain
    with pytest.raises(ValidationError, match="block_sparse classifies key blocks by the spec's mask_mod"):
        KernelSpec(head_dim=64, causal=True, block_sparse=True)
    tensors = [{"kind": "tensor", "name": f"t{i}", "ndim": 1, "dtype": "int32"} for i in range(8)]
    with pytest.raises(ValidationError, match="at most 7 tensor params"):
        KernelSpec(head_dim=64, mask_mod={"expr": "t0(q_idx) == t7(kv_idx)"}, params=tensors, block_sparse=True)
    # the classifier runs per batch row only (DOC_WINDOW uses b, not h): one CTA column per batch row
    assert sparse.block_ranges_per == (True, False)
    assert "dim3 const grid(static_cast<unsigned>(cute::ceil_div(a->seqlen_q, int(kBlockM))), 1," in code
    assert KernelSpec(head_dim=64, mask_mod={"expr": "kv_idx <= q_idx + h"}, block_sparse=True).block_ranges_per == (False, True)


def test_block_sparse_backward_renders_query_block_ranges():
    """A block_sparse forward's backward_spec() keeps it: the backward library gains its classifier
    (per key block and kv head, over query blocks) and every tile's query block range (producer,
    consumers, dQ writer) comes from the ranges, with the mask_mod per entry only outside the full
    run. Not with deterministic (its dQ order counts every key block of a query block's band)."""
    sparse = KernelSpec(head_dim=64, block_sparse=True, **DOC_WINDOW).backward_spec()
    dense = KernelSpec(head_dim=64, **DOC_WINDOW).backward_spec()
    assert sparse.block_sparse and sparse.name == dense.name + "_bsp" and "block_sparse" not in dense.canonical_json()
    code, plain = render(sparse), render(dense)
    assert 'extern "C" int fa3gen_bwd_block_ranges(const Fa3genBwdParams* a, int32_t* ranges, void* stream)' in code
    assert "dim3 const grid(static_cast<unsigned>(cute::ceil_div(a->seqlen_k, int(kBlockN))), 1," in code
    assert f"a->variant.tensor_args[{sparse.block_ranges_slot}] == nullptr" in code
    assert code.count("= query_block_range(p, t);") == 2 and "query_block_range(p, TileCoordinates{n_block, head_kv, batch})" in code
    assert code.count("query_block_range(p, t.n_block)") == 1  # the sparse lookup's static bounds
    assert "|| m_block < blocks.full_begin || m_block >= blocks.full_end;" in code
    assert "block_ranges" not in plain and "query_block_range(p, t.n_block)" in plain
    # a mask_mod using h: one classifier CTA per kv head, over its group's query heads
    per_head = KernelSpec(head_dim=64, mask_mod={"expr": "kv_idx <= q_idx + h"}, block_sparse=True).backward_spec()
    assert "static_cast<unsigned>(a->nheads_kv)" in render(per_head)
    assert not KernelSpec(head_dim=64, block_sparse=True, **DOC_WINDOW).backward_spec(deterministic=True).block_sparse
    with pytest.raises(ValidationError, match="deterministic adds a query block's dQ"):
        KernelSpec(kind="bwd", head_dim=64, deterministic=True, block_sparse=True, **DOC_WINDOW)
    with pytest.raises(ValidationError, match="block_sparse classifies key blocks by the spec's mask_mod"):
        KernelSpec(kind="bwd", head_dim=64, causal=True, block_sparse=True)


def test_built_in_masks_compile_in_as_mask_expressions_over_their_tensors():
    """documents and prefix_lm: a mask expression over their tensor param each (after the declared
    params' slots), joined with a custom mask_mod; block_sparse on by default (their blocks depend
    on the tensors), kept by the backward; left out of the canonical JSON when off."""
    docs = KernelSpec(head_dim=64, causal=True, documents=True)
    assert docs.block_sparse and "_causal_doc_" in docs.name and docs.name.endswith("_bsp")
    assert docs.backward_spec().documents and docs.backward_spec().block_sparse
    assert "documents" not in KernelSpec(head_dim=64).canonical_json()
    assert docs.mask_expr == "document_ids(b, q_idx) == document_ids(b, kv_idx)"
    code = render(docs)
    assert "return bool(document_ids(b, q_idx) == document_ids(b, kv_idx));" in code
    assert "fa3gen::TensorArg<int, 2> const document_ids{" in code and "block_ranges_kernel" in code
    assert docs.block_ranges_per == (True, False)
    both = KernelSpec(head_dim=64, documents=True, prefix_lm=True, mask_mod={"expr": "kv_idx % 2 == 0"},
                      params=[{"kind": "tensor", "name": "bias", "ndim": 1}, {"kind": "scalar", "name": "x"}])
    assert both.mask_expr == ("(document_ids(b, q_idx) == document_ids(b, kv_idx)) && (kv_idx <= q_idx + seqlen_k - "
                              "seqlen_q || kv_idx < prefix_lengths(b)) && (kv_idx % 2 == 0)")
    slots = {param.name: (array, slot) for param, array, slot in both.param_slots}
    assert slots == {"bias": ("tensor_args", 0), "x": ("float_args", 0), "document_ids": ("tensor_args", 1),
                     "prefix_lengths": ("tensor_args", 2)}
    assert not KernelSpec(head_dim=64, prefix_lm=True, block_sparse=False).block_sparse  # opt out
    with pytest.raises(ValidationError, match="prefix_lm is causal after its prefix by itself"):
        KernelSpec(head_dim=64, causal=True, prefix_lm=True)
    with pytest.raises(ValidationError, match="documents=True passes its values as the tensor 'document_ids'"):
        KernelSpec(head_dim=64, documents=True, mask_mod={"expr": "document_ids(q_idx) > 0"},
                   params=[{"kind": "tensor", "name": "document_ids", "ndim": 1, "dtype": "int32"}])
    with pytest.raises(ValidationError, match="not documents"):
        KernelSpec(head_dim=128, dtype="e4m3", documents=True)
    tensors = [{"kind": "tensor", "name": f"t{i}", "ndim": 1, "dtype": "int32"} for i in range(7)]
    with pytest.raises(ValidationError, match="at most 7 tensor params"):
        KernelSpec(head_dim=64, documents=True, mask_mod={"expr": "t0(q_idx) == t6(kv_idx)"}, params=tensors)


def test_built_in_bias_adds_a_tensor_to_the_score_forward_and_backward():
    """bias=True: score += attn_bias(b, h, q_idx, kv_idx) after softcap and ALiBi, before a
    score_mod, inside the problem only; its derivative is 1 (the backward multiplies nothing in),
    and soft-capping's derivative is then kept per entry rather than recovered from P."""
    spec = KernelSpec(head_dim=128, causal=True, softcap=True, bias=True)
    assert "_cap_bias" in spec.name and "bias" not in KernelSpec(head_dim=128).canonical_json()
    assert [p.name for p in spec.variant_params] == ["attn_bias"] and spec.has_score_mod
    code = render(spec)
    # One 64-bit base a tile (keys contiguous), entries at int offsets from it.
    assert "auto const bias = bias_tile<float const>(p, 0, t.batch, t.head, t.m_block * kBlockM, n_block * kBlockN);" in code
    assert "score modifications: softcap, bias" in code
    # A block's entries are loaded once its GEMMs are issued, before their wait (both loops), in
    # pairs of adjacent keys where a tile is inside the problem, and added after soft-capping.
    assert code.count("auto const bias_values = load_bias(p, s_coord, t, n_block);  // loads under the GEMMs") == 2
    loop = code[code.index("for (int n_block = blocks.end - 2; n_block >= blocks.begin; --n_block)"):]
    assert loop.index("load_bias(") < loop.index("warpgroup_wait<1>()") < loop.index("apply_score_mods(")
    assert "float2 const pair = *reinterpret_cast<float2 const*>(&bias(" in code
    assert code.index("fa3gen::tanh_approx(") < code.index("score += bias_values(r, c);")
    # With a bias, the tile order follows the dim it broadcasts over (its strides, at run time), so
    # the tiles that share its rows run side by side and read them from DRAM once: the static
    # schedule runs a (head, query block)'s batch together for a bias the batch shares and its heads
    # for one the heads share; the lpt schedule groups the batches of a head; the backward runs the
    # batches of a kv head together. Kernels without a bias keep each (batch, head) together.
    static_bias = KernelSpec(head_dim=128, bias=True)
    code = render(static_bias)
    assert static_bias.scheduler == "static" and "if (bias_stride[0] == 0) {" in code
    assert "batch = tile % p.batch;" in code and "head = tile % p.nheads_q;" in code
    assert "bias_stride" not in render(KernelSpec(head_dim=128))
    causal_bias = KernelSpec(head_dim=128, bias=True, causal=True)
    assert causal_bias.scheduler == "lpt" and "int const head = head_batch / p.batch;" in render(causal_bias)
    assert "head_batch / p.batch" not in render(KernelSpec(head_dim=128, causal=True))
    assert "return {n_block, unit / p.batch, unit % p.batch};" in render(static_bias.backward_spec())
    assert "unit_coordinates" not in render(KernelSpec(head_dim=128).backward_spec())
    bwd = spec.backward_spec()
    assert bwd.bias and not bwd.bwd_recomputes_softcap_grad
    assert KernelSpec(kind="bwd", head_dim=128, causal=True, softcap=True).bwd_recomputes_softcap_grad
    assert "{ score += bias(get<1>(coord(0, c)), get<0>(coord(r, c))); }" in render(bwd)
    with pytest.raises(ValidationError, match="not bias"):
        KernelSpec(head_dim=128, dtype="e4m3", bias=True)
    with pytest.raises(ValidationError, match="bias=True passes its values as the tensor 'attn_bias'"):
        KernelSpec(head_dim=64, bias=True, score_mod={"expr": "score + attn_bias(h)"},
                   params=[{"kind": "tensor", "name": "attn_bias", "ndim": 1}])


def test_bias_grad_adds_the_bias_gradient_in_the_backward():
    """bias_grad=True (backward with bias): d(loss)/d(attn_bias) of each entry, the final score's
    derivative times a score_mod's (the bias comes after soft-capping), goes into the tensor param
    attn_bias_grad by atomics; left out of the name and JSON at its default."""
    fwd = KernelSpec(head_dim=128, causal=True, window=True, bias=True)
    bwd = fwd.backward_spec(bias_grad=True)
    assert bwd.name.replace("_dbias", "") == fwd.backward_spec().name and "_dbias" in bwd.name
    assert "bias_grad" not in fwd.backward_spec().canonical_json() and '"bias_grad":true' in bwd.canonical_json()
    assert [p.name for p in bwd.variant_params] == ["attn_bias", "attn_bias_grad"] and bwd.tensor_slot("attn_bias_grad") == 1
    code = render(bwd)
    assert "auto const bias_grad = bias_tile<float>(p, 1, batch, head, m_block * kBlockM, n_block * kBlockN);" in code
    assert "float const dbias = ds_rows(r, c);" in code
    assert "bias_tile<float>(" not in render(fwd.backward_spec())
    # Without masks or score modifiers (bwd_bias_under_gemms), the step's bias is loaded right after
    # its Sᵀ and dPᵀ GEMMs are issued, and d(bias) is added four keys per vector atomic ...
    unmasked_spec = KernelSpec(head_dim=128, bias=True).backward_spec(bias_grad=True)
    unmasked = render(unmasked_spec)
    assert unmasked_spec.bwd_bias_under_gemms and not bwd.bwd_bias_under_gemms
    issue = unmasked.index("fa3gen::wgmma_gemm</*kZeroInit=*/true>(mma_dp")
    assert unmasked.index("auto const bias_values = load_step_bias(", issue) < unmasked.index("warpgroup_wait<1>();", issue)
    assert "add_bias_grad(bias_grad, ds_rows, s_coord, bias_rows, bias_keys);" in unmasked
    assert "atomicAdd(reinterpret_cast<float4*>(&bias_grad(row, key0)), keys4);" in unmasked
    # ... but causal, windowed, soft-capped or with a score_mod (more values live there) inside the probabilities.
    capped = render(KernelSpec(head_dim=64, softcap=True, bias=True).backward_spec(bias_grad=True))
    assert "float const dbias = dscore;" in capped
    for later in (code, capped):
        assert "load_step_bias" not in later
        assert "if (row < bias_rows && key < bias_keys && dbias != 0.f) { atomicAdd(&bias_grad(row, key), dbias); }" in later
    assert "auto const bias = bias_tile<float const>(p, 0, batch, head, m_block * kBlockM, key0);" in capped
    # Masked hdim 128 (bwd_bias_prefetch): the next step's bias rows go into L1 under this step's dQ
    # GEMM, so those reads after the wait hit L1; not where the loads run under the GEMMs, nor with
    # softcap or a score_mod, nor in the dq_deferred loops (hdim 64).
    causal = KernelSpec(head_dim=128, causal=True, bias=True).backward_spec(bias_grad=True)
    causal_code = render(causal)
    assert causal.bwd_bias_prefetch and causal_code.count("prefetch.global.L1") == 2
    assert causal_code.index("prefetch_step_bias(p, s_coord, batch, head, m_block + 1, n_block);") > causal_code.index(
        "fa3gen::wgmma_gemm</*kZeroInit=*/true>(mma_dq")
    for other in (unmasked_spec, KernelSpec(head_dim=128, causal=True, softcap=True, bias=True).backward_spec(),
                  KernelSpec(head_dim=64, causal=True, bias=True).backward_spec()):
        assert not other.bwd_bias_prefetch and "prefetch.global.L1" not in render(other)
    for bad, match in ((dict(head_dim=64, bias=True, bias_grad=True), "needs kind='bwd' and bias=True"),
                       (dict(kind="bwd", head_dim=64, bias_grad=True), "needs kind='bwd' and bias=True"),
                       (dict(kind="bwd", head_dim=64, bias=True, bias_grad=True, deterministic=True), "not deterministic"),
                       (dict(kind="bwd", head_dim=64, bias=True, bias_grad=True, softcap=True,
                             score_mod={"expr": "score", "grad": "1"}), "both softcap and a score_mod")):
        with pytest.raises(ValidationError, match=match):
            KernelSpec(**bad)
    with pytest.raises(ValidationError, match="passes its values as the tensor 'attn_bias_grad'"):
        KernelSpec(kind="bwd", head_dim=64, bias=True, bias_grad=True, score_mod={"expr": "score + attn_bias_grad(h)", "grad": "1"},
                   params=[{"kind": "tensor", "name": "attn_bias_grad", "ndim": 1}])


@pytest.mark.parametrize("dtype, element, pair, to_float2", [("bfloat16", "__nv_bfloat16", "__nv_bfloat162", "__bfloat1622float2"),
                                                            ("float16", "__half", "__half2", "__half22float2")])
def test_bias_dtype_reads_a_16_bit_bias_as_it_is(dtype, element, pair, to_float2):
    """bias_dtype: attn_bias in 16 bits (what a bf16/fp16 model holds; torch SDPA's attn_mask takes
    q's dtype) is read as such, pairs of adjacent keys as one 4-byte word, and added in fp32, in
    the forward and the backward; its gradient is still added up in fp32. float32 stays the
    default and is left out of the JSON, so the fp32 bias kernels keep their sources."""
    from fa3gen import registry
    from fa3gen.spec_attention import _bias_dtype

    spec = KernelSpec(head_dim=128, bias=True, bias_dtype=dtype)
    assert spec.bias_element == element and spec.name.startswith(f"fwd_d128_bf16_bias_{dtype[0]}")
    assert [(p.name, p.dtype) for p in spec.variant_params] == [("attn_bias", dtype)]
    assert "bias_dtype" not in KernelSpec(head_dim=128, bias=True).canonical_json()
    assert f'"bias_dtype":"{dtype}"' in spec.canonical_json()
    code = render(spec)
    # Pairs of adjacent keys loaded as one 4-byte word and kept packed (half the registers of fp32
    # values) until the score converts its entry.
    assert f"bias_tile<{element} const>(p, 0, t.batch, t.head" in code
    assert f"Tensor values = make_tensor<{pair}>(" in code
    assert f"values(r, c / 2) = *reinterpret_cast<{pair} const*>(&bias(" in code
    assert f"sizeof({element})) % 4) == 0;" in code
    assert f"float2 const pair = {to_float2}(values(r, c / 2));" in code
    assert "score += bias_value(bias_values, r, c);" in code
    bwd = spec.backward_spec(bias_grad=True)
    assert bwd.bias_dtype == dtype and f"_bias_{dtype[0]}" in bwd.name
    bwd_code = render(bwd)
    assert f"bias_tile<{element} const>(p, 0, batch, head" in bwd_code and "score += float(bias_values(r, c));" in bwd_code
    assert f"Tensor values = make_tensor<{element}>(shape(coord));" in bwd_code
    assert "auto const bias_grad = bias_tile<float>(" in bwd_code
    assert registry.default_spec(128, 128, "bf16", False, bias=True, bias_dtype=dtype) == spec
    # Rows on 16-byte boundaries: the hdim 128 default stages them through shared memory.
    staged = registry.default_spec(128, 128, "bf16", False, bias=True, bias_dtype=dtype, bias_rows_aligned=True)
    assert staged == KernelSpec(head_dim=128, bias=True, bias_dtype=dtype, bias_staging=True)
    # hdim 64 and 96 stage 16-bit biases only (fp32 measured slower there: its tile drops a Q buffer).
    assert registry.default_spec(64, 64, "bf16", False, bias=True, bias_dtype=dtype, bias_rows_aligned=True).bias_staging
    assert not registry.default_spec(96, 96, "bf16", False, bias=True, bias_rows_aligned=True).bias_staging
    assert not registry.default_spec(256, 256, "bf16", False, bias=True, bias_dtype=dtype, bias_rows_aligned=True).bias_staging
    assert _bias_dtype(torch.zeros(1, dtype=getattr(torch, dtype))) == dtype and _bias_dtype(None) == "float32"
    with pytest.raises(ValueError, match="attn_bias must be float32, bfloat16 or float16"):
        _bias_dtype(torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValidationError, match="needs bias=True"):
        KernelSpec(head_dim=128, bias_dtype=dtype)


@pytest.mark.parametrize("dtype, entry_bytes", [("float32", 4), ("bfloat16", 2)])
def test_bias_staging_copies_bias_rows_through_shared_memory(dtype, entry_bytes):
    """bias_staging: each consumer warpgroup copies its 64 rows of a key block's bias into a padded
    shared tile with 16-byte cp.async (a block ahead for 16-bit biases, under the block's GEMMs for
    fp32) and reads its entries from there after the block's wait, barriers on both sides of the reads; the tile's bytes count in the shared-memory
    budget (the defaults give up the O staging tile or a Q buffer for it). Off by default and left
    out of the JSON: the other bias kernels keep their sources."""
    spec = KernelSpec(head_dim=128, bias=True, bias_dtype=dtype, bias_staging=True)
    plain = KernelSpec(head_dim=128, bias=True, bias_dtype=dtype)
    assert spec.name.endswith("_bstg") and "bias_staging" not in plain.canonical_json()
    assert '"bias_staging":true' in spec.canonical_json()
    tile = spec.block_m * (spec.block_n * entry_bytes + 16)
    assert spec.smem_bytes - tile == KernelSpec(**{**spec.model_dump(), "bias_staging": False}).smem_bytes
    assert spec.smem_bytes <= 227 * 1024 < plain.smem_bytes + tile  # the default tiles had no room for it
    code = render(spec)
    assert "constexpr int kBiasRowPitch = kBlockN + kBiasChunk;" in code
    assert "alignas(128) cute::array_aligned<BiasElement, kBlockM * kBiasRowPitch> bias;" in code
    # 16-bit biases (bias_staged_ahead): the first block's copies before the tile's waits, each later
    # block's issued by the block before once its own entries are added to S (the buffer is free),
    # so they land under a softmax and the next GEMMs. fp32 (slower that way): each block's copies
    # right after its own GEMMs are issued.
    assert spec.bias_staged_ahead == (dtype != "float32")
    assert code.count("= read_staged_bias(p, smem, ") == 2  # first block, loop
    ahead = "if (n_block > blocks.begin) { stage_bias(p, smem, t, n_block - 1, warpgroup, mma_thread % 128); }"
    under_gemms = "stage_bias(p, smem, t, n_block, warpgroup, mma_thread % 128);  // copies under the GEMMs"
    loop = code[code.index("for (int n_block = blocks.end - 2; n_block >= blocks.begin; --n_block)"):]
    if spec.bias_staged_ahead:
        assert code.count("stage_bias(p, smem, t, n_block, warpgroup, mma_thread % 128);  // copies under the waits") == 1
        assert code.count(ahead) == 2 and under_gemms not in code
        assert loop.index("read_staged_bias(") < loop.index("apply_score_mods(") < loop.index(ahead)
    else:
        assert code.count(under_gemms) == 2 and ahead not in code
        assert loop.index(under_gemms) < loop.index("warpgroup_wait<1>()") < loop.index("read_staged_bias(")
    assert "SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(" in code
    assert code.count("cutlass::arch::NamedBarrier::sync(128, kBiasBarrier + warpgroup);") == 2
    assert "load_bias(p, s_coord" not in code  # no entry is read from global memory in the loop
    serial = KernelSpec(head_dim=128, bias=True, bias_dtype=dtype, bias_staging=True, intra_wg_overlap=False)
    serial_code = render(serial)
    if spec.bias_staged_ahead:
        assert "{ stage_bias(p, smem, t, blocks.end - 1, warpgroup, mma_thread % 128); }  // the first block's" in serial_code
        assert ahead in serial_code
    else:
        assert "stage_bias(p, smem, t, n_block, warpgroup, mma_thread % 128);  // copies under the GEMM" in serial_code
    assert spec.backward_spec() == plain.backward_spec()  # the forward's choice; the backward reads as before
    for bad in (dict(head_dim=128, bias_staging=True), dict(kind="bwd", head_dim=128, bias=True, bias_staging=True)):
        with pytest.raises(ValidationError, match="bias_staging stages the forward's attn_bias tiles"):
            KernelSpec(**bad)
    with pytest.raises(ValidationError, match="the staged 128x128 bias tile"):
        KernelSpec(head_dim=128, bias=True, bias_dtype=dtype, bias_staging=True, epilogue="tma", q_buffers=2)


def test_bias_staging_needs_16_byte_rows_and_flash_attn_func_pads_them():
    """A bias_staging kernel copies rows in 16-byte pieces: a bias whose address or batch, head or
    row stride is not a multiple of 16 bytes is refused by the launch's check, and
    flash_attn_func's bias (broadcast_bias with aligned_rows) is copied into padded rows first."""
    from fa3gen.spec_attention import broadcast_bias
    from fa3gen.variant_args import bias_rows_aligned

    spec = KernelSpec(head_dim=64, bias=True, bias_staging=True)
    q, k = torch.zeros(2, 5, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 7, 4, 64, dtype=torch.bfloat16)
    odd = torch.randn(1, 4, 5, 7)  # rows of 28 bytes
    assert not bias_rows_aligned(odd.expand(2, 4, 5, 7)) and bias_rows_aligned(torch.randn(2, 4, 5, 8))
    with pytest.raises(ValueError, match="copies attn_bias rows in 16-byte pieces"):
        VariantArgs(params={"attn_bias": odd.expand(2, 4, 5, 7)}).check_tensors(spec, q, k)
    padded = broadcast_bias(odd, q, k, aligned_rows=True)
    assert bias_rows_aligned(padded) and padded.stride()[:3] == (0, 5 * 8, 8) and torch.equal(padded[1], odd[0])
    VariantArgs(params={"attn_bias": padded}).check_tensors(spec, q, k)
    assert broadcast_bias(odd, q, k).stride()[2] == 7  # other kernels read it as it is
