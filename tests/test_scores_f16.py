"""scores_f16 (e4m3 scores in fp16, the softmax on fp16 pairs) and the Q/K range it needs, on the CPU:
spec validation, rendering, the quantization's bound, and the fp8 op's refusal of inputs that
could overflow fp16 scores. tests/test_compile_real.py compiles one with nvcc."""

from __future__ import annotations

import pytest
import torch

import fa3gen
from fa3gen import fp8, fp8_ops, registry
from fa3gen.spec import FP16_MAX, SCORES_F16_QK_MAX, KernelSpec, e4m3_round_down, e4m3_round_up, scores_f16_qk_max

LONG = registry.REGISTRY["fwd_d128_e4m3_long"]  # 192 x 256, scores_f16, exp2_poly_every=4
# The kernel the fp8 op takes for the same problem when Q and K are outside the bound: fp32 scores
# on 192 x 128 (fp32 scores of 256 keys do not fit three warpgroups' registers).
PLAIN = registry.default_fp8_spec(128, 128, "bf16", False, seqlen_q="long", scores_f16_inputs=False)


def with_fields(spec: KernelSpec, **fields) -> KernelSpec:
    return KernelSpec(**{**spec.model_dump(exclude_unset=True), **fields})


def test_scores_f16_spec_and_name():
    assert LONG.scores_f16 and LONG.exp2_poly_every == 4 and (LONG.block_m, LONG.block_n) == (192, 256)
    assert not PLAIN.scores_f16 and not PLAIN.exp2_poly_every and (PLAIN.block_m, PLAIN.block_n) == (192, 128)
    assert with_fields(PLAIN, scores_f16=True).name == PLAIN.name + "_sh"
    assert with_fields(PLAIN, scores_f16=True, exp2_poly_every=8).name == PLAIN.name + "_sh_pe8"
    # Left out of the canonical JSON at their defaults: the other kernels' sources and keys keep.
    assert "scores_f16" not in PLAIN.canonical_json() and "exp2_poly_every" not in PLAIN.canonical_json()
    assert KernelSpec.from_json(LONG.canonical_json()) == LONG


def test_registry_takes_fp16_scores_and_their_fp32_fallbacks():
    f16 = {name for name, s in registry.REGISTRY.items() if s.kind == "fwd" and s.scores_f16}
    buckets = {"fwd_d128_e4m3_short", "fwd_d128_e4m3_long", "fwd_d128_e4m3_causal_short",
               "fwd_d128_e4m3_causal_long", "fwd_d64_e4m3_long", "fwd_d256_e4m3_long", "fwd_d256_e4m3_causal_long"}
    assert f16 == buckets | {name + registry.SPLIT_TWIN_SUFFIX for name in buckets}
    # Each bucket's fp32-score kernel keeps its kind of loop and key blocks the scale blocks hold.
    for (d, causal, bucket), fields in registry.FP8_FP32_SCORE_TILES.items():
        f32 = registry.default_fp8_spec(d, d, "bf16", causal, seqlen_q=bucket, scores_f16_inputs=False)
        assert not f32.scores_f16 and f32.consumer_registers_estimate <= f32.register_split[1]
        assert registry.fp8_bucket_block_n(d, causal, bucket, scores_f16_inputs=False) == f32.block_n
        assert fp8.default_block_rows(d)[1] % f32.block_n == 0


@pytest.mark.parametrize("fields, expected", [
    ({"head_dim": 128, "scores_f16": True}, r"dtype=\"e4m3\""),
    ({"head_dim": 128, "dtype": "e4m3", "scores_f16": True, "lazy_rescale": True}, "lazy_rescale=False"),
    ({"head_dim": 128, "dtype": "e4m3", "scores_f16": True, "row_sums_mma": False}, "row_sums_mma=True"),
    ({"head_dim": 128, "dtype": "e4m3", "exp2_poly_every": 4}, "needs scores_f16=True"),
    ({"head_dim": 128, "dtype": "e4m3", "scores_f16": True, "exp2_poly_every": -1}, "greater than or equal"),
])
def test_scores_f16_rejections(fields, expected):
    with pytest.raises(ValueError, match=expected):
        KernelSpec(**fields)


def test_fp16_scores_take_half_the_registers():
    # Two fp16 scores a register: 192 x 256 tiles fit three consumer warpgroups' 160 registers
    # (S 64 + O 64 + 32) with fp16 scores, and not with fp32 ones (S 128).
    wide = with_fields(LONG, block_n=256, q_buffers=1)
    assert wide.score_registers == 64 and wide.consumer_registers_estimate == 160
    with pytest.raises(ValueError, match=r"~224 registers per thread \(S 128 \+ O 64"):
        with_fields(PLAIN, block_n=256, q_buffers=1)


def test_masks_fp16_scores_in_pairs():
    src = fa3gen.render(with_fields(LONG, causal=True))
    assert "pair = (pair & keep) | (0xfc00fc00u & ~keep);" in src
    assert "s(r, c) = -CUDART_INF_F" not in src
    assert "s(r, c) = -CUDART_INF_F" in fa3gen.render(with_fields(PLAIN, causal=True))


def test_render_scores_f16():
    src = fa3gen.render(LONG)
    assert "ss_op_selector<Element, Element, cutlass::half_t, TileQK>" in src
    assert "/*kHalfScores=*/true, /*kExp2PolyEvery=*/4>" in src
    plain = fa3gen.render(PLAIN)
    assert "ss_op_selector<Element, Element, float, TileQK>" in plain and "kHalfScores" not in plain


def test_the_bound_keeps_every_score_finite_in_fp16():
    assert 128 * SCORES_F16_QK_MAX**2 <= FP16_MAX < 256 * SCORES_F16_QK_MAX**2
    for d in (64, 96, 128, 192, 256):
        bound = scores_f16_qk_max(d)
        assert d * bound**2 <= FP16_MAX and bound == (SCORES_F16_QK_MAX if d <= 192 else 15.0)
        # an e4m3 value: the cast rounds nothing past it
        assert torch.tensor(bound).to(torch.float8_e4m3fn).float().item() == bound


def test_e4m3_rounding_of_bounds():
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[1:]  # positive, finite
    for x in (0.01, 0.3, 3.3, 15.0, 15.4, 15.996, 16.0, 100.5, 447.0, 448.0):
        assert e4m3_round_up(x) == values[values >= x].min().item()
        assert e4m3_round_down(x) == values[values <= x].max().item()
        # a value quantized within x rounds to at most e4m3_round_up(x)
        assert torch.tensor(x).to(torch.float8_e4m3fn).float().item() <= e4m3_round_up(x)


def test_hdim_256_takes_fp16_scores_within_its_bound():
    """At hdim 256 the scores of Q and K within 16 can reach 65536 (past fp16's 65504): a
    scores_f16 kernel there takes inputs within 15 and refuses 16, and 15.996 (sqrt(65504 / 256),
    which the cast may round to 16)."""
    spec = KernelSpec(head_dim=256, dtype="e4m3", lazy_rescale=False, row_sums_mma=True, scores_f16=True)
    q, k, v = (torch.randn(1, 256, 1, 256) for _ in range(3))
    # (Scales left as they come: power-of-two scales keep within 448 / 32 = 14 for any of these.)
    within, at_sqrt, at_16 = (
        fp8.prepare(q, k, v, "block", (128, 128), qk_max_abs=bound, power_of_two_scales=False, fused=False)
        for bound in (scores_f16_qk_max(256), (FP16_MAX / 256) ** 0.5, 16.0))
    assert fp8_ops.scores_fit_f16(within)
    assert not fp8_ops.scores_fit_f16(at_sqrt) and not fp8_ops.scores_fit_f16(at_16)
    kernel = type("K", (), {"spec": spec})()
    assert fp8_ops._checked_kernel(within, "bf16", False, False, kernel) is kernel
    for outside in (at_sqrt, at_16):
        with pytest.raises(ValueError, match=r"quantized to \|x\| <= 15 \(fa3gen.fp8.prepare's qk_max_abs\)"):
            fp8_ops._checked_kernel(outside, "bf16", False, False, kernel)


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("max_abs", [16.0, 5.0, fp8.E4M3_MAX])
def test_quantize_keeps_to_max_abs(power_of_two, max_abs):
    x = torch.randn(2, 300, 3, 64) * torch.linspace(0.1, 30.0, 300)[None, :, None, None]
    q = fp8.quantize_e4m3(x, "block", 128, power_of_two, max_abs)
    assert q.max_abs <= max_abs and float(q.data.float().abs().amax()) <= q.max_abs
    # the largest value of each block reaches at least half the bound (power-of-two scales round up by < 2)
    assert float(q.data.float().abs().amax()) > q.max_abs / 2
    if power_of_two:
        mantissa, _ = torch.frexp(q.scale)
        assert bool((mantissa == 0.5).all())
    back = q.dequantize()
    assert float(((back - x).abs() / x.abs().amax()).amax()) < 2 ** -4  # e4m3's 3 mantissa bits


def test_range_factor_rejects_a_bound_outside_e4m3():
    for bad in (0.0, -1.0, 449.0):
        with pytest.raises(ValueError, match="max_abs"):
            fp8.range_factor(bad, False)


def test_prepare_bounds_q_and_k_not_v():
    q, k, v = (torch.randn(1, 200, 2, 128) for _ in range(3))
    inputs = fp8.prepare(q, k, v, fused=False)
    assert inputs.q.max_abs <= SCORES_F16_QK_MAX and inputs.k.max_abs <= SCORES_F16_QK_MAX
    assert inputs.v.max_abs == fp8.E4M3_MAX
    assert fp8_ops.scores_fit_f16(inputs)
    assert not fp8_ops.scores_fit_f16(fp8.prepare(q, k, v, fused=False, qk_max_abs=fp8.E4M3_MAX))
    # hdim 256: within sqrt(65504 / 256) (256 * 16^2 > 65504), which power-of-two scales keep to 14.
    wide = fp8.prepare(*(torch.randn(1, 200, 2, 256) for _ in range(3)), fused=False)
    assert wide.q.max_abs <= scores_f16_qk_max(256) and wide.k.max_abs <= scores_f16_qk_max(256)
    assert wide.v.max_abs == fp8.E4M3_MAX and fp8_ops.scores_fit_f16(wide)


def test_checked_kernel_refuses_unbounded_inputs_for_a_scores_f16_kernel():
    q, k, v = (torch.randn(1, 200, 2, 128) for _ in range(3))
    kernel = type("K", (), {"spec": LONG})()
    assert fp8_ops._checked_kernel(fp8.prepare(q, k, v, fused=False), "bf16", False, False, kernel) is kernel
    wide = fp8.prepare(q, k, v, fused=False, qk_max_abs=fp8.E4M3_MAX)
    with pytest.raises(ValueError, match=r"scores in fp16.*\|q\| <= 448.*scores_f16=False"):
        fp8_ops._checked_kernel(wide, "bf16", False, False, kernel)
    plain = type("K", (), {"spec": PLAIN})()
    assert fp8_ops._checked_kernel(wide, "bf16", False, False, plain) is plain


def test_default_kernel_has_fp32_scores_for_unbounded_inputs(monkeypatch):
    compiled = []
    monkeypatch.setattr(fa3gen, "compile", lambda spec: compiled.append(spec) or type("K", (), {"spec": spec})())
    monkeypatch.setattr(fa3gen.ops, "_KERNELS", {})
    q, k, v = (torch.randn(1, 2048, 2, 128) for _ in range(3))
    assert fp8_ops._checked_kernel(fp8.prepare(q, k, v, fused=False), "bf16", False, False).spec == LONG
    wide = fp8.prepare(q, k, v, fused=False, qk_max_abs=fp8.E4M3_MAX)
    assert fp8_ops._checked_kernel(wide, "bf16", False, False).spec == PLAIN


def test_hdim_256_takes_fp16_scores(monkeypatch):
    """hdim 256 (registry.FP8_SEQLEN_TILES): the 128 x 192 fp16-score kernel on prepare's default
    inputs (K/V blocks of 384 rows, which 128- and 192-key blocks divide), at every length not
    causal and past 2k queries causal (the lazy fp32-score kernel up to 2k), and the lazy kernel
    for Q and K outside the fp16 bound."""
    monkeypatch.setattr(fa3gen, "compile", lambda spec: type("K", (), {"spec": spec})())
    monkeypatch.setattr(fa3gen.ops, "_KERNELS", {})
    assert fp8.default_block_rows(256) == (128, 384)
    for causal in (False, True):
        name = "fwd_d256_e4m3" + ("_causal" if causal else "")
        long = registry.REGISTRY[name + "_long"]
        assert (long.block_m, long.block_n, long.pingpong, long.scores_f16, long.lazy_rescale, long.exp2_poly_every) \
            == (128, 192, True, True, False, 4)
        assert registry.registry_name(long) == name + "_long"
        for seqlen_q, want in ((512, name if causal else name + "_long"), (2048, name if causal else name + "_long"),
                               (2049, name + "_long")):
            q, k, v = (torch.randn(1, seqlen_q, 2, 256) for _ in range(3))
            assert fp8_ops._checked_kernel(fp8.prepare(q, k, v, fused=False), "bf16", causal, False).spec \
                is registry.REGISTRY[want]
        wide = fp8.prepare(q, k, v, fused=False, qk_max_abs=fp8.E4M3_MAX)
        assert fp8_ops._checked_kernel(wide, "bf16", causal, False).spec is registry.REGISTRY[name]
