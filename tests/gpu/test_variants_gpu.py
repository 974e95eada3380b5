"""Attention variants on the GPU against the float64 reference implementing the same variant.

Built-ins (sliding window, softcap, ALiBi) through ``flash_attn_func`` and through NaN-poisoned
outputs; two custom variants compiled from spec expressions: a T5-style bucketed relative-position
bias (score_mod over two tensor params) and "no attention across documents, within a local window"
(mask_mod over a document-id tensor and an int scalar). Ragged shapes, GQA, sq != sk.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa3gen
from fa3gen.reference import attention_reference
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_launch as check
from gpu_checks import check_poisoned_outputs, poison_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error bounds vs float64: the plain kernels' (2-3e-3 bf16, 3e-4 fp16) with headroom; soft-capping
# uses the hardware tanh (relative error 2^-11), which adds up to cap * 5e-4 to a score.
TOLERANCE = {"bf16": 8e-3, "fp16": 2e-3}
SOFTCAP_TOLERANCE = {"bf16": 1.5e-2, "fp16": 8e-3}
SHAPES = [(2, 1000, 1000, 4, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 4, 4), (2, 2049, 2049, 2, 2)]


def inputs(b, sq, sk, hq, hkv, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


@pytest.mark.parametrize("dt, causal", [("bf16", False), ("bf16", True), ("fp16", False)])
@pytest.mark.parametrize("window", [(256, 0), (100, 50), (-1, 64), (64, -1), (0, 0), (3000, 3000)])
def test_sliding_window(dt, causal, window):
    kernel = fa3gen.compile(window_spec(dt, causal))
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = inputs(b, sq, sk, hq, hkv, 128, DTYPES[dt], seed=i)
        check(q, k, v, causal, kernel, VariantArgs(window), TOLERANCE[dt], window_size=window)


def test_custom_kernel_calls_reuse_their_plan():
    """kernel(q, k, v, window_size=...) of one signature, called again on new inputs, launches from
    the first call's plan (fa3gen.launch) with the window baked in; another window is another
    plan. Every call is checked against float64 in NaN-poisoned outputs of its own."""
    from fa3gen import launch

    kernel = fa3gen.compile(window_spec("bf16", True))
    calls = []
    for i, window in enumerate([(100, 50), (100, 50), (300, 0), (100, 50)]):
        q, k, v = inputs(2, 700, 900, 4, 2, 128, torch.bfloat16, seed=40 + i)
        poison_allocator(((2, 700, 4, 128), torch.bfloat16), ((2, 4, 700), torch.float32))
        calls.append((q, k, v, window, kernel(q, k, v, window_size=window, return_lse=True)))
    key = launch.plan_key(*calls[0][:3], None, True, (100, 50), 0.0, None, kernel, {})
    assert launch.plan_for(key) is not None and launch.plan_for(key).kernel is kernel
    torch.cuda.synchronize()
    for q, k, v, window, (out, lse) in calls:
        ref, ref_lse = attention_reference(q, k, v, None, True, window_size=window)
        check_poisoned_outputs(out, lse, ref, ref_lse, TOLERANCE["bf16"], 1e-3, f"window {window}")


# (head dim, dtype, causal): a spread over the kernels' tile shapes rather than the full product.
SOFTCAP_CASES = [(128, "bf16", False), (128, "bf16", True), (64, "fp16", True), (256, "bf16", False)]
ALIBI_CASES = [(128, "bf16", False), (64, "fp16", False), (256, "bf16", True)]


@pytest.mark.parametrize("head_dim, dt, causal", SOFTCAP_CASES)
def test_softcap(head_dim, dt, causal):
    kernel = fa3gen.compile(fa3gen.default_spec(head_dim, head_dim, dt, causal, softcap=True))  # in SPECS
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES[:3]):
        q, k, v = inputs(b, sq, sk, hq, hkv, head_dim, DTYPES[dt], seed=10 + i)
        q = q * 4  # large scores, so the cap bites
        check(q, k, v, causal, kernel, VariantArgs(softcap=5.0), SOFTCAP_TOLERANCE[dt], lse_tol=5e-3, softcap=5.0)


@pytest.mark.parametrize("head_dim, dt, causal", ALIBI_CASES)
def test_alibi(head_dim, dt, causal):
    kernel = fa3gen.compile(fa3gen.default_spec(head_dim, head_dim, dt, causal, alibi=True))
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES[:3]):
        q, k, v = inputs(b, sq, sk, hq, hkv, head_dim, DTYPES[dt], seed=20 + i)
        slopes = torch.rand(hq, device="cuda", generator=gen) if i % 2 else torch.rand(b, hq, device="cuda", generator=gen)
        check(q, k, v, causal, kernel, VariantArgs(alibi_slopes=slopes), TOLERANCE[dt], alibi_slopes=slopes)


def window_spec(dt: str, causal: bool) -> fa3gen.KernelSpec:
    return fa3gen.default_spec(128, 128, dt, causal, window=True)


# The serial mainloop (no intra-warpgroup overlap) under a window: its key blocks start past 0.
SERIAL_WINDOW_SPEC = fa3gen.KernelSpec(head_dim=128, window=True, causal=True, intra_wg_overlap=False)


@pytest.mark.parametrize("window", [(256, 0), (100, 50), (0, 0)])
def test_sliding_window_serial_mainloop(window):
    kernel = fa3gen.compile(SERIAL_WINDOW_SPEC)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = inputs(b, sq, sk, hq, hkv, 128, torch.bfloat16, seed=20 + i)
        check(q, k, v, True, kernel, VariantArgs(window), TOLERANCE["bf16"], window_size=window)


# Each warpgroup's own right edge under a window: key trimming not causal (the window's right side
# bounds the keys) and causal with pingpong on 64-key blocks (each warpgroup's own last block and
# mask test), the narrow edge block (the first key block's half, where the edge falls in it), and
# four consumer warpgroups (hdim 64, 256 rows) trimmed causal.
WARPGROUP_EDGE_WINDOW_SPECS = [
    fa3gen.KernelSpec(head_dim=128, window=True, block_n=64, warpgroup_key_trim=True),
    fa3gen.KernelSpec(head_dim=128, window=True, causal=True, block_n=64, pingpong=True, warpgroup_key_trim=True),
    fa3gen.KernelSpec(head_dim=128, window=True, narrow_edge_block=True),
    fa3gen.KernelSpec(head_dim=64, window=True, causal=True, block_m=256, block_n=64, warpgroup_key_trim=True),
]


@pytest.mark.parametrize("spec", WARPGROUP_EDGE_WINDOW_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("window", [(256, 0), (100, 50), (-1, 30), (0, 0)])
def test_sliding_window_warpgroup_edges(spec, window):
    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = inputs(b, sq, sk, hq, hkv, spec.head_dim, torch.bfloat16, seed=40 + i)
        check(q, k, v, spec.causal, kernel, VariantArgs(window), TOLERANCE["bf16"], window_size=window)


def t5_spec(dt: str) -> fa3gen.KernelSpec:
    return fa3gen.KernelSpec(
        head_dim=128, dtype=dt,
        score_mod={"expr": "score + bias(h, bucket(q_idx - kv_idx + seqlen_k - 1))", "grad": "1.f"},
        params=[{"kind": "tensor", "name": "bias", "ndim": 2},
                {"kind": "tensor", "name": "bucket", "ndim": 1, "dtype": "int32"}],
    )


def documents_spec(dt: str) -> fa3gen.KernelSpec:
    return fa3gen.KernelSpec(
        head_dim=64, dtype=dt,
        mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx && q_idx - kv_idx < window"},
        params=[{"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"},
                {"kind": "scalar", "name": "window", "dtype": "int32"}],
    )


# Every kernel this module runs, built in parallel before the first test (and listed for prebuilds).
SPECS = (
    [window_spec(dt, causal) for dt, causal in (("bf16", False), ("bf16", True), ("fp16", False))]
    + [fa3gen.default_spec(d, d, dt, causal, softcap=True) for d, dt, causal in SOFTCAP_CASES]
    + [fa3gen.default_spec(d, d, dt, causal, alibi=True) for d, dt, causal in ALIBI_CASES]
    + [fa3gen.default_spec(128, 128, "bf16", True, window=True, softcap=True, alibi=True), t5_spec("bf16"),
       documents_spec("fp16"), SERIAL_WINDOW_SPEC, *WARPGROUP_EDGE_WINDOW_SPECS]
)


@pytest.fixture(scope="module", autouse=True)
def _built():
    fa3gen.build_many(SPECS)


def test_window_softcap_alibi_gqa_compose_in_flash_attn_func():
    q, k, v = inputs(2, 1500, 1500, 8, 2, 128, torch.bfloat16, seed=3)
    slopes = torch.rand(8, device="cuda") / 8
    out, lse = fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(300, -1), softcap=20.0,
                                      alibi_slopes=slopes, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, None, True, window_size=(300, -1), softcap=20.0, alibi_slopes=slopes)
    assert float((out.double() - ref).norm() / ref.norm()) < SOFTCAP_TOLERANCE["bf16"]
    assert float((lse.double() - ref_lse).abs().max()) < 1e-2


def t5_buckets(sq: int, sk: int, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's bidirectional relative-position bucket of (q_idx - kv_idx), for every offset."""
    rel = torch.arange(-(sk - 1), sq, device="cuda")  # q_idx - kv_idx, indexed by q_idx - kv_idx + sk - 1
    half = num_buckets // 2
    bucket = (rel > 0).long() * half
    n = rel.abs()
    exact = half // 2
    large = exact + (torch.log(n.clamp_min(1).float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    bucket += torch.where(n < exact, n, large.clamp_max(half - 1))
    return bucket.int()


@pytest.mark.parametrize("dt", ["bf16"])
def test_custom_score_mod_t5_bias(dt):
    spec = t5_spec(dt)
    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES[:3]):
        q, k, v = inputs(b, sq, sk, hq, hkv, 128, DTYPES[dt], seed=20 + i)
        bias = torch.randn(hq, 32, device="cuda") * 2
        bucket = t5_buckets(sq, sk)
        variant = VariantArgs(params={"bias": bias, "bucket": bucket})
        ref_mod = lambda s, bb, h, qi, kj: s + bias.double()[h, bucket.long()[qi - kj + sk - 1]]  # noqa: E731
        check(q, k, v, False, kernel, variant, TOLERANCE[dt], score_mod=ref_mod)
        out = kernel(q, k, v, bias=bias, bucket=bucket)  # the same through CompiledKernel.__call__
        assert out.shape == q.shape


@pytest.mark.parametrize("dt", ["fp16"])
def test_custom_mask_mod_documents_with_local_window(dt):
    spec = documents_spec(dt)
    kernel = fa3gen.compile(spec)
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, s, h = 2, 5000, 4
    q, k, v = inputs(b, s, s, h, h, 64, DTYPES[dt], seed=30)
    lengths = torch.randint(1, 3000, (b, 8), device="cuda", generator=gen)  # packed documents per row
    doc = (torch.cumsum(lengths, 1).unsqueeze(-1) <= torch.arange(s, device="cuda")).sum(1).int()
    window = 2048
    ids = doc.long()
    ref_mask = lambda bb, hh, qi, kj: (ids[bb, qi] == ids[bb, kj]) & (kj <= qi) & (qi - kj < window)  # noqa: E731
    check(q, k, v, False, kernel, VariantArgs(params={"doc": doc, "window": window}), TOLERANCE[dt], mask_mod=ref_mask)
