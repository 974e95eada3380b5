"""scores_f16 e4m3 kernels (S = Q·Kᵀ in fp16, the softmax on fp16 pairs) on the GPU against float64.

Each kernel runs into NaN-poisoned outputs beside the fp32-score kernel of its problem, on the same
prepared inputs (Q and K quantized within spec.scores_f16_qk_max(head_dim), fa3gen.fp8.prepare's
default): its O must be as close to the float64 attention of the dequantized inputs (within 10% of the fp32 kernel's error;
20% for 256-key blocks, whose error is 8-14% above 128-key blocks' with fp32 scores too: BENCHMARKS.md),
its LSE within the row-sums tolerance plus 2^-10 of the largest |LSE| (test_fp8_gpu.check). Shapes: ragged (the mask path), GQA, sq != sk, scale blocks
of alternating magnitude, and scores at the fp16 bound (Q = K with every entry at its largest).
"""

from __future__ import annotations

import math

import pytest
import torch

import fa3gen
from fa3gen import fp8, fp8_ops
from fa3gen.reference import attention_reference
from fa3gen.spec import SCORES_F16_QK_MAX, scores_f16_qk_max
# The fp8 tests' poisoned launch, reference check (its LSE tolerance grows with the scores for
# scores_f16 kernels: fp16 holds a score to 2^-11 of itself) and scale-varying inputs.
from test_fp8_gpu import check, ramped, run_poisoned
from gpu_checks import prebuild

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

SHAPES = [(2, 1000, 1000, 4, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 4, 4), (1, 2049, 2049, 2, 2),
          (3, 300, 2049, 4, 4)]


# The registry's fp16-score kernels (every bucket of registry.FP8_SEQLEN_TILES with scores_f16:
# 192 x 256 and 128 x 256 pingpong not causal, 192 x 128 and 192 x 256 trimmed causal, hdim 64
# 192 x 256, hdim 256 128 x 192 pingpong causal and not), each beside the fp32-score kernel the fp8
# op takes for the same problem when Q and K are not within the bound (registry.FP8_FP32_SCORE_TILES),
# on K/V scale blocks both kernels' key blocks divide.
_BUCKETS = [(d, causal, bucket) for (d, causal), tiers in fa3gen.registry.FP8_SEQLEN_TILES.items()
            for bucket, _, fields in tiers if fields.get("scores_f16")]
SPECS = [fa3gen.registry.fp8_bucket_spec(d, causal, bucket) for d, causal, bucket in _BUCKETS]
BASE_SPECS = [fa3gen.registry.default_fp8_spec(d, d, "bf16", causal, seqlen_q=bucket, scores_f16_inputs=False)
              for d, causal, bucket in _BUCKETS]
LONG = fa3gen.registry.REGISTRY["fwd_d128_e4m3_long"]
LONG_256 = fa3gen.registry.REGISTRY["fwd_d256_e4m3_long"]
assert len(SPECS) == 7 and LONG in SPECS and LONG_256 in SPECS
assert all(s.scores_f16 and not b.scores_f16 for s, b in zip(SPECS, BASE_SPECS))


@pytest.fixture(scope="module", autouse=True)
def _prebuilt_kernels():
    """Build (or load) each fp16-score kernel and its fp32-score peer once, in parallel."""
    prebuild(SPECS + BASE_SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_scores_f16_as_accurate_as_fp32_scores(spec):
    base = BASE_SPECS[SPECS.index(spec)]
    half, single = fa3gen.compile(spec), fa3gen.compile(base)
    d = spec.head_dim
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = (ramped(b, s, h, d, 10 * i + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        inputs = fp8.prepare(q, k, v, "block", (128, math.lcm(spec.block_n, base.block_n)), hadamard=(i % 2 == 0),
                             seed=i, qk_max_abs=scores_f16_qk_max(d))
        assert inputs.q.max_abs <= 16 and inputs.k.max_abs <= 16
        rel, rel_fp32 = check(inputs, spec.causal, kernel=half), check(inputs, spec.causal, kernel=single)
        print(f"{spec.name}: O rel err {rel:.2e} (fp32 scores {rel_fp32:.2e})")
        assert rel <= (1.2 if spec.block_n > 192 else 1.1) * rel_fp32 + 1e-4


@pytest.mark.parametrize("spec", [LONG], ids=lambda s: s.name)
def test_scores_f16_at_the_bound(spec):
    """Q = K, rows of equal entries: the diagonal's scores are head_dim * max|q|^2, the largest the
    quantization lets through (32k of fp16's 65k here), and dominate their rows (LSEs up to ~70:
    the LSE's error, 8e-2 on the H100, is fp16's 2^-11 of the scores)."""
    half = fa3gen.compile(spec)
    b, s, h, d = 1, 1000, 2, spec.head_dim
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = torch.randn(b, s, h, 1, device="cuda", generator=gen).expand(b, s, h, d).contiguous()
    v = torch.randn(b, s, h, d, device="cuda", generator=gen)
    inputs = fp8.prepare(rows, rows, v, "block", (128, spec.block_n), hadamard=False, power_of_two_scales=False,
                         qk_max_abs=SCORES_F16_QK_MAX)
    largest = float(inputs.q.data.float().abs().amax()) ** 2 * d
    assert largest > 2 ** 14, largest
    print(f"scores up to {largest:.0f}")
    check(inputs, False, kernel=half)


@pytest.mark.parametrize("spec", [LONG, LONG_256], ids=lambda s: s.name)
def test_scores_f16_paper_experiment(spec):
    """The FA3 paper's accuracy experiment (outlier inputs, block quantization + Hadamard) on the
    scores_f16 kernels past 1k (2k) queries: RMSE against float64 attention of the unquantized
    inputs <= 9.1e-3 at 2k, and within 2% of the fp32-score kernel's (prepare's default blocks and
    bound)."""
    q, k, v = fp8.outlier_inputs(1, 2048, 4, spec.head_dim, seed=0, device="cuda")
    inputs = fp8.prepare(q, k, v, "block", hadamard=True)
    assert fp8_ops.scores_fit_f16(inputs)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), None, False)
    half = fp8.rmse(run_poisoned(inputs, False, kernel=fa3gen.compile(spec))[0], ref)
    single = fp8.rmse(run_poisoned(inputs, False, kernel=fa3gen.compile(BASE_SPECS[SPECS.index(spec)]))[0], ref)
    print(f"paper experiment s2048: RMSE scores_f16 {half:.3e}, fp32 scores {single:.3e}")
    assert half <= 9.1e-3 and half <= 1.02 * single


# hdim 256 with fp16 scores on the default 128 x 128 tiles (eager, row sums on the tensor cores; Q
# and K within scores_f16_qk_max(256)), opt-in (a tie with the lazy fp32-score kernel there,
# BENCHMARKS.md; the registry's hdim 256 fp16-score kernels have 192-key blocks), beside that lazy
# kernel on the same inputs. (Run on the H100 2026-12-06 as .dev/s13c3/acc256.py,
# the same checks: O 7.29-7.56e-3 vs 7.32-8.20e-3, causal 6.31-7.73e-3 vs 6.47-7.98e-3; paper
# RMSE s2k 6.653e-3 vs 6.671e-3, s8k 7.930e-3 vs 7.983e-3.)
_HDIM_256_F16 = dict(head_dim=256, dtype="e4m3", lazy_rescale=False, row_sums_mma=True, scores_f16=True)


@pytest.mark.parametrize("causal", [False, True])
def test_scores_f16_hdim_256_as_accurate_as_the_lazy_kernel(causal):
    half = fa3gen.compile(fa3gen.KernelSpec(**_HDIM_256_F16, causal=causal))
    lazy = fa3gen.compile(fa3gen.registry.default_fp8_spec(256, 256, "bf16", causal))
    assert lazy.spec.lazy_rescale and not lazy.spec.scores_f16
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = (ramped(b, s, h, 256, 10 * i + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        inputs = fp8.prepare(q, k, v, "block", (128, 128), hadamard=(i % 2 == 0), seed=i,
                             qk_max_abs=scores_f16_qk_max(256))
        rel, rel_lazy = check(inputs, causal, kernel=half), check(inputs, causal, kernel=lazy)
        print(f"{half.spec.name}: O rel err {rel:.2e} (lazy fp32 scores {rel_lazy:.2e})")
        assert rel <= 1.1 * rel_lazy + 1e-4
    if not causal:
        for s in (2048, 8192):
            q, k, v = fp8.outlier_inputs(1, s, 2, 256, seed=0, device="cuda")
            inputs = fp8.prepare(q, k, v, "block", (128, 128), hadamard=True, qk_max_abs=scores_f16_qk_max(256))
            ref, _ = attention_reference(q.double(), k.double(), v.double(), None, False)
            rmse, rmse_lazy = (fp8.rmse(run_poisoned(inputs, False, kernel=x)[0], ref) for x in (half, lazy))
            print(f"paper experiment s{s}: RMSE {rmse:.3e} (lazy {rmse_lazy:.3e})")
            assert rmse <= 9.1e-3 and rmse <= 1.02 * rmse_lazy


def test_scores_f16_refuses_inputs_of_e4m3_range():
    """Q and K quantized to e4m3's whole range (448) could overflow fp16 scores: the kernel refuses them."""
    spec = LONG
    q, k, v = (torch.randn(1, 256, 2, 128, device="cuda") for _ in range(3))
    inputs = fp8.prepare(q, k, v, qk_max_abs=448.0)  # Q and K to e4m3's whole range
    with pytest.raises(ValueError, match="scores_f16"):
        fp8_ops.flash_attn_fp8_func(inputs, kernel=fa3gen.compile(spec))
