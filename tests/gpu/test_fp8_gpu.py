"""The FP8 (e4m3) forward on the GPU against float64.

Two references: the float64 attention of the *dequantized* inputs (what the kernel computes,
up to P's rounding to e4m3 and fp32 accumulation: checks the descaling, the V layout, the P
register mapping, the masks), and the float64 attention of the original inputs for the FA3
paper's accuracy experiment (inputs N(0,1) + N(0,100)·Bernoulli(0.001)). Outputs are
NaN-poisoned; scale blocks get different magnitudes so that a misapplied per-block factor shows.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa3gen
from fa3gen import fp8, fp8_ops
from fa3gen.reference import attention_reference
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_outputs, prebuild

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

# P is rounded to e4m3 (scaled by 256 first) before P·V, and fp8 WGMMAs accumulate with less
# than fp32's precision: measured on the H200, O's relative error vs the dequantized inputs'
# float64 attention is 6-8e-3 and the LSE's 1-3e-2 absolute, growing with the head dim (scores of
# tens: 1.2e-2 at hdim 64, 2.6e-2 at 256). With the row sums on the tensor cores (row_sums_mma,
# the default at hdim 64 and 128) the sums are of P as rounded to e4m3: O's error is unchanged, the
# LSE's 2.2-3.0e-2 at both head dims (2026-12-04). A wrong key order, V layout or descale gives
# errors of order 1.
O_TOLERANCE = 3e-2
LSE_TOLERANCE = 3e-2  # at hdim 128; scaled by sqrt(head_dim / 128)
LSE_TOLERANCE_ROW_SUMS_MMA = 4e-2
SHAPES = [(2, 1000, 1000, 4, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 4, 4), (1, 2049, 2049, 2, 2)]


# Beyond the registry's e4m3 kernels (bf16 out, hdim 64/128/256, causal or not):
SPECS = [fa3gen.registry.default_fp8_spec(128, 128, "fp16", False),
         fa3gen.registry.default_fp8_spec(128, 128, "bf16", True, window=True),
         fa3gen.registry.default_fp8_spec(192, 192, "bf16", False),
         fa3gen.registry.default_fp8_spec(192, 192, "bf16", True)]
# Chained tiles (inter-tile overlap, with the default pingpong): per-tile descales carried over.
INTER_TILE_SPECS = [fa3gen.KernelSpec(head_dim=128, dtype="e4m3", causal=c, inter_tile_overlap=True)
                    for c in (False, True)]
# ... and with per-warpgroup key trimming (192-key blocks: warpgroup 0 skips a tile's last block
# in two of three tiles).
INTER_TILE_SPECS.append(fa3gen.KernelSpec(head_dim=128, dtype="e4m3", causal=True, warpgroup_key_trim=True))
SPECS += INTER_TILE_SPECS
# Lazy rescale: O in one V scale of the tile while the blocks' scales stay within a factor 4 below
# it, P biased by each block's ratio to it.
LAZY_SPECS = [fa3gen.KernelSpec(head_dim=d, dtype="e4m3", causal=c, lazy_rescale=True)
              for d in (128, 256) for c in (False, True)]
SPECS += LAZY_SPECS
# V block scales that are not powers of two: the eager kernels where the default is lazy.
EAGER_FALLBACK_SPECS = [fa3gen.registry.default_fp8_spec(256, 256, "bf16", c, power_of_two_v_scales=False)
                        for c in (False, True)]
SPECS += EAGER_FALLBACK_SPECS
# The window kernels of hdim 192 and 256 (lazy rescale, spec.FP8_LAZY_RESCALE_WITH_WINDOW).
WINDOW_SPECS = [fa3gen.registry.default_fp8_spec(d, d, "bf16", True, window=True) for d in (192, 256)]
SPECS += WINDOW_SPECS
# The row sums added up by the threads in fp32, beside the default's P·1 WGMMAs.
THREAD_SUMS_SPECS = [fa3gen.KernelSpec(**{**fa3gen.registry.default_fp8_spec(d, d, "bf16", False).model_dump(
    exclude_unset=True), "row_sums_mma": False}) for d in (64, 128)]
SPECS += THREAD_SUMS_SPECS
# V as the model holds it, transposed in shared memory by the producer warpgroup.
V_TRANSPOSE_SPECS = [fa3gen.registry.default_fp8_spec(128, 128, "bf16", c, v_transpose_in_kernel=True) for c in (False, True)]
SPECS += V_TRANSPOSE_SPECS
# The registry's e4m3 forward kernels by name (split twins included): what the fp8 op dispatches to.
REGISTRY_FP8 = {name: s for name, s in fa3gen.registry.REGISTRY.items() if s.kind == "fwd" and s.dtype == "e4m3"}
# The registry's e4m3 kernels with their key blocks' factors passed through shared memory by the
# producer (kv_factors_in_smem): the overlapped loops and the serial one.
KV_FACTORS_IN_SMEM_SPECS = [fa3gen.KernelSpec(**{**s.model_dump(exclude_unset=True), "kv_factors_in_smem": True})
                            for s in REGISTRY_FP8.values()]
SPECS += KV_FACTORS_IN_SMEM_SPECS


@pytest.fixture(scope="module", autouse=True)
def _prebuilt_kernels():
    """Build (or load) this module's kernels and the registry's e4m3 ones (what the fp8 op
    dispatches to, split twins included) once, in parallel, before the tests: one by one on
    first use they took minutes of a device call."""
    prebuild(SPECS + list(REGISTRY_FP8.values()))


def profiled(b, s, h, d, seed, profile):
    """N(0,1) times a magnitude profile along the sequence (a function of the position in [0, 1])."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, s, h, d, device="cuda", generator=gen)
    return x * profile(torch.linspace(0.0, 1.0, s, device="cuda"))[None, :, None, None]


def ramped(b, s, h, d, seed):
    """N(0,1) with a magnitude ramp along the sequence (x1 to x3): scale blocks differ."""
    return profiled(b, s, h, d, seed, lambda x: 1.0 + 2.0 * x)


def striped(b, s, h, d, seed, rows):
    """N(0,1) at magnitudes 1 and 3 in alternate stripes of `rows` sequence rows: neighbouring
    scale blocks of that many rows get scales a factor 2 or 4 apart (powers of two)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    stripe = 1.0 + 2.0 * (torch.arange(s, device="cuda") // rows % 2)
    return torch.randn(b, s, h, d, device="cuda", generator=gen) * stripe[None, :, None, None]


def run_poisoned(inputs, causal, out_dtype=torch.bfloat16, window=(-1, -1), kernel=None):
    b, sq, hq, _ = inputs.q.data.shape
    dv = inputs.head_dim_v
    variant = VariantArgs(tuple(window))
    kernel = fp8_ops._checked_kernel(inputs, fp8_ops._OUT_DTYPES[out_dtype], causal, variant.window, kernel)
    out = torch.full((b, sq, hq, dv), float("nan"), device="cuda", dtype=out_dtype)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    fp8_ops._launch(inputs, out, lse, 1 / math.sqrt(inputs.q.data.shape[-1]), kernel, variant)
    torch.cuda.synchronize()
    return out, lse


def check(inputs, causal, out_dtype=torch.bfloat16, window=(-1, -1), kernel=None):
    kernel = fp8_ops._checked_kernel(inputs, fp8_ops._OUT_DTYPES[out_dtype], causal, VariantArgs(tuple(window)).window,
                                     kernel)  # the default for these inputs where kernel is None
    out, lse = run_poisoned(inputs, causal, out_dtype, window, kernel)
    spec = kernel.spec
    q, k, v = inputs.dequantized()
    ref, ref_lse = attention_reference(q, k, v, 1 / math.sqrt(q.shape[-1]), causal, window_size=window)
    what = f"q {tuple(q.shape)} k {tuple(k.shape)} causal={causal}"
    lse_tolerance = LSE_TOLERANCE_ROW_SUMS_MMA if spec.row_sums_mma else LSE_TOLERANCE * math.sqrt(q.shape[-1] / 128)
    if spec.scores_f16:  # fp16 holds a score to 2^-11 of itself: the LSE's error grows with the scores
        visible = torch.isfinite(ref_lse)
        lse_tolerance += float(ref_lse[visible].abs().amax()) * 2**-10 if visible.any() else 0.0
    rel, lse_err = check_poisoned_outputs(out, lse, ref, ref_lse, O_TOLERANCE, lse_tolerance, what)
    print(f"{what}: O rel err {rel:.2e}, lse max err {lse_err:.1e}")
    return rel


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_fp8_matches_dequantized_reference(head_dim, causal, granularity):
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = (ramped(b, s, h, head_dim, 10 * i + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        inputs = fp8.prepare(q, k, v, granularity, hadamard=(i % 2 == 0), seed=i)  # scale blocks: one tile
        check(inputs, causal)


@pytest.mark.parametrize("granularity", ["head", "block"])
@pytest.mark.parametrize("spec", V_TRANSPOSE_SPECS, ids=lambda s: s.name)
def test_fp8_v_transposed_in_kernel(spec, granularity):
    """V (batch, seqlen_k, nheads_kv, head_dim_v) transposed in shared memory gives the P·V GEMM the
    bytes the pre-transposed V gives it: outputs bit for bit those of the kernel without the
    transpose, and the dequantized reference's. GQA, ragged (keys past the last group of 32 too),
    sq != sk, many tiles per CTA."""
    same_tiles = fa3gen.compile(fa3gen.registry.default_fp8_spec(128, 128, "bf16", spec.causal))
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES + [(8, 1000, 1000, 16, 4), (3, 300, 2049, 4, 4)]):
        q, k, v = (ramped(b, s, h, 128, 90 + 10 * i + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        natural = fp8.prepare(q, k, v, granularity, hadamard=True, seed=i, kernel_v_layout=False)
        assert fp8_ops._checked_kernel(natural, "bf16", spec.causal, False).spec == spec  # the default for this V
        check(natural, spec.causal)
        out, lse = run_poisoned(natural, spec.causal)
        # against the kernel of the same tiles (past 1k queries the default for the pre-transposed V
        # is another: registry.FP8_SEQLEN_TILES)
        pre_out, pre_lse = run_poisoned(fp8.prepare(q, k, v, granularity, hadamard=True, seed=i), spec.causal,
                                        kernel=same_tiles)
        assert torch.equal(out, pre_out) and torch.equal(lse, pre_lse)


@pytest.mark.parametrize("name", list(REGISTRY_FP8))
def test_fp8_key_block_factors_loaded_a_block_ahead(name):
    """K and V scale blocks of one key block each, K's magnitude alternating every key block and
    V's every two: a factor taken from the neighbouring block, or K's and V's swapped (the kernel
    loads a key block's factors a block ahead, K's in even lanes and V's in odd), is off by 2-4x.
    GQA, ragged, sq != sk."""
    spec = fa3gen.registry.REGISTRY[name]
    kernel = fa3gen.compile(spec)
    d, n = spec.head_dim, spec.block_n
    for i, (b, sq, sk, hq, hkv) in enumerate([(1, 2049, 2049, 2, 2), (2, 700, 1100, 4, 2)]):
        q = ramped(b, sq, hq, d, 100 + 10 * i)
        k = striped(b, sk, hkv, d, 101 + 10 * i, n)
        v = striped(b, sk, hkv, d, 102 + 10 * i, 2 * n)
        check(fp8.prepare(q, k, v, "block", (128, n), hadamard=True, seed=i), spec.causal, kernel=kernel)


@pytest.mark.parametrize("spec", KV_FACTORS_IN_SMEM_SPECS, ids=lambda s: s.name)
def test_fp8_key_block_factors_in_shared_memory(spec):
    """The producer stores each key block's K and V factors beside its K tile (an asynchronous
    store the stage's barrier counts): outputs bit for bit those of the same kernel loading them
    from global memory, on K and V scale blocks of one key block with alternating magnitudes (a
    factor of the stage before, or K's and V's swapped, is off by 2-4x), and the dequantized
    reference's. GQA, ragged, sq != sk, several tiles per CTA."""
    kernel, loads = fa3gen.compile(spec), fa3gen.compile(with_default(spec, "kv_factors_in_smem"))
    assert not loads.spec.kv_factors_in_smem
    d, n = spec.head_dim, spec.block_n
    for i, (b, sq, sk, hq, hkv) in enumerate([(1, 2049, 2049, 2, 2), (2, 700, 1100, 4, 2), (8, 1000, 1000, 16, 4)]):
        q = ramped(b, sq, hq, d, 200 + 10 * i)
        k = striped(b, sk, hkv, d, 201 + 10 * i, n)
        v = striped(b, sk, hkv, d, 202 + 10 * i, 2 * n)
        inputs = fp8.prepare(q, k, v, "block", (128, n), hadamard=True, seed=i)
        check(inputs, spec.causal, kernel=kernel)
        out, lse = run_poisoned(inputs, spec.causal, kernel=kernel)
        ref_out, ref_lse = run_poisoned(inputs, spec.causal, kernel=loads)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("spec", THREAD_SUMS_SPECS, ids=lambda s: s.name)
def test_fp8_row_sums_on_the_tensor_cores(spec):
    """The default kernel sums each key block's P (as rounded to e4m3) with P·1 WGMMAs: its O is
    as close to the dequantized reference as that of the same kernel whose threads add P up in
    fp32 (within 5%), its LSE within LSE_TOLERANCE_ROW_SUMS_MMA; the sums of a block are taken
    afresh (a sum run on across blocks in the fp8 accumulator was 1e-2 to 3e-1 off at 2k-16k keys)."""
    default = fa3gen.compile(fa3gen.registry.default_fp8_spec(spec.head_dim, spec.head_dim, "bf16", False))
    assert default.spec.row_sums_mma and default.spec == with_default(spec, "row_sums_mma")
    threads = fa3gen.compile(spec)
    for i, (b, s, h) in enumerate([(1, 16384, 2), (2, 2049, 4)]):
        q, k, v = (ramped(b, s, h, spec.head_dim, 40 + 10 * i + j) for j in range(3))
        inputs = fp8.prepare(q, k, v, "block", hadamard=True, seed=i)
        rel_tensor_cores = check(inputs, False, kernel=default)
        rel_threads = check(inputs, False, kernel=threads)
        assert rel_tensor_cores <= 1.05 * rel_threads


def with_default(spec, field):
    """spec with `field` back at its default."""
    return fa3gen.KernelSpec(**{k: v for k, v in spec.model_dump(exclude_unset=True).items() if k != field})


@pytest.mark.parametrize("spec", INTER_TILE_SPECS, ids=lambda s: s.name)
def test_fp8_inter_tile_overlap(spec):
    """~8 tiles per CTA chained into each other, per-tile scales of Q, K and V (a magnitude ramp, so
    neighbouring tiles' factors differ), GQA, ragged and sq != sk."""
    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate([(8, 1000, 1000, 16, 4), (2, 1000, 113, 8, 2), (3, 300, 2049, 4, 4)]):
        q, k, v = (ramped(b, s, h, 128, 50 + 10 * i + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        check(fp8.prepare(q, k, v, "block", hadamard=True, seed=i), spec.causal, kernel=kernel)


@pytest.mark.parametrize("granularity", ["head", "block"])
@pytest.mark.parametrize("spec", LAZY_SPECS, ids=lambda s: s.name)
def test_fp8_lazy_rescale(spec, granularity):
    """The lazy rescale's two triggers in mid-tile: V's scale blocks rise and fall along the keys
    with a spike (the unit moves and P's bias changes), and K's magnitude falls along the keys
    (visited last to first, so the rows' max grows). GQA, ragged, sq != sk, chained tiles."""
    kernel = fa3gen.compile(spec)
    waves = lambda x: 1.0 + 2.0 * torch.sin(7.0 * x).abs() + 6.0 * ((x - 0.4).abs() < 0.03)  # noqa: E731
    falling = lambda x: 2.0 - x  # noqa: E731  (scores stay in the range O_TOLERANCE and LSE_TOLERANCE were measured on)
    for i, (b, sq, sk, hq, hkv) in enumerate([(2, 1000, 1000, 4, 2), (1, 300, 2049, 4, 4), (8, 1000, 1000, 16, 4)]):
        q = profiled(b, sq, hq, spec.head_dim, 70 + 10 * i, torch.ones_like)
        k = profiled(b, sk, hkv, spec.head_dim, 71 + 10 * i, falling)
        v = profiled(b, sk, hkv, spec.head_dim, 72 + 10 * i, waves)
        check(fp8.prepare(q, k, v, granularity, hadamard=True, seed=i), spec.causal, kernel=kernel)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_inexact_v_scales_take_the_eager_kernel(causal):
    """V block scales as they come (not powers of two) at hdim 256, where the default kernel is
    lazy: the launcher takes an eager kernel, which matches the reference on those scales (causal
    up to 2k queries the lazy kernel's eager twin; not causal the 128 x 192 fp16-score kernel,
    eager itself)."""
    q, k, v = (ramped(2, 1000, 4, 256, 90 + j) for j in range(3))
    inputs = fp8.prepare(q, k, v, "block", hadamard=True, power_of_two_scales=False)
    assert not inputs.v.exact_ratios_along_sequence
    kernel = fp8_ops._checked_kernel(inputs, "bf16", causal, False)
    assert kernel.spec == (EAGER_FALLBACK_SPECS[1] if causal else fa3gen.registry.REGISTRY["fwd_d256_e4m3_long"])
    assert not kernel.spec.lazy_rescale
    check(inputs, causal)


@pytest.mark.parametrize("seqlen, nheads", [(2048, 4), (8192, 1)])
def test_fp8_default_lazy_kernel_as_accurate_as_eager(seqlen, nheads):
    """The FA3 paper's inputs at hdim 256, whose default kernel rescales lazily: with prepare's
    power-of-two scales its RMSE against float64 attention of the unquantized inputs stays
    within 3% of the eager kernel's and of the float64 emulation of the scheme (measured
    2026-12-02: 7.65e-3 eager, 7.70e-3 lazy at s8k)."""
    q, k, v = fp8.outlier_inputs(1, seqlen, nheads, 256, seed=1, device="cuda")
    inputs = fp8.prepare(q, k, v, "block", hadamard=True)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), None, False)
    # The lazy kernel by name: the dispatch gives these lengths the 128 x 192 fp16-score kernel.
    lazy_out, _ = run_poisoned(inputs, False, kernel=fa3gen.compile(fa3gen.registry.REGISTRY["fwd_d256_e4m3"]))
    eager_out, _ = run_poisoned(inputs, False, kernel=fa3gen.compile(EAGER_FALLBACK_SPECS[0]))
    emulated = fp8.emulate_fp8_attention(q, k, v, granularity="block", block_size=None, use_hadamard=True)
    lazy, eager, scheme = (fp8.rmse(x, ref) for x in (lazy_out, eager_out, emulated))
    print(f"d256 s{seqlen} h{nheads}: RMSE lazy (default) {lazy:.4e}, eager {eager:.4e}, emulated {scheme:.4e}")
    assert fa3gen.registry.default_fp8_spec(256, 256, "bf16", False).lazy_rescale
    assert lazy <= 1.03 * eager and lazy <= 1.03 * scheme


@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, False), (128, True)])
def test_fp8_192_row_tiles_over_smaller_q_blocks(head_dim, causal):
    """hdim 64 and 128 take kernels of 192-row tiles on three consumer warpgroups at these query
    lengths (registry.FP8_SEQLEN_TILES: the serial loop on 256-key blocks with fp16 scores or the
    overlapped one, causal with per-warpgroup key trimming up to 2k / 4k; hdim 128 not causal up
    to 1k 128 x 256 pingpong tiles). On Q scale blocks of 128 rows (prepare's default) and of 64, a
    192-row tile spans two or three of them and each warpgroup folds its own rows' factor: Q's
    magnitude alternates with the blocks, so one factor per tile is off by 2-4x in a third of the
    rows. Scale blocks of 192 keys would split their key blocks: those inputs take the 128 x 192
    pingpong kernel. GQA, ragged, sq != sk."""
    name = f"fwd_d{head_dim}_e4m3" + ("_causal" if causal else "")
    for i, (b, sq, sk, hq, hkv) in enumerate([(1, 2049, 2049, 2, 2), (2, 1100, 300, 4, 2), (1, 1500, 3000, 8, 1),
                                              (2, 500, 700, 4, 2)]):
        tiled = fa3gen.registry.default_fp8_spec(head_dim, head_dim, "bf16", causal, seqlen_q=sq)
        assert fa3gen.registry.registry_name(tiled) and tiled.block_n in (128, 256)
        assert tiled.block_m == 192 or (head_dim, causal, tiled.pingpong) == (128, False, True)
        k, v = (ramped(b, sk, hkv, head_dim, 60 + 10 * i + j) for j in range(2))
        for q_rows in (128, 64):
            q = striped(b, sq, hq, head_dim, 61 + 10 * i, q_rows)
            inputs = fp8.prepare(q, k, v, "block", (q_rows, fp8.default_block_rows(head_dim)[1]), hadamard=True, seed=i)
            # (a problem of a wave or two of tiles takes the kernel's split twin: split_tail)
            assert fp8_ops._checked_kernel(inputs, "bf16", causal, False).spec in (tiled, fa3gen.registry.split_twin(tiled))
            check(inputs, causal)
        split = fp8.prepare(q, k, v, "block", (128, 192), hadamard=True, seed=i)
        whole = fa3gen.registry.REGISTRY[name]
        assert fp8_ops._checked_kernel(split, "bf16", causal, False).spec in (whole, fa3gen.registry.split_twin(whole))
        check(split, causal)


def test_fp8_fp16_output_and_window():
    q, k, v = (ramped(2, 1000, 4, 128, j) for j in range(3))
    inputs = fp8.prepare(q, k, v, "block", (256, 384))  # scale blocks of two tiles (128 x 192)
    check(inputs, False, out_dtype=torch.float16)
    check(inputs, True, window=(256, 0))


@pytest.mark.parametrize("spec", WINDOW_SPECS, ids=lambda s: s.name)
def test_fp8_window_lazy_rescale(spec):
    """hdim 192 and 256 with a sliding window, the default kernels (lazy rescale): key blocks
    outside the band skipped, the band's edge blocks masked; block and per-head scales, GQA; 50
    launches back to back finish (the lazy hdim 256 window kernel hung there twice before the
    pingpong turns ran on across tiles)."""
    d = spec.head_dim
    assert spec.lazy_rescale
    q, k, v = (ramped(2, 1000, h, d, 20 + j) for j, h in enumerate((4, 2, 2)))
    assert fp8_ops._checked_kernel(fp8.prepare(q, k, v), "bf16", True, True).spec == spec
    check(fp8.prepare(q, k, v, "block", hadamard=True), True, window=(300, 0))
    check(fp8.prepare(q, k, v, "head", hadamard=True), True, window=(300, 0))
    q, k, v = (ramped(4, 4096, 2048 // d, d, 30 + j) for j in range(3))
    inputs = fp8.prepare(q, k, v, "block", hadamard=True)
    for _ in range(50):
        fp8_ops.flash_attn_fp8_func(inputs, causal=True, window_size=(1024, 0))
    torch.cuda.synchronize()


def test_fp8_attention_end_to_end_bf16():
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out = fa3gen.fp8_ops.fp8_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    ref, _ = attention_reference(q, k, v, None, True)
    rel = float((out.double() - ref).norm() / ref.norm())
    print(f"fp8_attention (bf16 in/out, causal, b2 s2048 h8 d128): rel err {rel:.2e} vs the unquantized inputs")
    # Against the unquantized inputs the error includes Q/K/V's rounding to e4m3 (measured 4.7e-2).
    assert rel < 8e-2


def paper_rmse(seqlen: int, nheads: int, seed: int, granularity: str, hadamard: bool) -> tuple[float, float]:
    """The FA3 paper's experiment (inputs N(0,1) + N(0,100)·Bernoulli(0.001), hdim 128): RMSE of
    the kernel's O, and of the float64 emulation of the same quantization, against float64
    attention of the unquantized inputs."""
    q, k, v = fp8.outlier_inputs(1, seqlen, nheads, 128, seed=seed, device="cuda")
    inputs = fp8.prepare(q, k, v, granularity, hadamard=hadamard)
    out, _ = run_poisoned(inputs, False)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), None, False)
    emulated = fp8.emulate_fp8_attention(q, k, v, granularity=granularity, block_size=None, use_hadamard=hadamard)
    return fp8.rmse(out, ref), fp8.rmse(emulated, ref)


@pytest.mark.parametrize("seqlen, nheads", [(2048, 4), (8192, 2)])
def test_fp8_accuracy_paper_experiment(seqlen, nheads):
    """Block quantization + Hadamard vs the per-tensor baseline; the kernel adds no error of its
    own beyond the float64 emulation of the same scheme. The FA3 paper's 9.1e-3 holds at 2k; the
    RMSE grows with the sequence (at 8k the emulation itself gives 9.0e-3 to 9.9e-3 over seeds,
    the per-tensor baseline 2.3e-2 to 2.7e-2, the paper's ~2.4e-2): BENCHMARKS.md has the table."""
    baseline, baseline_emulated = paper_rmse(seqlen, nheads, 0, "tensor", hadamard=False)
    blocked, blocked_emulated = paper_rmse(seqlen, nheads, 0, "block", hadamard=True)
    print(f"s{seqlen} h{nheads}: RMSE per-tensor {baseline:.3e} (emulated {baseline_emulated:.3e}), "
          f"per-block + Hadamard {blocked:.3e} (emulated {blocked_emulated:.3e})")
    assert abs(blocked - blocked_emulated) <= 0.03 * blocked_emulated, "the kernel adds error beyond the scheme's"
    assert abs(baseline - baseline_emulated) <= 0.03 * baseline_emulated
    assert blocked * 1.8 < baseline
    if seqlen == 2048:
        assert blocked <= 9.1e-3, f"block quantization + Hadamard RMSE {blocked:.2e} > 9.1e-3 (FA3 paper)"
