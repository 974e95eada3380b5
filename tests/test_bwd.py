"""The backward pass on the CPU: bwd specs, the ABI mirror, loading a backward library, the
``fa3gen::bwd`` op's validation and fake impl, and the autograd formula of ``fa3gen::fwd``.

Where the ops must run, their implementations are routed to the float64 reference on CPU (as in
test_ops_cpu.py); the kernels themselves are tested in tests/gpu/test_bwd_gpu.py.
"""

from __future__ import annotations

import ctypes
import math
import re
import subprocess
import types

import pytest
import torch
from pydantic import ValidationError
from torch._subclasses.fake_tensor import FakeTensorMode

import fa3gen
from fa3gen import REGISTRY, KernelSpec, abi, ops, registry
from fa3gen.bench import _parse, attn_bwd_flops, attn_fwd_flops
from fa3gen.reference import attention_reference, attention_reference_grads
from fa3gen.spec import SMEM_BUDGET_BYTES
from fa3gen.variant_args import VariantArgs
from fa3gen_testing import MINI_TEMPLATE, REPO, host_cxx, write_templates


def qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=64, dtype=torch.bfloat16, device="cpu", requires_grad=False):
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def bwd_inputs(b=2, sq=5, sk=7, hq=4, hkv=2, d=64, dtype=torch.bfloat16, device="cpu"):
    """dout, q, k, v, out, lse of a well-formed backward problem."""
    q, k, v = qkv(b, sq, sk, hq, hkv, d, dtype, device)
    out = torch.randn(b, sq, hq, d, dtype=dtype, device=device)
    dout = torch.randn(b, sq, hq, d, dtype=dtype, device=device)
    lse = torch.randn(b, hq, sq, dtype=torch.float32, device=device)
    return dout, q, k, v, out, lse


# ---------------------------------------------------------------------------------------------
# specs and the registry
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("d", "block_n", "stages"), [(64, 128, 3), (96, 128, 2), (128, 128, 2), (192, 64, 2),
                                                     (256, 64, 1)])
def test_bwd_spec_defaults(d, block_n, stages):
    """Up to hdim 128 each consumer warpgroup owns 64 keys; 192 and 256 share 64 keys and split the
    head dim, and 256 has room for one stage beside its fp32 dQ tile. The CTAs are persistent
    ("lpt") except at 256 (one CTA per key block: the persistent order measured slower there).
    hdim 64 keeps K and V in registers and runs three stages."""
    spec = KernelSpec(kind="bwd", head_dim=d)
    assert spec.kind == "bwd" and not spec.deterministic and not spec.causal
    assert (spec.head_dim_v, spec.block_m, spec.block_n, spec.stages) == (d, 64, block_n, stages)
    assert spec.bwd_splits_head_dim == (block_n == 64)
    assert spec.num_consumer_warpgroups == 2
    assert spec.smem_bytes <= SMEM_BUDGET_BYTES
    assert spec.name.startswith(f"bwd_d{d}_bf16_")
    assert spec.scheduler == ("grid" if d == 256 else "lpt")
    tags = spec.name.split("_")  # the name's switch tags, e.g. lpt, kvr, dqd, dq1, p24, kvp
    assert ("lpt" in tags) == (spec.scheduler == "lpt")
    assert "_det" in KernelSpec(kind="bwd", head_dim=d, deterministic=True).name
    # block_n 64 below hdim 128 splits the head dim too, so it keeps the grid.
    assert KernelSpec(kind="bwd", head_dim=64, block_n=64).scheduler == "grid"
    assert spec.causal_group == 4 and not spec.name.endswith("_g4")
    assert spec.kv_registers == (d == 64) == ("kvr" in tags)
    assert spec.dq_deferred == (d in (64, 96)) == ("dqd" in tags)
    assert spec.dq_single_warpgroup == (d in (64, 96, 128)) == ("dq1" in tags)
    assert (spec.producer_registers == 24) == (d == 128) == ("p24" in tags)
    assert spec.kv_prefetch == (d == 128) == ("kvp" in tags)


def test_kv_registers_is_a_backward_field_left_out_of_json_at_its_default():
    """kv_registers (K and V as register A operands of Sᵀ and dPᵀ): on by default at hdim 64 with
    the keys split, written to the canonical JSON only where it differs from that default, so the
    other head dims' kernels keep their identity; refused for the forward and with the head-dim
    split; rendered as register-sourced WGMMAs loaded by ldmatrix."""
    on = KernelSpec(kind="bwd", head_dim=64)
    off = KernelSpec(kind="bwd", head_dim=64, kv_registers=False)
    d128 = KernelSpec(kind="bwd", head_dim=128)
    d128_on = KernelSpec(kind="bwd", head_dim=128, kv_registers=True)
    assert '"kv_registers"' not in on.canonical_json() and '"kv_registers":false' in off.canonical_json()
    assert '"kv_registers"' not in d128.canonical_json() and '"kv_registers":true' in d128_on.canonical_json()
    assert "kv_registers" not in KernelSpec(head_dim=64).canonical_json()
    for spec in (on, off, d128, d128_on, KernelSpec(head_dim=64)):
        assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert (on.stages, off.stages) == (3, 2) and not off.name.endswith("_kvr")
    assert KernelSpec(kind="bwd", head_dim=64, stages=2).kv_registers
    assert "rs_op_selector<Element, Element, float, Shape<_64, Int<kScoreColumns>" in fa3gen.render(on)
    assert "SM75_U32x4_LDSM_N" in fa3gen.render(on) and "SM75_U32x4_LDSM_N" not in fa3gen.render(off)
    assert not KernelSpec(kind="bwd", head_dim=64, block_n=64).kv_registers
    with pytest.raises(ValidationError, match=r"kv_registers applies to backward kernels"):
        KernelSpec(head_dim=64, kv_registers=True)
    with pytest.raises(ValidationError, match=r"kv_registers needs each consumer warpgroup to own 64 keys"):
        KernelSpec(kind="bwd", head_dim=64, block_n=64, kv_registers=True)


def test_dq_deferred_is_a_backward_field_left_out_of_json_at_its_default():
    """dq_deferred (each step's dQ GEMM issued at the next step, under its softmax): a backward
    field with the keys split, written to the canonical JSON only where it differs from its
    default; refused for the forward and with the head-dim split; rendered as a peeled first step,
    the loop, and the last step's dQ after it."""
    default = KernelSpec(kind="bwd", head_dim=64)
    flipped = KernelSpec(kind="bwd", head_dim=64, dq_deferred=not default.dq_deferred)
    assert '"dq_deferred"' not in default.canonical_json()
    assert f'"dq_deferred":{str(flipped.dq_deferred).lower()}' in flipped.canonical_json()
    for spec in (default, flipped):
        assert KernelSpec.from_json(spec.canonical_json()) == spec
        assert ("dqd" in spec.name.split("_")) == spec.dq_deferred
    # (Both warpgroups' halves of the dQ: hdim 64 runs it in one warpgroup by default, dq_single_warpgroup.)
    on, off = (fa3gen.render(spec) for spec in (KernelSpec(kind="bwd", head_dim=64, dq_single_warpgroup=False),
                                                KernelSpec(kind="bwd", head_dim=64, dq_deferred=False)))
    marker = "cutlass::arch::NamedBarrier::sync(kMmaThreads, kDsBarrier);  // the last step's dS of both warpgroups"
    assert marker in on and marker not in off
    assert on.count("tDQrDS(_, _, _, buffer ^ 1)") == 2 and "tDQrDS(_, _, _, buffer)" not in on
    assert all(KernelSpec(kind="bwd", head_dim=d).dq_deferred and '"dq_deferred"' not in KernelSpec(kind="bwd", head_dim=d).canonical_json()
               for d in (64, 96))
    assert not KernelSpec(kind="bwd", head_dim=256).dq_deferred and "dq_deferred" not in KernelSpec(head_dim=64).canonical_json()
    # not with a score derivative in the step (the causal soft-capped hdim 64 kernel spilled 32 B)
    assert not KernelSpec(kind="bwd", head_dim=64, causal=True, softcap=True).dq_deferred
    assert KernelSpec(kind="bwd", head_dim=64, causal=True, window=True).dq_deferred
    with pytest.raises(ValidationError, match=r"dq_deferred applies to backward kernels"):
        KernelSpec(head_dim=64, dq_deferred=True)
    with pytest.raises(ValidationError, match=r"dq_deferred needs each consumer warpgroup to own 64 keys"):
        KernelSpec(kind="bwd", head_dim=256, dq_deferred=True)


def test_dq_single_warpgroup_renders_turns():
    """dq_single_warpgroup (one warpgroup runs a step's whole dQ, the two taking turns): a backward
    field of the keys-split kernels, on by default with dq_deferred, left out of the canonical JSON at its default, refused for the
    forward; its kernel runs the dQ GEMM over the whole head dim in one warpgroup, gives the dQ
    tile in that warpgroup's fragment order to the writer and the conversion, and waits on one dS
    barrier per issuing warpgroup."""
    default = KernelSpec(kind="bwd", head_dim=64)
    single = KernelSpec(kind="bwd", head_dim=64, dq_single_warpgroup=not default.dq_single_warpgroup)
    on, off = sorted((default, single), key=lambda s: not s.dq_single_warpgroup)
    assert on.dq_single_warpgroup and not off.dq_single_warpgroup
    assert '"dq_single_warpgroup"' not in default.canonical_json()
    assert f'"dq_single_warpgroup":{str(single.dq_single_warpgroup).lower()}' in single.canonical_json()
    for spec in (default, single):
        assert KernelSpec.from_json(spec.canonical_json()) == spec
        assert ("dq1" in spec.name.split("_")) == spec.dq_single_warpgroup
    src_on, src_off = fa3gen.render(on), fa3gen.render(off)
    whole = "Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>"
    assert whole in src_on and whole not in src_off
    assert "bwd_convert_dq<<<convert_grid, kDqThreads, 0, stream>>>" in src_on
    assert "bwd_convert_dq<<<convert_grid, kMmaThreads, 0, stream>>>" in src_off
    assert "NamedBarrier::sync(kMmaThreads, ds_ready_barrier(warpgroup))" in src_on
    assert "ds_ready_barrier" not in src_off
    # The previous step's dQ, in the loop and after it, by whichever warpgroup's turn it is.
    assert src_on.count("tDQrDS(_, _, _, buffer ^ 1)") == 2 and src_on.count("dq_warpgroup(step - 1) == warpgroup") == 1
    # Without dq_deferred, the warpgroup whose turn it is runs the step's dQ at the step's end.
    plain = fa3gen.render(KernelSpec(kind="bwd", head_dim=128, dq_single_warpgroup=True))
    assert plain.count("tDQrDS(_, _, _, buffer)") == 1 and "dq_warpgroup(step) == warpgroup" in plain
    # hdim 128: on causal or not, with windows and soft-capping (measured faster there); off with
    # ALiBi (tied) and the custom mods (unmeasured).
    assert all(KernelSpec(kind="bwd", head_dim=128, **kw).dq_single_warpgroup
               for kw in (dict(), dict(deterministic=True), dict(causal=True), dict(window=True), dict(softcap=True),
                          dict(causal=True, window=True, softcap=True)))
    assert not any(KernelSpec(kind="bwd", head_dim=128, **kw).dq_single_warpgroup
                   for kw in (dict(alibi=True), dict(causal=True, alibi=True),
                              dict(mask_mod={"expr": "kv_idx <= q_idx"})))
    with pytest.raises(ValidationError, match=r"dq_single_warpgroup needs each consumer warpgroup to own 64 keys"):
        KernelSpec(kind="bwd", head_dim=256, dq_single_warpgroup=True)
    with pytest.raises(ValidationError, match=r"dq_single_warpgroup applies to backward kernels"):
        KernelSpec(head_dim=64, dq_single_warpgroup=True)


def test_producer_registers_sets_the_backward_register_split():
    """producer_registers: the backward producer warpgroup's setmaxnreg count, the consumers get the
    rest of the launch's 64512 registers (40 -> 232, 24 -> 240). 24 by default where a step's dQ
    runs in one warpgroup at the step's end (hdim 128), 40 elsewhere; left out of the canonical
    JSON at its default; refused for the forward and outside the offered counts."""
    d128, d64 = KernelSpec(kind="bwd", head_dim=128), KernelSpec(kind="bwd", head_dim=64)
    assert (d128.producer_registers, d128.register_split) == (24, (24, 240))
    assert (d64.producer_registers, d64.register_split) == (40, (40, 232))
    # Not where the dQ is split between the warpgroups or deferred, nor with the head dim split.
    for kw in (dict(head_dim=128, dq_single_warpgroup=False), dict(head_dim=128, alibi=True),
               dict(head_dim=96), dict(head_dim=256), dict(head_dim=192)):
        assert KernelSpec(kind="bwd", **kw).producer_registers == 40, kw
    for spec in (d128, d64):
        assert 128 * spec.register_split[0] + 256 * spec.register_split[1] <= spec.register_pool == 64512
    flipped = KernelSpec(kind="bwd", head_dim=128, producer_registers=40)
    assert '"producer_registers"' not in d128.canonical_json() and '"producer_registers":40' in flipped.canonical_json()
    for spec in (d128, flipped, KernelSpec(kind="bwd", head_dim=64, producer_registers=24)):
        assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert d128.name.endswith("_dq1_p24_kvp") and flipped.name.endswith("_dq1_kvp")
    src = fa3gen.render(d128)
    assert "constexpr int kProducerRegisters = 24;" in src and "constexpr int kConsumerRegisters = 240;" in src
    assert "constexpr int kConsumerRegisters = 232;" in fa3gen.render(flipped)
    with pytest.raises(ValidationError, match=r"producer_registers=32 must be one of \(24, 40\)"):
        KernelSpec(kind="bwd", head_dim=128, producer_registers=32)
    with pytest.raises(ValidationError, match=r"producer_registers=24: a forward spec may set it only with three or four consumer warpgroups"):
        KernelSpec(head_dim=128, producer_registers=24)


def test_kv_prefetch_is_an_lpt_backward_field():
    """kv_prefetch: a persistent backward CTA's producer prefetches the key block it claims next
    into L2 before it waits for the consumers to finish the current one. On by default for the
    persistent hdim 128 kernels with the keys split, off elsewhere (left out of the canonical JSON
    at its default); needs the lpt scheduler; refused for the forward."""
    on, off = KernelSpec(kind="bwd", head_dim=128), KernelSpec(kind="bwd", head_dim=128, kv_prefetch=False)
    assert on.kv_prefetch and '"kv_prefetch"' not in on.canonical_json()
    assert '"kv_prefetch":false' in off.canonical_json()
    for spec in (on, off, KernelSpec(kind="bwd", head_dim=64, kv_prefetch=True)):
        assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert on.name.endswith("_kvp") and not off.name.endswith("_kvp")
    assert not any(KernelSpec(kind="bwd", head_dim=128, **kw).kv_prefetch
                   for kw in (dict(scheduler="grid"), dict(block_n=64)))
    assert not any(KernelSpec(kind="bwd", head_dim=d).kv_prefetch for d in (64, 96, 192, 256))
    assert KernelSpec(kind="bwd", head_dim=128, causal=True, window=True).kv_prefetch
    src_on, src_off = fa3gen.render(on), fa3gen.render(off)
    assert "cute::prefetch(p.tma_k, tKgK);" in src_on and "prefetch_key_block(p, smem, t);" in src_on
    assert "prefetch_key_block" not in src_off
    # The load's boxes and the prefetch's are the same lines.
    boxes = "auto [tKgK, tKsK] = tma_partition(p.tma_k"
    assert src_on.count(boxes) == 2 and src_off.count(boxes) == 1
    with pytest.raises(ValidationError, match=r"kv_prefetch .* needs scheduler='lpt'"):
        KernelSpec(kind="bwd", head_dim=256, kv_prefetch=True)
    with pytest.raises(ValidationError, match=r"kv_prefetch applies to backward kernels"):
        KernelSpec(head_dim=128, kv_prefetch=True)


def test_backward_tests_each_entry_only_on_masked_blocks():
    """A causal or windowed backward runs the probabilities in two versions, the per-entry mask
    test only on the blocks that need it; without a band (only seqlen_k bounds the keys) one
    loop tests every block's entries against seqlen_k when the block crosses it."""
    for spec in (KernelSpec(kind="bwd", head_dim=64, causal=True), KernelSpec(kind="bwd", head_dim=128, window=True),
                 KernelSpec(kind="bwd", head_dim=256, causal=True, softcap=True)):
        src = fa3gen.render(spec)
        assert "fill(cute::true_type{});" in src and "fill(cute::false_type{});" in src
        assert "decltype(masked)::value && !visible(p, batch, head, row, key)" in src
    plain = fa3gen.render(KernelSpec(kind="bwd", head_dim=64))
    assert "fill(cute::" not in plain and "needs_mask && !visible(p, batch, head, row, key)" in plain


def test_causal_group_is_a_backward_field_left_out_of_json_at_its_default():
    """causal_group orders the causal backward's key blocks in groups of (batch, kv head) pairs:
    filled for backward specs, refused for the forward, named when not the default, and written
    to the canonical JSON only then, so the kernels that predate it keep their identity."""
    default = KernelSpec(kind="bwd", head_dim=128, causal=True)
    two = KernelSpec(kind="bwd", head_dim=128, causal=True, causal_group=2)
    assert '"causal_group"' not in default.canonical_json() and '"causal_group":2' in two.canonical_json()
    assert "causal_group" not in KernelSpec(head_dim=128).canonical_json()
    for spec in (default, two, KernelSpec(head_dim=128)):
        assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert "_lpt_g2" in two.name and two.content_hash != default.content_hash
    assert "constexpr int kCausalGroup = 2;" in fa3gen.render(two)
    assert "constexpr int kCausalGroup = 4;" in fa3gen.render(default)
    with pytest.raises(ValidationError, match=r"causal_group applies to backward kernels"):
        KernelSpec(head_dim=128, causal=True, causal_group=2)
    with pytest.raises(ValidationError, match=r"causal_group"):
        KernelSpec(kind="bwd", head_dim=128, causal=True, causal_group=0)
    with pytest.raises(ValidationError, match=r"causal_group=2 orders a causal backward's key blocks"):
        KernelSpec(kind="bwd", head_dim=128, causal_group=2)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"kind": "bwd", "head_dim": 192, "block_n": 128}, r"head_dim 192 needs block_n=64: fp32 dK and dV"),
        ({"kind": "bwd", "head_dim": 128, "block_n": 192}, r"block_n=192 must be 128 .* or 64 \(the warpgroups share"),
        ({"kind": "bwd", "head_dim": 64, "block_m": 128}, r"block_m=128 must be 64"),
        ({"kind": "bwd", "head_dim": 256, "stages": 2}, r"backward shared memory 2\d+ B exceeds"),
        ({"kind": "bwd", "head_dim": 128, "head_dim_v": 64}, r"head_dim_v == head_dim"),
        ({"kind": "bwd", "head_dim": 64, "score_mod": {"expr": "score * 2"}}, r"needs score_mod.grad, its derivative"),
        ({"kind": "bwd", "head_dim": 64, "score_mod": {"expr": "score", "grad": "1 + nope"}},
         r"score_mod.grad '1 \+ nope' uses unknown name\(s\) nope"),
        ({"kind": "bwd", "head_dim": 128, "pingpong": True}, r"pingpong apply to forward kernels only"),
        ({"kind": "bwd", "head_dim": 128, "scheduler": "static"}, r"backward scheduler='static' is not available"),
        ({"head_dim": 128, "deterministic": True}, r"deterministic applies to backward kernels"),
        ({"kind": "both", "head_dim": 128}, r"kind"),
    ],
)
def test_bad_bwd_specs(fields, expected):
    with pytest.raises(ValidationError, match=expected):
        KernelSpec(**fields)


def test_bwd_spec_identity():
    fwd = KernelSpec(head_dim=128, causal=True)
    bwd = KernelSpec(kind="bwd", head_dim=128, causal=True)
    det = KernelSpec(kind="bwd", head_dim=128, causal=True, deterministic=True)
    jsons = {s.canonical_json() for s in (fwd, bwd, det)}
    hashes = {s.content_hash for s in (fwd, bwd, det)}
    names = {s.name for s in (fwd, bwd, det)}
    assert len(jsons) == len(hashes) == len(names) == 3
    for spec in (bwd, det):
        again = KernelSpec.from_json(spec.canonical_json())
        assert again == spec and again.content_hash == spec.content_hash
    # explicit defaults do not change the identity
    explicit = KernelSpec.from_json('{"kind": "bwd", "head_dim": 128, "causal": true, "block_m": 64, '
                                    '"block_n": 128, "stages": 2, "deterministic": false}')
    assert explicit.content_hash == bwd.content_hash


def test_registry_holds_the_bwd_specs():
    bwd = {name: spec for name, spec in REGISTRY.items() if spec.kind == "bwd"}
    assert sorted(bwd) == sorted(f"bwd_d{d}_{dt}{c}" for d in (64, 96, 128, 192, 256) for dt in ("bf16", "fp16")
                                 for c in ("", "_causal"))
    for name, spec in bwd.items():
        assert spec == KernelSpec(kind="bwd", head_dim=spec.head_dim, dtype=spec.dtype, causal=spec.causal)
        assert registry.resolve(name) is spec and registry.display_name(spec) == name
    fwd = [name for name, spec in REGISTRY.items() if spec.kind == "fwd"]
    # 16-bit, 6 e4m3, and the query-length tiles of registry.SEQLEN_TILES (each bucket with fields
    # of its own, bf16 and fp16) and of FP8_SEQLEN_TILES (those with fields of their own), and a
    # split twin of each
    buckets = sum(len(tiers) for tiers in registry.SEQLEN_TILES.values())
    fp8_buckets = sum(bool(fields) for tiers in registry.FP8_SEQLEN_TILES.values() for _, _, fields in tiers)
    plain = 20 + 6 + 2 * buckets + fp8_buckets
    assert len(fwd) == 2 * plain and all(name.startswith("fwd_") for name in fwd)
    assert all(REGISTRY[name + registry.SPLIT_TWIN_SUFFIX].split_tail for name in fwd if not REGISTRY[name].split_tail)
    assert REGISTRY[registry.REPRESENTATIVE].kind == "fwd"


def test_default_bwd_spec():
    assert registry.default_bwd_spec(128, 128, "bf16", True) is REGISTRY["bwd_d128_bf16_causal"]
    assert registry.default_bwd_spec(64, 64, "torch.float16", False) is REGISTRY["bwd_d64_fp16"]
    det = registry.default_bwd_spec(96, 96, "half", True, deterministic=True)
    assert det == KernelSpec(kind="bwd", head_dim=96, dtype="fp16", causal=True, deterministic=True)
    assert registry.default_bwd_spec(256, 256, "fp16", True) is REGISTRY["bwd_d256_fp16_causal"]
    with pytest.raises(ValueError, match=r"backward supports head_dim_v == head_dim only"):
        registry.default_bwd_spec(128, 64, "bf16", False)
    with pytest.raises(ValueError, match=r"head_dim=80 is not supported"):
        registry.default_bwd_spec(80, 80, "bf16", False)
    with pytest.raises(ValueError, match=r"dtype='fp8' is not supported"):
        registry.default_bwd_spec(128, 128, "fp8", False)


def test_render_bwd_spec():
    spec = KernelSpec(kind="bwd", head_dim=128, causal=True)
    source = fa3gen.render(spec)
    for symbol in ("fa3gen_abi_version", "fa3gen_spec_json", "fa3gen_bwd", "fa3gen_bwd_workspace_bytes"):
        assert symbol in source
    assert spec.canonical_json() in source
    assert source == fa3gen.render(KernelSpec.from_json(spec.canonical_json()))
    assert fa3gen.render(KernelSpec(kind="bwd", head_dim=128, causal=True, deterministic=True)) != source


def test_backward_spec_of_a_forward_spec():
    fwd = KernelSpec(head_dim=128, dtype="fp16", causal=True, window=True, softcap=True, block_n=64, pingpong=True)
    bwd = fwd.backward_spec()
    assert bwd.kind == "bwd" and not bwd.deterministic
    assert (bwd.head_dim, bwd.dtype, bwd.causal, bwd.window, bwd.softcap, bwd.alibi) == (128, "fp16", True, True, True, False)
    assert (bwd.block_m, bwd.block_n, bwd.pingpong) == (64, 128, False)  # the backward's tiles, not the forward's
    assert fwd.backward_spec(deterministic=True).deterministic
    custom = KernelSpec(head_dim=128, score_mod={"expr": "score / temp", "grad": "1.f / temp"}, params=[{"kind": "scalar", "name": "temp"}])
    assert custom.backward_spec().score_mod == custom.score_mod and custom.backward_spec().params == custom.params
    with pytest.raises(ValueError, match="backward of a forward spec"):
        bwd.backward_spec()
    with pytest.raises(ValidationError, match="needs score_mod.grad"):
        KernelSpec(head_dim=128, score_mod={"expr": "score * 2"}).backward_spec()


def test_render_bwd_variants():
    """Each variant's backward code is selected by the spec: the forward's score modifications with
    their derivative, the band's query-block range, and the deterministic order's first key block."""
    plain = fa3gen.render(KernelSpec(kind="bwd", head_dim=128, causal=True))
    window = fa3gen.render(KernelSpec(kind="bwd", head_dim=128, causal=True, window=True, deterministic=True))
    softcap = fa3gen.render(KernelSpec(kind="bwd", head_dim=128, softcap=True, alibi=True))
    custom = fa3gen.render(KernelSpec(kind="bwd", head_dim=128, score_mod={"expr": "score / temp", "grad": "1.f / temp"},
                                      mask_mod={"expr": "kv_idx != q_idx"}, params=[{"kind": "scalar", "name": "temp"}]))
    assert "p.variant.window_left" not in plain and "tanh_approx" not in plain and "score_grad" not in plain
    assert "p.variant.window_right;" not in plain and "p.scale_log2, -lse" in plain
    assert "+ p.variant.window_left;" in window  # the last query row that sees the key block
    assert "n_block - first_key_block(p, m_block)" in window
    assert "return max(first_visible_key(p, m_block * kBlockM), 0) / kBlockN;" in window
    assert "dscore = 1.f - t * t;" in softcap and "* float(score_grad(r, c))" in softcap
    assert "using ScoreGrad = cutlass::half_t;" in softcap and "using ScoreGrad = float;" in custom
    # Soft-capping alone in a masked hdim-128 kernel: 1 - t^2 recovered from P and the LSE at dS time.
    recompute = KernelSpec(kind="bwd", head_dim=128, causal=True, softcap=True)
    assert recompute.bwd_recomputes_softcap_grad
    source = fa3gen.render(recompute)
    assert "fmaf(__log2f(prob), t_per_log2p, t_offset)" in source and "ScoreGrad" not in source
    for kept in (KernelSpec(kind="bwd", head_dim=128, softcap=True),  # no mask: the extra lg2 costs more
                 KernelSpec(kind="bwd", head_dim=128, causal=True, softcap=True, alibi=True),  # ALiBi after the cap
                 KernelSpec(kind="bwd", head_dim=64, causal=True, softcap=True),  # registers to spare
                 KernelSpec(kind="bwd", head_dim=256, causal=True, softcap=True)):  # head-dim split
        assert not kept.bwd_recomputes_softcap_grad and "__log2f" not in fa3gen.render(kept), kept.name
    assert "p.variant.alibi_slopes[batch * p.variant.alibi_batch_stride + head]" in softcap
    assert "return float(1.f / temp);" in custom and "dscore *= score_mod_grad(p, score, batch, head, row, key);" in custom
    assert "mask_mod(p, batch, head, row, key)" in custom and "return true;" in custom  # mask_mod: every block masks


@pytest.mark.parametrize("fields", [{"head_dim": 256}, {"head_dim": 128, "block_n": 64}])
def test_render_bwd_head_dim_split(fields):
    """block_n=64: the warpgroups split the head dim, P gets a shared-memory tile, and the dV and dK
    GEMMs read P and dS from shared memory (not from registers as with block_n=128)."""
    split = fa3gen.render(KernelSpec(kind="bwd", **fields))
    keys = fa3gen.render(KernelSpec(kind="bwd", head_dim=128))
    assert "constexpr bool kSplitHeadDim = true;" in split and "constexpr bool kSplitHeadDim = false;" in keys
    for source, has_p in ((split, True), (keys, False)):
        assert ("cosize_v<SmemLayoutDS>> p;" in source) == has_p
        assert ("wgmma_gemm</*kZeroInit=*/false>(mma_dv, tDVrP(_, _, _, buffer)" in source) == has_p
        assert ("wgmma_gemm</*kZeroInit=*/false>(mma_dv, p_operand" in source) == (not has_p)


# ---------------------------------------------------------------------------------------------
# the ABI mirror
# ---------------------------------------------------------------------------------------------

_LAYOUT_PROGRAM = """\
#include <cstddef>
#include <cstdio>
#include "fa3gen/abi.h"
#define FIELD(S, f) std::printf("%s %s %zu %zu\\n", #S, #f, offsetof(S, f), sizeof(((S*)0)->f));
int main() {
  std::printf("version %d\\n", FA3GEN_ABI_VERSION);
  std::printf("limits %d %d %d\\n", FA3GEN_MAX_SCALAR_ARGS, FA3GEN_MAX_TENSOR_ARGS, FA3GEN_MAX_TENSOR_DIMS);
  std::printf("Fa3genFwdParams sizeof %zu %zu\\n", sizeof(Fa3genFwdParams), alignof(Fa3genFwdParams));
  std::printf("Fa3genBwdParams sizeof %zu %zu\\n", sizeof(Fa3genBwdParams), alignof(Fa3genBwdParams));
  std::printf("Fa3genVariantParams sizeof %zu %zu\\n", sizeof(Fa3genVariantParams), alignof(Fa3genVariantParams));
  std::printf("Fa3genDescale sizeof %zu %zu\\n", sizeof(Fa3genDescale), alignof(Fa3genDescale));
%FIELDS%
}
"""


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> str:
    """What a C++ compiler makes of abi.h: offsets and sizes of every field ctypes mirrors."""
    cxx = host_cxx("to compile abi.h")
    fields = [f"  FIELD(Fa3gen{cls.__name__}, {name})" for cls in (abi.FwdParams, abi.BwdParams, abi.VariantParams, abi.Descale)
              for name, _ in cls._fields_]
    tmp = tmp_path_factory.mktemp("abi")
    (tmp / "layout.cpp").write_text(_LAYOUT_PROGRAM.replace("%FIELDS%", "\n".join(fields)))
    subprocess.run([cxx, "-std=c++17", f"-I{REPO / 'templates' / 'include'}", str(tmp / "layout.cpp"),
                    "-o", str(tmp / "layout")], check=True, capture_output=True, text=True)
    return subprocess.run([str(tmp / "layout")], check=True, capture_output=True, text=True).stdout


@pytest.mark.parametrize("cls", [abi.FwdParams, abi.BwdParams, abi.VariantParams, abi.Descale],
                         ids=["fwd", "bwd", "variant", "descale"])
def test_params_struct_matches_the_header(c_layout, cls):
    struct = f"Fa3gen{cls.__name__}"
    c_fields = {}
    for line in c_layout.splitlines():
        parts = line.split()
        if parts[0] == struct and parts[1] == "sizeof":
            assert (int(parts[2]), int(parts[3])) == (ctypes.sizeof(cls), ctypes.alignment(cls))
        elif parts[0] == struct:
            c_fields[parts[1]] = (int(parts[2]), int(parts[3]))
    py_fields = {name: (getattr(cls, name).offset, getattr(cls, name).size) for name, _ in cls._fields_}
    assert py_fields == c_fields


def test_bwd_struct_field_order_is_the_headers():
    """Every field the header declares, in its order (the compile check above can only see the
    names ctypes knows)."""
    header = (REPO / "templates" / "include" / "fa3gen" / "abi.h").read_text()
    body = header[header.index("typedef struct Fa3genBwdParams"):header.index("} Fa3genBwdParams;")]
    body = re.sub(r"//[^\n]*", "", body.split("{", 1)[1])
    declared = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        declarators = re.sub(r"^(const\s+)?\w+\s*\*?", "", decl)  # drop the type: "a, b, c" or "q"
        declared += [name.strip() for name in declarators.split(",")]
    assert declared == [name for name, _ in abi.BwdParams._fields_]


def test_abi_constants_match_the_header(c_layout):
    lines = dict(line.split(" ", 1) for line in c_layout.splitlines() if line.split()[0] in ("version", "limits"))
    assert int(lines["version"]) == abi.ABI_VERSION == 7
    assert tuple(map(int, lines["limits"].split())) == (abi.MAX_SCALAR_ARGS, abi.MAX_TENSOR_ARGS,
                                                        abi.MAX_TENSOR_DIMS)


def test_bind_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        abi.bind(types.SimpleNamespace(), "both")


# ---------------------------------------------------------------------------------------------
# loading a backward library (the mini template: seconds per nvcc)
# ---------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("cache_dir", "mini_templates")
def test_compiled_bwd_kernel_speaks_the_bwd_abi():
    kernel = fa3gen.compile(KernelSpec(kind="bwd", head_dim=64, causal=True))
    assert kernel.kind == "bwd" and kernel.spec.kind == "bwd"
    p = abi.BwdParams()
    p.seqlen_q, p.nheads_q = 3, 5
    assert kernel.bwd_workspace_bytes(p) == (3 << 33) + 256 * 5  # int64 all the way
    kernel.bwd(p, 0)  # the mini library returns cudaSuccess without touching the GPU
    p.batch = -1
    with pytest.raises(RuntimeError, match=rf"{kernel.spec.name} failed: CUDA error 98"):
        kernel.bwd(p, 0)
    # the library exports the backward pair only
    lib = ctypes.CDLL(str(kernel.library_path))
    assert hasattr(lib, "fa3gen_bwd") and not hasattr(lib, "fa3gen_fwd")
    assert not hasattr(lib, "fa3gen_fwd_workspace_bytes")
    # the forward API on a backward kernel is a clear error, and the reverse
    q = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"is a bwd kernel; kernel\(q, k, v\) .* needs a fwd kernel"):
        kernel(q, q, q)
    with pytest.raises(TypeError, match=r"bwd_workspace_bytes\(params\)"):
        kernel.workspace_bytes
    with pytest.raises(TypeError, match="needs a fwd kernel"):
        kernel.fwd(abi.FwdParams(), 0)
    dout, q, k, v, out, lse = bwd_inputs(d=64)
    with pytest.raises(ValueError, match="dout is on cpu"):  # kernel.backward validates like the op
        kernel.backward(dout, q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"kernel bwd_d64_bf16_causal_\S+ takes bf16 with head_dim 64 and head_dim_v 64; got fp16"):
        kernel.backward(*(t.half() if t.dtype == torch.bfloat16 else t for t in (dout, q, k, v, out, lse)))
    fwd_kernel = fa3gen.compile(KernelSpec(head_dim=64, causal=True))
    assert fwd_kernel.kind == "fwd" and fwd_kernel.workspace_bytes == 0
    for call in (lambda: fwd_kernel.bwd(p, 0), lambda: fwd_kernel.bwd_workspace_bytes(p),
                 lambda: fwd_kernel.backward(q, q, q, q, q, q)):
        with pytest.raises(TypeError, match="is a fwd kernel; .* needs a bwd kernel"):
            call()


@pytest.mark.usefixtures("cache_dir")
def test_library_without_the_bwd_symbols_is_rejected(tmp_path, monkeypatch):
    """A backward spec rendered into a library that exports the forward pair does not load."""
    monkeypatch.setenv("FA3GEN_TEMPLATES_DIR", str(write_templates(tmp_path / "t", MINI_TEMPLATE, MINI_TEMPLATE)))
    with pytest.raises(RuntimeError, match=r"does not export the bwd ABI .*fa3gen_bwd"):
        fa3gen.compile(KernelSpec(kind="bwd", head_dim=128))


# ---------------------------------------------------------------------------------------------
# validation of the backward op
# ---------------------------------------------------------------------------------------------

def _bad(**changes):
    dout, q, k, v, out, lse = bwd_inputs()
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    args.update({name: fn(args) for name, fn in changes.items()})
    return args


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_bad(dout=lambda a: a["dout"][:, :4]), ValueError,
         r"dout must have shape \(batch, seqlen_q, nheads_q, head_dim_v\) = \(2, 5, 4, 64\), got \(2, 4, 4, 64\)"),
        (_bad(out=lambda a: a["out"][:, :, :2]), ValueError, r"out must have shape .* got \(2, 5, 2, 64\)"),
        (_bad(dout=lambda a: a["dout"].half()), TypeError, r"dout must have q's dtype torch.bfloat16"),
        (_bad(dout=lambda a: a["dout"].float()), TypeError, r"dout has dtype torch.float32"),
        (_bad(out=lambda a: a["out"][0]), ValueError, r"out must have 4 dims"),
        (_bad(dout=lambda a: [1.0]), TypeError, r"dout must be a torch.Tensor"),
        (_bad(dout=lambda a: torch.randn(2, 5, 4, 68, dtype=torch.bfloat16)[..., :64]), ValueError,
         r"dout's head stride 68 is not a multiple of 8"),
        (_bad(dout=lambda a: torch.randn(1, 1, 1, 64, dtype=torch.bfloat16).expand(2, 5, 4, 64)), ValueError,
         r"dout has a broadcast \(stride 0\) batch dim"),
        (_bad(out=lambda a: a["out"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
         r"out must be contiguous in its last dim"),
        (_bad(lse=lambda a: a["lse"].half()), TypeError, r"lse must be float32"),
        (_bad(lse=lambda a: a["lse"].transpose(1, 2).contiguous()), ValueError,
         r"lse must have shape \(batch, nheads_q, seqlen_q\) = \(2, 4, 5\), got \(2, 5, 4\)"),
        (_bad(lse=lambda a: a["lse"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         r"lse must be contiguous"),
        (_bad(lse=lambda a: None), TypeError, r"lse must be a torch.Tensor"),
        (_bad(k=lambda a: a["k"][:, :, :1].expand(2, 7, 3, 64)), ValueError, r"same number of heads"),
        (_bad(q=lambda a: a["q"].half()), TypeError, r"q, k, v must share one dtype"),
        (_bad(), ValueError, r"dout is on cpu; fa3gen kernels run on CUDA"),
    ],
    ids=["dout-shape", "out-shape", "dout-dtype", "dout-fp32", "out-rank", "dout-type", "dout-stride",
         "dout-broadcast", "out-last-dim", "lse-dtype", "lse-shape", "lse-strides", "lse-none", "kv-heads",
         "q-dtype", "cpu"],
)
def test_bwd_op_validates(args, error, match):
    call = (args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], 0.1, False, False)
    # the op's schema turns away non-tensors itself; its implementation gets the rest
    impl = torch.ops.fa3gen.bwd if all(isinstance(a, torch.Tensor) for a in call[:6]) else ops._backward_impl
    with pytest.raises(error, match=match):
        impl(*call)


@pytest.mark.parametrize("d", [192, 256])
def test_bwd_wide_head_dims_pass_the_checks(d):
    dout, q, k, v, out, lse = bwd_inputs(d=d, device="meta")
    ops._check_bwd_meta(dout, q, k, v, out, lse)
    with FakeTensorMode():
        dout, q, k, v, out, lse = bwd_inputs(d=d, device="cuda")
        dq, dk, dv = torch.ops.fa3gen.bwd(dout, q, k, v, out, lse, 0.1, False, False)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_bwd_devices_must_match_on_fake_cuda():
    with FakeTensorMode():
        dout, q, k, v, out, lse = bwd_inputs(device="cuda:0")
        with pytest.raises(ValueError, match=r"must be on the same device, got dout cuda:0, .* lse cuda:1"):
            ops._check_devices((("dout", dout), ("q", q), ("lse", lse.to("cuda:1"))))


def test_bwd_fake_impl_shapes():
    with FakeTensorMode():
        for dtype in (torch.float16, torch.bfloat16):
            dout, q, k, v, out, lse = bwd_inputs(b=3, sq=17, sk=113, hq=8, hkv=2, d=128, dtype=dtype, device="cuda")
            dq, dk, dv = torch.ops.fa3gen.bwd(dout, q, k, v, out, lse, 0.1, True, True)
            for g, like in ((dq, q), (dk, k), (dv, v)):
                assert g.shape == like.shape and g.dtype == dtype and g.device.type == "cuda"
                assert g.is_contiguous()
        with pytest.raises(ValueError, match="lse must have shape"):
            torch.ops.fa3gen.bwd(dout, q, k, v, out, torch.empty(3, 8, 3, device="cuda"), 0.1, True, False)


def test_autograd_on_meta_tensors():
    """The autograd formula runs (through the bwd op's fake impl) without a GPU."""
    q, k, v = qkv(b=2, sq=33, sk=65, hq=4, hkv=2, d=128, device="meta", requires_grad=True)
    out, lse = ops.flash_attn_func(q, k, v, causal=True, return_lse=True, deterministic=True)
    assert out.requires_grad and out.grad_fn is not None
    dq, dk, dv = torch.autograd.grad((out * 2).sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.device.type == "meta" and dq.dtype == q.dtype


# ---------------------------------------------------------------------------------------------
# the op's implementation: empty problems, kernel selection, params
# ---------------------------------------------------------------------------------------------

def test_empty_problems_launch_nothing(monkeypatch):
    monkeypatch.setattr(ops, "_check_devices", lambda named: None)
    monkeypatch.setattr(ops, "_launch_bwd", lambda *a: pytest.fail("empty problems must not launch"))
    for b, sq, sk, hq, hkv in [(0, 5, 7, 4, 2), (2, 0, 7, 4, 2), (2, 5, 7, 0, 2), (2, 5, 0, 4, 2)]:
        dout, q, k, v, out, lse = bwd_inputs(b=b, sq=sq, sk=sk, hq=hq, hkv=hkv)
        dq, dk, dv = ops._backward_impl(dout, q, k, v, out, lse, 0.1, True, False)
        for g, like in ((dq, q), (dk, k), (dv, v)):
            assert g.shape == like.shape and g.dtype == like.dtype and (g == 0).all()


class _BwdRecorder:
    def __init__(self, workspace_bytes=1000):
        self.specs, self.launches, self.asked = [], [], []
        self.workspace_bytes = workspace_bytes

    def compile(self, spec):
        self.specs.append(spec)
        rec = self

        class K:
            def bwd_workspace_bytes(self, params):
                rec.asked.append((params.batch, params.seqlen_q, params.workspace))
                return rec.workspace_bytes

            def bwd(self, params, stream):
                rec.launches.append((params, stream))

        return K()


@pytest.fixture
def recorder(monkeypatch):
    """fa3gen.compile and the registry swapped for recorders; CPU tensors pass as "the current device"."""
    import sys

    rec = _BwdRecorder()
    fake_registry = types.SimpleNamespace(default_bwd_spec=lambda *key: ("bwd spec",) + key)
    monkeypatch.setitem(sys.modules, "fa3gen.registry", fake_registry)
    monkeypatch.setattr(fa3gen, "registry", fake_registry, raising=False)
    monkeypatch.setattr(fa3gen, "compile", rec.compile, raising=False)
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(ops, "_WORKSPACE_ALIGN_BYTES", 16)  # CPU allocations are only 64-byte aligned
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=4321))
    return rec


def test_bwd_kernel_selection_memo_and_params(recorder):
    packed = torch.randn(2, 9, 3, 4, 64, dtype=torch.bfloat16)  # packed qkv views: strided inputs
    q, k, v = packed[:, :, 0], packed[:, :, 1, :2], packed[:, :, 2, :2]
    out, dout = (torch.randn(2, 9, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(2, 4, 9)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty(2, 9, 2, 64, dtype=torch.bfloat16)
    for deterministic in (True, True, False):
        ops._launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.3, True, deterministic)
    assert recorder.specs == [("bwd spec", 64, 64, "bf16", True, True, False, False, False),
                              ("bwd spec", 64, 64, "bf16", True, False, False, False, False)]
    p, stream = recorder.launches[-1]
    assert stream == 4321
    assert (p.q, p.k, p.v, p.o, p.dout, p.lse) == tuple(t.data_ptr() for t in (q, k, v, out, dout, lse))
    assert (p.dq, p.dk, p.dv) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (9 * 3 * 4 * 64, 3 * 4 * 64, 64)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == q.stride()[:3]
    assert (p.v_batch_stride, p.v_row_stride, p.v_head_stride) == q.stride()[:3]
    for name, t in (("o", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert tuple(getattr(p, f"{name}_{s}_stride") for s in ("batch", "row", "head")) == t.stride()[:3], name
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv) == (2, 9, 9, 4, 2)
    assert p.softmax_scale == pytest.approx(0.3)
    assert p.workspace  # the scratch it asked for, sized from the problem (asked before it is set)
    assert recorder.asked[-1] == (2, 9, None)


def test_bwd_launch_takes_the_variant_values(recorder):
    """The variant's kernel is asked for, and its values reach the launch's params (causal caps
    the window's right side at the diagonal, as in the forward)."""
    dout, q, k, v, out, lse = bwd_inputs()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    slopes = torch.rand(q.shape[2])
    variant = VariantArgs((5, 3), 7.5, slopes)
    ops._launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.3, True, False, variant=variant)
    assert recorder.specs[-1][-3:] == (True, True, True)
    recorder.specs.clear()
    spec = KernelSpec(kind="bwd", head_dim=q.shape[-1], causal=True, window=True, softcap=True, alibi=True)
    kernel = types.SimpleNamespace(spec=spec, bwd_workspace_bytes=lambda p: 0, bwd=lambda p, s: launched.append(p))
    launched = []
    ops._launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.3, True, False, kernel, variant)
    (p,) = launched
    assert (p.variant.window_left, p.variant.window_right) == (5, 0)
    assert p.variant.softcap == pytest.approx(7.5) and p.variant.alibi_slopes == slopes.data_ptr()
    with pytest.raises(ValueError, match="needs softcap"):  # the spec compiles softcap in: a value is required
        ops._launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, 0.3, True, False, kernel,
                        VariantArgs((5, 3), 0.0, slopes))
    assert not recorder.specs


def test_bwd_workspace_alignment_is_checked(recorder, monkeypatch):
    monkeypatch.setattr(ops, "_WORKSPACE_ALIGN_BYTES", 1 << 40)
    dout, q, k, v, out, lse = bwd_inputs()
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    with pytest.raises(RuntimeError, match=r"backward workspace at 0x[0-9a-f]+ is not \d+-byte aligned"):
        ops._launch_bwd(dout, q, k, v, out, lse, *grads, 0.1, False)
    assert not recorder.launches
    recorder.workspace_bytes = 0  # no scratch: none allocated, NULL passed
    ops._launch_bwd(dout, q, k, v, out, lse, *grads, 0.1, False)
    assert recorder.launches[-1][0].workspace is None


def test_run_bwd_kernel_checks_the_spec():
    from fa3gen.ops import run_bwd_kernel

    class Fake:
        def __init__(self, spec):
            self.spec = spec

    args = bwd_inputs(d=128)
    with pytest.raises(TypeError, match="is a fwd kernel; run_bwd_kernel needs kind='bwd'"):
        run_bwd_kernel(Fake(KernelSpec(head_dim=128)), *args)
    with pytest.raises(ValueError, match=r"takes fp16 with head_dim 128 and head_dim_v 128; got bf16 with head_dim 128"):
        run_bwd_kernel(Fake(KernelSpec(kind="bwd", head_dim=128, dtype="fp16")), *args)
    with pytest.raises(ValueError, match="fa3gen kernels run on CUDA"):  # right spec, CPU tensors
        run_bwd_kernel(Fake(KernelSpec(kind="bwd", head_dim=128)), *args)


# ---------------------------------------------------------------------------------------------
# autograd, with the ops routed to the float64 reference on CPU
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def cpu_ops(monkeypatch):
    """Both implementations routed to the reference (validation kept); records the backward calls."""
    calls = []

    def forward(q, k, v, softmax_scale, causal, kernel=None, variant=ops.NO_VARIANT, meta_checked=False, plan_key=None):
        ops._check_meta(q, k, v)
        out, lse = attention_reference(q, k, v, softmax_scale, causal, window_size=variant.window_size,
                                       softcap=variant.softcap, alibi_slopes=variant.alibi_slopes)
        return out.to(q.dtype), lse.to(torch.float32)

    def backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False, kernel=None,
                 meta_checked=False, variant=ops.NO_VARIANT):
        ops._check_bwd_meta(dout, q, k, v, out, lse)  # the layout the kernel would get
        calls.append(dict(scale=softmax_scale, causal=causal, deterministic=deterministic, dout=dout,
                          saved=(q, k, v, out, lse), variant=variant))
        grads = attention_reference_grads(q, k, v, dout, softmax_scale, causal, window_size=variant.window_size,
                                          softcap=variant.softcap, alibi_slopes=variant.alibi_slopes)
        return tuple(g.to(q.dtype) for g in grads)

    monkeypatch.setattr(ops, "_forward_impl", forward)
    monkeypatch.setattr(ops, "_backward_impl", backward)
    return calls


def _expected_grads(q, k, v, dout, scale, causal):
    return tuple(g.to(q.dtype) for g in attention_reference_grads(q.detach(), k.detach(), v.detach(), dout,
                                                                  scale, causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, hq, hkv", [(5, 7, 4, 2), (9, 3, 6, 2), (4, 4, 4, 1)])
def test_autograd_matches_the_reference(cpu_ops, causal, sq, sk, hq, hkv):
    q, k, v = qkv(sq=sq, sk=sk, hq=hq, hkv=hkv, requires_grad=True)
    out, lse = ops.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, return_lse=True, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = cpu_ops
    assert (call["scale"], call["causal"], call["deterministic"]) == (0.3, causal, True)
    assert torch.equal(call["dout"], dout)
    saved_q, saved_k, saved_v, saved_out, saved_lse = call["saved"]
    assert torch.equal(saved_q, q) and torch.equal(saved_out, out) and torch.equal(saved_lse, lse)
    for got, want in zip((q.grad, k.grad, v.grad), _expected_grads(q, k, v, dout, 0.3, causal)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_autograd_default_scale_and_flag(cpu_ops):
    q, k, v = qkv(d=128, requires_grad=True)
    ops.flash_attn_func(q, k, v).float().sum().backward()
    assert (cpu_ops[-1]["scale"], cpu_ops[-1]["causal"], cpu_ops[-1]["deterministic"]) == (1 / math.sqrt(128),
                                                                                           False, False)


@pytest.mark.parametrize("loss", ["sum", "expanded_weight", "strided_view"])
def test_autograd_output_gradient_in_any_layout(cpu_ops, loss):
    """Autograd's dout (an expanded scalar for out.sum(), an expanded weight, a strided view) is
    copied to a layout the kernel takes; the gradients are those of that dout."""
    q, k, v = qkv(sq=6, sk=9, hq=4, hkv=2, requires_grad=True)
    out = ops.flash_attn_func(q, k, v, causal=True)
    if loss == "sum":
        out.sum().backward()
        dout = torch.ones_like(out)
    elif loss == "expanded_weight":
        w = torch.randn(1, 1, 4, 64, dtype=out.dtype)
        (out * w.expand_as(out)).sum().backward()
        dout = w.expand_as(out)
    else:  # out feeds a concatenation: its gradient is a strided slice of a wider one
        wide = torch.cat([torch.zeros(2, 6, 4, 4, dtype=out.dtype), out], dim=-1)
        w = torch.randn_like(wide)
        (wide * w).sum().backward()
        dout = w[..., 4:]
    given = cpu_ops[-1]["dout"]
    assert ops._layout_problem("dout", given) is None and given.storage_offset() % 8 == 0
    assert torch.equal(given, dout)
    for got, want in zip((q.grad, k.grad, v.grad), _expected_grads(q, k, v, dout, 1 / 8, True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_contiguous_output_gradient_is_not_copied(cpu_ops):
    q, k, v = qkv(requires_grad=True)
    out = ops.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert cpu_ops[-1]["dout"].data_ptr() == dout.data_ptr()


def test_only_some_inputs_require_grad(cpu_ops):
    q, k, v = qkv()
    k.requires_grad_()
    out = ops.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    (dk,) = torch.autograd.grad(out, (k,), dout)
    torch.testing.assert_close(dk, _expected_grads(q, k, v, dout, 1 / 8, True)[1], rtol=0, atol=0)
    assert q.grad is None and v.grad is None


@pytest.mark.parametrize("variant", [dict(window_size=(3, 0)), dict(window_size=(-1, 2)), dict(softcap=5.0),
                                     dict(alibi_slopes="slopes")], ids=["window", "window-right", "softcap", "alibi"])
def test_variants_reach_the_backward(cpu_ops, variant):
    """The forward's variant values go to the backward op unchanged; the slopes get no gradient."""
    q, k, v = qkv(requires_grad=True)
    if variant.get("alibi_slopes") == "slopes":
        variant = dict(alibi_slopes=torch.rand(4, requires_grad=True))
    out = ops.flash_attn_func(q, k, v, causal=True, **variant)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = cpu_ops
    got = call["variant"]
    assert tuple(got.window_size) == tuple(variant.get("window_size", (-1, -1)))
    assert got.softcap == variant.get("softcap", 0.0)
    assert got.alibi_slopes is variant.get("alibi_slopes")
    if "alibi_slopes" in variant:
        assert variant["alibi_slopes"].grad is None
    want = attention_reference_grads(q.detach(), k.detach(), v.detach(), dout, 1 / 8, True, **variant)
    for g, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(g, w.to(q.dtype), rtol=0, atol=0)


def test_lse_gradient_is_refused(cpu_ops):
    q, k, v = qkv(requires_grad=True)
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match="gradients flowing into lse are not supported"):
        (out.float().sum() + lse.sum()).backward()
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match="lse"):
        lse.sum().backward()
    # lse returned but unused, or used with a zero gradient: fine
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    (out.float().sum() + 0 * lse.sum()).backward()
    out, lse = ops.flash_attn_func(q, k, v, return_lse=True)
    out.float().sum().backward()
    assert len(cpu_ops) == 2


def test_no_grad_mode_and_detached_inputs_skip_autograd(cpu_ops):
    q, k, v = qkv(requires_grad=True)
    with torch.no_grad():
        assert ops.flash_attn_func(q, k, v).grad_fn is None
    assert ops.flash_attn_func(q.detach(), k.detach(), v.detach()).grad_fn is None


def test_torch_compile_forward_and_backward(cpu_ops):
    q, k, v = qkv(sq=6, sk=11, hq=4, hkv=1, requires_grad=True)
    w = torch.randn(1, 6, 4, 64)

    def f(q, k, v):
        out = ops.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() * w).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    assert cpu_ops and all(c["deterministic"] for c in cpu_ops)
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=0, atol=0)


def test_opcheck_fwd_with_grad_and_bwd(cpu_ops):
    q, k, v = qkv(sq=9, sk=13, hq=4, hkv=1, requires_grad=True)
    # opcheck's aot_dispatch test backpropagates random gradients into every output, lse included,
    # which the backward refuses (test_lse_gradient_is_refused); test_torch_compile_forward_and_backward
    # covers the compiled backward instead.
    torch.library.opcheck(torch.ops.fa3gen.fwd.default, (q, k, v, 0.2, True, -1, -1, 0.0, None, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    dout, q, k, v, out, lse = bwd_inputs(sq=9, sk=13, hq=4, hkv=1)
    torch.library.opcheck(torch.ops.fa3gen.bwd.default, (dout, q, k, v, out, lse, 0.2, True, False))


# ---------------------------------------------------------------------------------------------
# the reference gradients
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, hq, hkv", [(5, 5, 2, 2), (3, 8, 4, 2), (8, 3, 4, 1), (1, 9, 2, 1), (6, 1, 2, 2)])
def test_reference_grads_are_autograds(causal, sq, sk, hq, hkv):
    """The closed form equals autograd through attention_reference, and autograd there agrees with
    finite differences (gradcheck, float64): the kernels' gradients are checked against a
    reference whose derivative is itself checked."""
    torch.manual_seed(sq * 10 + sk)
    q = torch.randn(2, sq, hq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, hkv, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, hkv, 4, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, sq, hq, 4, dtype=torch.float64)
    out, _ = attention_reference(q, k, v, 0.37, causal)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = attention_reference_grads(q.detach(), k.detach(), v.detach(), dout, 0.37, causal)
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert torch.isfinite(w).all()
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_reference(q, k, v, 0.37, causal)[0], (q, k, v))


def test_reference_grads_chunking_and_empty(monkeypatch):
    import fa3gen.reference as reference

    q, k, v, dout = (torch.randn(2, 37, 2, 8, dtype=torch.float64) for _ in range(4))
    full = attention_reference_grads(q, k, v, dout, 0.3, True)
    monkeypatch.setattr(reference, "_SCORE_BYTES_BUDGET", 4 * 8 * 2 * 2 * 37 * 5)  # 5 rows per chunk
    torch.testing.assert_close(attention_reference_grads(q, k, v, dout, 0.3, True), full, rtol=1e-12, atol=1e-12)
    empty = attention_reference_grads(q, k[:, :0], v[:, :0], dout, 0.3, True)
    assert empty[0].shape == q.shape and (empty[0] == 0).all() and empty[1].shape == (2, 0, 2, 8)
    # rows that see no key (causal, sq > sk) get dq = 0 and give nothing to dk, dv
    dq, dk, dv = attention_reference_grads(q, k[:, :4], v[:, :4], dout, 0.3, True)
    assert (dq[:, :33] == 0).all() and (dq[:, 34:] != 0).all()
    assert dq[:, 33].abs().max() < 1e-12  # row 33 sees one key: its softmax is constant, dq ~ 0
    dq2, dk2, dv2 = attention_reference_grads(q[:, 33:], k[:, :4], v[:, :4], dout[:, 33:], 0.3, True)
    torch.testing.assert_close((dk, dv), (dk2, dv2), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# bench: the backward mode
# ---------------------------------------------------------------------------------------------

def test_bench_pass_option_and_bwd_flops():
    assert attn_bwd_flops(8, 16, 2048, 2048, 128, False) == 2.5 * attn_fwd_flops(8, 16, 2048, 2048, 128, False)
    assert attn_bwd_flops(8, 16, 2048, 2048, 128, True) == 2.5 * 4 * 8 * 16 * 2048 * 2048 * 128 / 2
    fwd = _parse([])
    assert fwd.passes == ("fwd",) and fwd.hdim == "64,128,256"
    bwd = _parse(["--pass", "bwd"])
    assert bwd.passes == ("bwd",) and bwd.hdim == "64,128,256"
    both = _parse(["--pass", "both", "--hdim", "96"])
    assert both.passes == ("fwd", "bwd") and both.hdim == "96"
    with pytest.raises(SystemExit):
        _parse(["--pass", "sideways"])


def test_bench_bwd_dry_run_on_cpu(monkeypatch, tmp_path, capsys, cpu_ops):
    """The backward bench path on CPU: fa3gen routed to the reference, CUDA events faked."""
    import json

    from fa3gen import bench
    from test_ops_cpu import fake_gpu_for_bench

    built = fake_gpu_for_bench(monkeypatch)
    loaded = []
    monkeypatch.setattr(ops, "_kernel_for", lambda *key: loaded.append(("fwd", *key)))
    monkeypatch.setattr(ops, "_bwd_kernel_for", lambda *key: loaded.append(("bwd", *key)))
    out_json = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--pass", "both", "--hdim", "64,256", "--seqlens", "32", "--total-tokens",
                     "64", "--hidden", "256", "--causal", "on", "--reps", "2", "--warmup", "1", "--no-matmul",
                     "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert sorted((s.kind, s.head_dim) for s in built) == [("bwd", 64), ("bwd", 256), ("fwd", 64), ("fwd", 256)]
    # The forward keys carry the query-length bucket: 32 rows take the short tiles of both head dims.
    assert sorted(loaded, key=str) == [("bwd", 256, 256, "bf16", True), ("bwd", 64, 64, "bf16", True),
                                       ("fwd", 256, 256, "bf16", True, False, False, False, "short"),
                                       ("fwd", 64, 64, "bf16", True, False, False, False, "short")]
    assert "| d64 s32 b2 h4 causal bwd |" in text and "| d64 s32 b2 h4 causal fwd |" in text
    assert "| d256 s32 b2 h1 causal bwd |" in text
    res = json.loads(out_json.read_text())
    assert [(c["head_dim"], c["pass"]) for c in res["cases"]] == [(64, "fwd"), (64, "bwd"), (256, "fwd"),
                                                                  (256, "bwd")]
    bwd_case = res["cases"][1]
    assert bwd_case["flops"] == attn_bwd_flops(2, 4, 32, 32, 64, True)
    assert bwd_case["results"]["fa3gen"]["tflops"] > 0
    assert "flash" in bwd_case["results"] and "check_max_abs_diff" in bwd_case, bwd_case
    assert bwd_case["check_max_abs_diff"] < 0.1  # reference grads vs torch's CPU flash backward
    assert len(cpu_ops) >= 3  # the check plus warm-up and timed calls went through _backward_impl


def test_eager_autograd_skips_the_op_dispatch(cpu_ops):
    """An eager call that needs gradients runs the op's forward and backward through an
    autograd.Function: torch.library's dispatch and autograd wrapper cost ~0.1-0.2 ms of host time
    a call. Meta tensors keep the op (its fake implementation gives their shapes)."""
    q, k, v = qkv(sq=6, sk=9, hq=4, hkv=2, requires_grad=True)
    out = ops.flash_attn_func(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"
    dout = torch.randn_like(out)
    out.backward(dout)
    assert len(cpu_ops) == 1 and torch.equal(cpu_ops[0]["dout"], dout)
    for got, want in zip((q.grad, k.grad, v.grad), _expected_grads(q, k, v, dout, 1 / 8, True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    qm, km, vm = qkv(sq=6, sk=9, hq=4, hkv=2, device="meta", requires_grad=True)
    meta_out = ops.flash_attn_func(qm, km, vm, causal=True)
    assert meta_out.device.type == "meta" and type(meta_out.grad_fn).__name__ != "_EagerAttentionBackward"
