"""FP8 (e4m3): fa3gen.fp8 (block quantization, the random-sign Hadamard, the accuracy emulation, the
kernel's V layout, prepare()), the e4m3 KernelSpec, registry and render, the ABI's Descale, and the
CPU-side checks of fa3gen.fp8_ops. CPU only: the GPU runs are in tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import ctypes
import json
import math
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import fa3gen
from fa3gen import abi, fp8, fp8_ops, ops, registry, render
from fa3gen.reference import attention_reference
from fa3gen.spec import FP8_TILES, SMEM_BUDGET_BYTES, KernelSpec

REPO = Path(__file__).resolve().parent.parent
ABI_H = REPO / "templates" / "include" / "fa3gen" / "abi.h"


@pytest.mark.parametrize("n", [64, 96, 128, 192, 256])
def test_hadamard_is_orthonormal(n):
    m = fp8.hadamard_transform(torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-6, rtol=0)


def test_hadamard_matches_sylvester_matrix():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h8 = torch.kron(torch.kron(h2, h2), h2) / math.sqrt(8)
    x = torch.randn(5, 8)
    torch.testing.assert_close(fp8.hadamard_transform(x), x @ h8.T, atol=1e-6, rtol=1e-6)


def test_hadamard_rejects_odd_dims():
    with pytest.raises(ValueError, match="must be even"):
        fp8.hadamard_transform(torch.randn(3, 7))


@pytest.mark.parametrize("d", [64, 128, 192])
def test_incoherent_keeps_q_dot_k(d):
    q, k = torch.randn(2, 33, 3, d, dtype=torch.float64), torch.randn(2, 17, 3, d, dtype=torch.float64)
    q2, k2 = fp8.incoherent(q, k, seed=5)
    before = torch.einsum("bqhd,bkhd->bhqk", q, k)
    after = torch.einsum("bqhd,bkhd->bhqk", q2, k2)
    torch.testing.assert_close(after, before, atol=1e-9, rtol=1e-9)
    assert not torch.allclose(q2, q)  # it did transform
    assert torch.equal(fp8.random_signs(d, 5), fp8.random_signs(d, 5))


@pytest.mark.parametrize("granularity, scale_shape", [("tensor", ()), ("head", (2, 3)), ("block", (2, 3, 3))])
def test_quantize_shapes_and_error_bound(granularity, scale_shape):
    x = torch.randn(2, 300, 3, 64) * 3
    qx = fp8.quantize_e4m3(x, granularity, block_size=128)
    assert qx.data.dtype == torch.float8_e4m3fn and qx.data.shape == x.shape
    assert tuple(qx.scale.shape) == scale_shape and qx.scale.dtype == torch.float32
    deq = qx.dequantize()
    scale = fp8._expand_scale(qx, x.shape)
    # e4m3: 3 mantissa bits (relative step 2^-3, rounding half of it), subnormal step 2^-9.
    bound = x.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-12
    assert ((deq - x).abs() <= bound).all()
    assert (qx.data.float().abs() <= fp8.E4M3_MAX).all()


def test_block_scales_confine_an_outlier_to_its_block():
    x = torch.randn(1, 512, 2, 64)
    clean = fp8.quantize_e4m3(x, "block", 128).scale
    x[0, 300, 1, 7] = 1000.0  # block 2 of head 1
    spiked = fp8.quantize_e4m3(x, "block", 128).scale
    changed = (spiked != clean)
    assert changed[0, 2, 1] and changed.sum() == 1


def test_zero_block_gets_the_smallest_scale_and_no_nan():
    x = torch.zeros(1, 384, 1, 64)
    x[0, :128] = torch.randn(128, 1, 64)
    x[0, 256:] = 0.01 * torch.randn(128, 1, 64)
    qx = fp8.quantize_e4m3(x, "block", 128)
    # Not 1: a lazy-rescale kernel's O unit moves to a block's V scale above it.
    assert qx.scale[0, 1, 0] == qx.scale[0, 2, 0] < qx.scale[0, 0, 0] < 0.1
    assert torch.isfinite(qx.dequantize()).all() and (qx.dequantize()[0, 128:256] == 0).all()
    assert (fp8.quantize_e4m3(torch.zeros(1, 256, 1, 64), "block", 128).scale == 1.0).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(batch, seqlen, nheads, head_dim\)"):
        fp8.quantize_e4m3(torch.randn(4, 64))
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize_e4m3(torch.randn(1, 4, 1, 64), "row")  # type: ignore[arg-type]


def test_paper_outlier_experiment_emulated():
    """FA3's FP8 accuracy experiment, emulated in float64: block quantization with the Hadamard
    transform must beat per-tensor scaling clearly (paper, H100 kernel: 2.4e-2 -> 9.1e-3)."""
    q, k, v = fp8.outlier_inputs(1, 1024, 2, 128, seed=1)
    ref, _ = attention_reference(q.double(), k.double(), v.double())
    baseline = fp8.rmse(fp8.emulate_fp8_attention(q, k, v, granularity="tensor", use_hadamard=False), ref)
    improved = fp8.rmse(fp8.emulate_fp8_attention(q, k, v, granularity="block", use_hadamard=True), ref)
    assert improved < 0.65 * baseline, (baseline, improved)
    assert improved < 1.0e-2, improved


# =============================================================================================
# e4m3 kernels: spec, registry, render, V layout, ABI, prepare(), fp8_ops input checks
# =============================================================================================

# ---- spec ------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", sorted(FP8_TILES))
def test_e4m3_spec_defaults(d):
    spec = KernelSpec(head_dim=d, dtype="e4m3")
    assert spec.is_fp8 and spec.kind == "fwd"
    assert spec.out_dtype == "bf16"
    bm, bn = FP8_TILES[d]
    assert (spec.block_m, spec.block_n) == (bm, bn) and bm == 128 and bn % 32 == 0
    assert spec.pingpong  # the fp8 default schedule (two consumer warpgroups)
    assert spec.head_dim_v == d and spec.num_consumer_warpgroups == 2
    # Two Q buffers and chained tiles everywhere; at hdim 256 they leave no room for O's staging
    # tile, so O is stored from registers there (FP8_CHAINED_OVER_O_TILE). The causal kernel
    # keeps the tile and one Q buffer.
    assert spec.q_buffers == 2 and spec.inter_tile_overlap
    assert spec.epilogue == ("direct" if d == 256 else "tma")
    causal = KernelSpec(head_dim=d, dtype="e4m3", causal=True)
    assert causal.epilogue == "tma" and causal.q_buffers == (1 if d == 256 else 2)
    # 1 byte per fp8 element of Q, K, V; the O staging tile is 16-bit (2 bytes per element).
    o_tile = bm * d * 2 if spec.epilogue == "tma" else 0
    # with the row sums on the tensor cores (hdim 64 and 128), the (8, block_n) e4m3 tile of ones,
    # 1024-byte aligned
    ones = -(-8 * bn // 1024) * 1024 if spec.row_sums_mma else 0
    assert spec.row_sums_mma == (d <= 128)
    expected = spec.q_buffers * bm * d + spec.stages * bn * 2 * d + o_tile + ones + 1024
    assert spec.smem_bytes == expected <= SMEM_BUDGET_BYTES
    assert f"_d{d}_e4m3_obf16" in spec.name
    # None fills out_dtype: the explicit and the implicit spec are the same kernel.
    assert KernelSpec(head_dim=d, dtype="e4m3", out_dtype="bf16") == spec


def test_e4m3_smem_counts_16_bit_o_tile():
    tma = KernelSpec(head_dim=128, dtype="e4m3", block_n=128, epilogue="tma")
    direct = KernelSpec(head_dim=128, dtype="e4m3", block_n=128, epilogue="direct")
    assert tma.smem_bytes - direct.smem_bytes == 128 * 128 * 2
    # and Q, K, V at one byte: half the bf16 kernel's bytes with the same tiles (without the tile
    # of ones of the e4m3 row sums)
    direct = KernelSpec(head_dim=128, dtype="e4m3", block_n=128, epilogue="direct", row_sums_mma=False)
    bf16 = KernelSpec(head_dim=128, block_m=128, block_n=128, epilogue="direct")
    assert bf16.smem_bytes - 1024 == 2 * (direct.smem_bytes - 1024)


def test_e4m3_fp16_out_allowed():
    spec = KernelSpec(head_dim=128, dtype="e4m3", out_dtype="fp16", causal=True)
    assert spec.out_dtype == "fp16" and spec.is_fp8
    assert "_e4m3_ofp16_causal" in spec.name


def test_16_bit_specs_are_not_fp8():
    assert not KernelSpec(head_dim=128).is_fp8
    assert not KernelSpec(head_dim=128, dtype="fp16").is_fp8
    assert KernelSpec(head_dim=128, dtype="fp16").out_dtype == "fp16"
    assert KernelSpec(head_dim=128).out_dtype == "bf16"
    # the 16-bit tiles are unchanged by the fp8 defaults
    assert (KernelSpec(head_dim=256).block_m, KernelSpec(head_dim=256).block_n) == (128, 80)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"kind": "bwd"}, r"forward-only"),
        ({"softcap": True}, r"not softcap"),
        ({"alibi": True}, r"not alibi"),
        ({"score_mod": {"expr": "score * 2"}}, r"not score_mod"),
        ({"mask_mod": {"expr": "q_idx >= kv_idx"}}, r"not mask_mod"),
        ({"block_n": 80}, r"block_n to be a multiple of 32 .*got 80"),
        ({"block_n": 112}, r"block_n to be a multiple of 32 .*got 112"),
        ({"out_dtype": "e4m3"}, r"out_dtype"),
    ],
    ids=["bwd", "softcap", "alibi", "score_mod", "mask_mod", "block_n80", "block_n112", "out_e4m3"],
)
def test_e4m3_rejections(fields, expected):
    with pytest.raises(ValueError, match=expected) as info:
        KernelSpec(head_dim=128, dtype="e4m3", **fields)
    assert isinstance(info.value, ValidationError)


def test_e4m3_accepts_causal_window_and_multiple_of_32_block_n():
    spec = KernelSpec(head_dim=128, dtype="e4m3", causal=True, window=True, block_n=96)
    assert spec.block_n == 96 and spec.window and spec.causal


@pytest.mark.parametrize(("dtype", "out"), [("bf16", "fp16"), ("fp16", "bf16")])
def test_16_bit_out_dtype_mismatch_rejected(dtype, out):
    with pytest.raises(ValueError, match=rf"out_dtype='{out}' differs from dtype='{dtype}'"):
        KernelSpec(head_dim=128, dtype=dtype, out_dtype=out)
    # the matching out_dtype is the default and the same spec
    assert KernelSpec(head_dim=128, dtype=dtype, out_dtype=dtype) == KernelSpec(head_dim=128, dtype=dtype)


def test_names_and_hashes_distinguish_dtypes():
    bf16 = KernelSpec(head_dim=128, block_m=128, block_n=128)
    e4m3 = KernelSpec(head_dim=128, dtype="e4m3")
    e4m3_fp16 = KernelSpec(head_dim=128, dtype="e4m3", out_dtype="fp16")
    names = {bf16.name, e4m3.name, e4m3_fp16.name}
    assert len(names) == 3
    assert "_bf16_" in bf16.name and "_o" not in bf16.name.split("_m128")[0]  # no out tag for 16-bit
    assert "_obf16" in e4m3.name and "_ofp16" in e4m3_fp16.name
    assert len({bf16.content_hash, e4m3.content_hash, e4m3_fp16.content_hash}) == 3


@pytest.mark.parametrize("fields", [{"dtype": "e4m3"}, {"dtype": "e4m3", "out_dtype": "fp16", "causal": True,
                                                        "window": True}, {"dtype": "bf16"}])
def test_canonical_json_round_trip(fields):
    spec = KernelSpec(head_dim=128, **fields)
    text = spec.canonical_json()
    data = json.loads(text)
    assert data["dtype"] == spec.dtype and data["out_dtype"] == spec.out_dtype
    back = KernelSpec.from_json(text)
    assert back == spec and back.canonical_json() == text and back.content_hash == spec.content_hash
    # JSON written without out_dtype (before the field existed) means the default out_dtype
    del data["out_dtype"]
    default_out = KernelSpec.from_json(json.dumps(data))
    assert default_out.out_dtype == ("bf16" if spec.dtype == "e4m3" else spec.dtype)
    assert (default_out == spec) == (spec.out_dtype == default_out.out_dtype)


# ---- registry --------------------------------------------------------------------------------

FP8_REGISTRY_NAMES = [f"fwd_d{d}_e4m3{c}" for d in (64, 128, 256) for c in ("", "_causal")] + [
    "fwd_d64_e4m3_short", "fwd_d64_e4m3_long", "fwd_d64_e4m3_causal_short", "fwd_d64_e4m3_causal_long",
    "fwd_d128_e4m3_short", "fwd_d128_e4m3_long", "fwd_d128_e4m3_causal_short", "fwd_d128_e4m3_causal_long",
    "fwd_d256_e4m3_long", "fwd_d256_e4m3_causal_long"]
# and their split twins (registry.SPLIT_TWIN_SUFFIX)
FP8_REGISTRY_NAMES += [n + "_split" for n in FP8_REGISTRY_NAMES]


@pytest.mark.parametrize("name", FP8_REGISTRY_NAMES)
def test_registry_has_e4m3_entries(name):
    spec = registry.REGISTRY[name]
    assert spec.kind == "fwd" and spec.dtype == "e4m3" and spec.out_dtype == "bf16"
    assert spec.causal == ("_causal" in name) and not spec.window
    assert name.startswith(f"fwd_d{spec.head_dim}_e4m3")
    assert spec.smem_bytes <= SMEM_BUDGET_BYTES
    assert registry.registry_name(spec) == name and registry.resolve(name) is spec
    base = name.removesuffix(registry.SPLIT_TWIN_SUFFIX)
    bucket = base.rsplit("_", 1)[1] if base.endswith(("_short", "_long")) else None
    default = registry.default_fp8_spec(spec.head_dim, spec.head_dim, "bf16", spec.causal, seqlen_q=bucket)
    assert (registry.split_twin(default) if spec.split_tail else default) is spec


def test_registry_has_exactly_the_e4m3_entries():
    assert sorted(n for n, s in registry.REGISTRY.items() if s.is_fp8) == sorted(FP8_REGISTRY_NAMES)


def test_default_fp8_spec_outside_the_registry():
    reg = registry.REGISTRY["fwd_d128_e4m3"]
    assert registry.default_fp8_spec(128, 128, torch.bfloat16, False) is reg  # torch dtypes are aliases
    win = registry.default_fp8_spec(128, 128, "bf16", False, window=True)
    assert win.window and win.is_fp8 and win.out_dtype == "bf16" and registry.registry_name(win) is None
    fp16 = registry.default_fp8_spec(128, 128, "float16", True)
    assert fp16.out_dtype == "fp16" and fp16.causal and fp16.is_fp8 and registry.registry_name(fp16) is None
    d192 = registry.default_fp8_spec(192, 192, "bf16", False)
    assert d192.head_dim == 192 and d192.is_fp8 and registry.registry_name(d192) is None
    with pytest.raises(ValueError, match="e4m3' supports head dims"):  # no fp8 kernel was run at 96
        registry.default_fp8_spec(96, 96, "bf16", False)


@pytest.mark.parametrize("d", sorted(FP8_TILES))
def test_default_fp8_spec_lazy_only_with_power_of_two_v_scales(d):
    """From head_dim_v 192 the default kernel rescales lazily (the registry's hdim 256 too); V
    scales that are not powers of two get the eager kernel; below 192 both are the eager one."""
    for causal in (False, True):
        default = registry.default_fp8_spec(d, d, "bf16", causal)
        eager = registry.default_fp8_spec(d, d, "bf16", causal, power_of_two_v_scales=False)
        assert default.lazy_rescale == (d >= 192) and not eager.lazy_rescale
        assert (default == eager) == (d < 192)
        assert default.model_copy(update={"lazy_rescale": False}) == eager
    assert registry.REGISTRY["fwd_d256_e4m3"].lazy_rescale and not registry.REGISTRY["fwd_d128_e4m3"].lazy_rescale
    # Window kernels too (spec.FP8_LAZY_RESCALE_WITH_WINDOW), with the same eager fallback.
    for causal in (False, True):
        window = registry.default_fp8_spec(d, d, "bf16", causal, window=True)
        assert window.lazy_rescale == (d >= 192)
        assert not registry.default_fp8_spec(d, d, "bf16", causal, window=True, power_of_two_v_scales=False).lazy_rescale


def _exact_and_inexact_v_inputs(d: int) -> tuple[fp8.Fp8Inputs, fp8.Fp8Inputs, fp8.Fp8Inputs]:
    """Block scales rounded to powers of two (prepare's default), block scales as they come, and
    one scale per (batch, head) as it comes (one ratio along the keys: exact)."""
    q, k, v = _gqa_inputs(d)
    v = v * torch.linspace(1.0, 3.0, v.shape[1])[None, :, None, None]  # the scale blocks differ
    return (fp8.prepare(q, k, v), fp8.prepare(q, k, v, power_of_two_scales=False),
            fp8.prepare(q, k, v, "head", power_of_two_scales=False))


def test_v_ratios_exact_only_for_power_of_two_or_single_scales():
    exact, inexact, per_head = _exact_and_inexact_v_inputs(256)
    assert exact.v.power_of_two and exact.v.exact_ratios_along_sequence
    assert not inexact.v.power_of_two and not inexact.v.exact_ratios_along_sequence
    assert not per_head.v.power_of_two and per_head.v.exact_ratios_along_sequence
    assert fp8.quantize_e4m3(torch.randn(1, 8, 1, 64), "tensor").exact_ratios_along_sequence


def test_checked_kernel_takes_the_eager_kernel_for_inexact_v_ratios(monkeypatch):
    compiled = []
    monkeypatch.setattr(fa3gen, "compile", lambda spec: compiled.append(spec) or type("K", (), {"spec": spec})())
    monkeypatch.setattr(ops, "_KERNELS", {})
    exact, inexact, per_head = _exact_and_inexact_v_inputs(256)
    # hdim 256 causal up to 2k queries is the lazy kernel (not causal it is the eager 128 x 192 one).
    assert fp8_ops._checked_kernel(exact, "bf16", True, False).spec is registry.REGISTRY["fwd_d256_e4m3_causal"]
    assert not fp8_ops._checked_kernel(inexact, "bf16", True, False).spec.lazy_rescale
    assert fp8_ops._checked_kernel(per_head, "bf16", True, False).spec is registry.REGISTRY["fwd_d256_e4m3_causal"]
    assert fp8_ops._checked_kernel(exact, "bf16", False, False).spec is registry.REGISTRY["fwd_d256_e4m3_long"]
    assert len(compiled) == 3


def test_inexact_v_ratios_take_the_eager_fp16_score_buckets(monkeypatch):
    """A bucket whose tiles already rescale eagerly (hdim 256's 128 x 192 fp16-score kernels) takes
    V block scales that are not powers of two as they are: the same registry kernel (default_fp8_spec
    once passed lazy_rescale twice there and raised)."""
    monkeypatch.setattr(fa3gen, "compile", lambda spec: type("K", (), {"spec": spec})())
    monkeypatch.setattr(ops, "_KERNELS", {})
    for causal, seqlen in ((False, 300), (False, 2049), (True, 2049)):
        q, k, v = (torch.randn(1, seqlen, 2, 256) for _ in range(3))
        v = v * torch.linspace(1.0, 3.0, seqlen)[None, :, None, None]
        inexact = fp8.prepare(q, k, v, power_of_two_scales=False, fused=False)
        assert not inexact.v.exact_ratios_along_sequence
        want = registry.REGISTRY["fwd_d256_e4m3" + ("_causal" if causal else "") + "_long"]
        assert fp8_ops._checked_kernel(inexact, "bf16", causal, False).spec is want


def test_inexact_v_ratios_share_the_kernel_where_the_default_is_eager(monkeypatch):
    """hdim 128 rescales eagerly by default: scales as they come take the same kernel as
    power-of-two ones, compiled once."""
    compiled = []
    monkeypatch.setattr(fa3gen, "compile", lambda spec: compiled.append(spec) or type("K", (), {"spec": spec})())
    monkeypatch.setattr(ops, "_KERNELS", {})
    exact, inexact, _ = _exact_and_inexact_v_inputs(128)
    assert fp8_ops._checked_kernel(exact, "bf16", False, False) is fp8_ops._checked_kernel(inexact, "bf16", False, False)
    assert [s.lazy_rescale for s in compiled] == [False]


def test_checked_kernel_refuses_a_lazy_kernel_for_inexact_v_ratios():
    exact, inexact, per_head = _exact_and_inexact_v_inputs(128)
    lazy = type("K", (), {"spec": KernelSpec(head_dim=128, dtype="e4m3", lazy_rescale=True)})()
    for ok in (exact, per_head):
        assert fp8_ops._checked_kernel(ok, "bf16", False, False, lazy) is lazy
    with pytest.raises(ValueError, match=r"rescales O lazily.*not marked so.*lazy_rescale=False"):
        fp8_ops._checked_kernel(inexact, "bf16", False, False, lazy)
    with pytest.raises(ValueError, match=r"is not causal but causal=True"):
        fp8_ops._checked_kernel(exact, "bf16", True, False, lazy)
    with pytest.raises(ValueError, match=r"does not take e4m3 head dims \(128, 128\) to fp16"):
        fp8_ops._checked_kernel(exact, "fp16", False, False, lazy)


@pytest.mark.parametrize("out", ["float32", "e4m3", torch.float8_e4m3fn])
def test_default_fp8_spec_rejects_unsupported_out_dtype(out):
    with pytest.raises(ValueError, match="out_dtype=.* is not supported"):
        registry.default_fp8_spec(128, 128, out, False)


def test_default_fp8_spec_rejects_unsupported_head_dim():
    with pytest.raises(ValueError, match="head_dim=80 is not supported"):
        registry.default_fp8_spec(80, 80, "bf16", False)


# ---- render ----------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128, 256])
def test_render_e4m3(d):
    src = fa3gen.render(KernelSpec(head_dim=d, dtype="e4m3", causal=True))
    for needle in ("cutlass::float_e4m3_t", "convert_to_fp8_a_operand", "TileDescale",
                   "GMMA::Major::K, GMMA::Major::K", "using ElementOut = cutlass::bfloat16_t"):
        assert needle in src, needle
    assert "accumulator_as_a_operand(tOrP" not in src  # the 16-bit P path


def test_render_e4m3_fp16_out():
    src = fa3gen.render(KernelSpec(head_dim=128, dtype="e4m3", out_dtype="fp16"))
    assert "using ElementOut = cutlass::half_t" in src and "cutlass::float_e4m3_t" in src


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_render_16_bit_has_no_fp8_code(dtype):
    src = fa3gen.render(KernelSpec(head_dim=128, dtype=dtype))
    assert "TileDescale" not in src
    assert "cutlass::float_e4m3_t" not in src
    assert "accumulator_as_a_operand(tOrP" in src


# ---- V_KEY_ORDER and the kernel's V layout ---------------------------------------------------

def _kernel_slot_to_column() -> list[int]:
    """The P -> A-operand mapping, derived from the WGMMA fragment layouts: within one 32-column
    slab of a row, thread t of a quad holds fp32 accumulator columns 8j + 2t + c (j < 4, c < 2)
    and the fp8 A-operand slots 4t + i and 16 + 4t + i (i < 4). Each thread converts its own values
    in register order (ascending column) into its own slots in register order (ascending slot)."""
    mapping = [-1] * 32
    for t in range(4):
        acc_cols = sorted(8 * j + 2 * t + c for j in range(4) for c in range(2))
        a_slots = sorted(16 * h + 4 * t + i for h in range(2) for i in range(4))
        for slot, col in zip(a_slots, acc_cols):
            assert mapping[slot] == -1
            mapping[slot] = col
    return mapping


def test_v_key_order_matches_kernel_register_mapping():
    expected = _kernel_slot_to_column()
    assert list(fp8.V_KEY_ORDER) == expected
    assert fp8.KEY_GROUP == 32
    assert sorted(fp8.V_KEY_ORDER) == list(range(32))  # a bijection of one group
    # the formula documented in wgmma.cuh: slot 4t + a + 16h <- column 2t + (a & 1) + 8 (a >> 1) + 16h
    for t in range(4):
        for a in range(4):
            for h in range(2):
                assert fp8.V_KEY_ORDER[4 * t + a + 16 * h] == 2 * t + (a & 1) + 8 * (a >> 1) + 16 * h
    assert list(fp8.V_KEY_ORDER) != list(range(32))


@pytest.mark.parametrize(("s", "padded"), [(0, 0), (1, 32), (31, 32), (32, 32), (33, 64), (77, 96), (128, 128)])
def test_padded_keys(s, padded):
    assert fp8.padded_keys(s) == padded


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("seqlen", [5, 64, 77])
def test_v_kernel_layout_round_trip_and_padding(dtype, seqlen):
    b, h, d = 2, 3, 64
    v = torch.randn(b, seqlen, h, d).mul(4).to(dtype)
    vt = fp8.v_kernel_layout(v)
    sp = fp8.padded_keys(seqlen)
    assert vt.shape == (b, h, d, sp) and vt.dtype == dtype and vt.is_contiguous()
    back = fp8.v_from_kernel_layout(vt, seqlen)
    assert back.shape == v.shape and back.dtype == dtype
    assert torch.equal(_as_bytes(back), _as_bytes(v))
    # slot p of group g holds key 32 g + V_KEY_ORDER[p]; slots of keys past seqlen are zero
    raw_vt, raw_v = _as_bytes(vt), _as_bytes(v)
    for g in range(sp // 32):
        for p, key in enumerate(fp8.V_KEY_ORDER):
            key += 32 * g
            got = raw_vt[:, :, :, 32 * g + p]
            if key < seqlen:
                assert torch.equal(got, raw_v[:, key]), (g, p)
            else:
                assert (got == 0).all(), (g, p)


def test_v_kernel_layout_direct_index_check():
    b, s, h, d = 1, 96, 2, 8
    v = torch.arange(b * s * h * d, dtype=torch.float32).reshape(b, s, h, d)
    vt = fp8.v_kernel_layout(v)
    for bi in range(b):
        for hi in range(h):
            for di in range(d):
                for g in range(s // 32):
                    for p in range(32):
                        assert vt[bi, hi, di, 32 * g + p] == v[bi, 32 * g + fp8.V_KEY_ORDER[p], hi, di]


@pytest.mark.parametrize("seqlen", [64, 77])
def test_permuted_p_times_kernel_v_is_p_times_v(seqlen):
    """What the kernel computes: P in slot order (each slab's columns permuted by V_KEY_ORDER, as the
    registers hand it over) times V in the kernel layout equals P·V."""
    gen = torch.Generator().manual_seed(3)
    rows, d = 16, 24
    p = torch.randn(rows, seqlen, generator=gen, dtype=torch.float64)
    v = torch.randn(seqlen, d, generator=gen, dtype=torch.float64)
    vt = fp8.v_kernel_layout(v[None, :, None, :])[0, 0]  # (d, padded keys)
    sp = fp8.padded_keys(seqlen)
    p_pad = torch.nn.functional.pad(p, (0, sp - seqlen))
    order = torch.tensor(fp8.V_KEY_ORDER)
    p_perm = p_pad.reshape(rows, sp // 32, 32)[..., order].reshape(rows, sp)
    torch.testing.assert_close(p_perm @ vt.T, p @ v, rtol=1e-12, atol=1e-12)
    # and the permutation matters: unpermuted P against the kernel's V is wrong
    assert not torch.allclose(p_pad @ vt.T, p @ v, atol=1e-6)


# ---- ABI -------------------------------------------------------------------------------------

def _c_layout(fields: list[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """Offsets and size of a C struct of scalar fields (natural alignment = size)."""
    offsets, offset, align = {}, 0, 1
    for name, size in fields:
        offset = -(-offset // size) * size
        offsets[name] = offset
        offset += size
        align = max(align, size)
    return offsets, -(-offset // align) * align


def _header_struct_fields(struct: str) -> list[str]:
    header = ABI_H.read_text()
    body = header[header.index(f"typedef struct {struct}"):header.index(f"}} {struct};")]
    body = re.sub(r"//[^\n]*", "", body.split("{", 1)[1])
    declared = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        declarators = re.sub(r"^(const\s+)?\w+\s*\*?", "", decl)
        declared += [name.strip() for name in declarators.split(",")]
    return declared


def test_descale_struct_layout():
    offsets, size = _c_layout([("scale", 8), ("batch_stride", 8), ("block_stride", 8), ("head_stride", 8),
                               ("block_rows", 4)])
    assert size == 40 == ctypes.sizeof(abi.Descale)
    assert ctypes.alignment(abi.Descale) == 8
    assert {name: getattr(abi.Descale, name).offset for name, _ in abi.Descale._fields_} == offsets
    assert [name for name, _ in abi.Descale._fields_] == _header_struct_fields("Fa3genDescale")
    assert ctypes.sizeof(ctypes.c_void_p) == 8 and abi.Descale.block_rows.size == 4


def test_fwd_params_end_with_three_descales():
    fields = abi.FwdParams._fields_
    assert [name for name, _ in fields[-3:]] == ["q_descale", "k_descale", "v_descale"]
    assert all(t is abi.Descale for _, t in fields[-3:])
    q_off = abi.FwdParams.q_descale.offset
    assert q_off % 8 == 0
    assert abi.FwdParams.k_descale.offset == q_off + 40 and abi.FwdParams.v_descale.offset == q_off + 80
    assert ctypes.sizeof(abi.FwdParams) == q_off + 120
    # the header declares the same fields in the same order
    assert _header_struct_fields("Fa3genFwdParams") == [name for name, _ in fields]
    # the backward params did not gain them
    assert "q_descale" not in [name for name, _ in abi.BwdParams._fields_]


def test_abi_version_is_7():
    assert abi.ABI_VERSION == 7
    assert re.search(r"^#define FA3GEN_ABI_VERSION 7$", ABI_H.read_text(), re.M)


# ---- prepare() -------------------------------------------------------------------------------

def _gqa_inputs(d=128, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 200, 4, d, generator=gen).to(dtype)
    k = torch.randn(2, 77, 2, d, generator=gen).to(dtype)
    v = torch.randn(2, 77, 2, d, generator=gen).to(dtype)
    return q, k, v


def _fp8_bound(ref: torch.Tensor, quant: fp8.Quantized) -> torch.Tensor:
    # e4m3: 3 mantissa bits (rounding error <= 2^-4 relative), subnormal step 2^-9 of the scale
    return ref.abs() * 2.0**-4 + fp8._expand_scale(quant, ref.shape) * 2.0**-10 + 1e-6


@pytest.mark.parametrize(("granularity", "q_scale", "kv_scale"),
                         [("tensor", (), ()), ("head", (2, 4), (2, 2)), ("block", (2, 2, 4), (2, 1, 2))])
@pytest.mark.parametrize("hadamard", [True, False])
def test_prepare_shapes_and_values(granularity, q_scale, kv_scale, hadamard):
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v, granularity, block_size=128, hadamard=hadamard, seed=7)
    assert isinstance(x, fp8.Fp8Inputs)
    assert x.seqlen_k == 77 and x.hadamard_seed == (7 if hadamard else None)
    assert x.q.data.shape == (2, 200, 4, 128) and x.k.data.shape == (2, 77, 2, 128)
    assert x.v.data.shape == (2, 2, 128, 96)  # (b, hk, d, padded keys)
    for quant, shape in ((x.q, q_scale), (x.k, kv_scale), (x.v, kv_scale)):
        assert quant.data.dtype == torch.float8_e4m3fn
        assert quant.scale.dtype == torch.float32 and tuple(quant.scale.shape) == shape
        assert quant.granularity == granularity
        assert quant.block_size == (128 if granularity == "block" else None)
    qh, kh = fp8.incoherent(q, k, 7) if hadamard else (q, k)
    for quant, ref in ((x.q, qh), (x.k, kh)):
        assert ((quant.dequantize() - ref).abs() <= _fp8_bound(ref, quant)).all()
    # V: back from the kernel layout, dequantized with its (K-like) scale, untransformed
    v_back = fp8.Quantized(fp8.v_from_kernel_layout(x.v.data, 77), x.v.scale, granularity, x.v.block_size)
    assert ((v_back.dequantize() - v).abs() <= _fp8_bound(v, v_back)).all()
    pad = fp8.v_from_kernel_layout(x.v.data, 96)[:, 77:]
    assert (pad.view(torch.uint8) == 0).all()


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_prepare_hadamard_keeps_scores(granularity):
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v, granularity, hadamard=True, seed=1)
    qd, kd = x.q.dequantize(torch.float64), x.k.dequantize(torch.float64)
    kd, k64 = kd.repeat_interleave(2, dim=2), k.double().repeat_interleave(2, dim=2)  # GQA: 2 q heads per kv head
    s_fp8 = torch.einsum("bqhd,bkhd->bhqk", qd, kd)
    s_ref = torch.einsum("bqhd,bkhd->bhqk", q.double(), k64)
    rel = float((s_fp8 - s_ref).norm() / s_ref.norm())
    assert rel < 0.1, rel
    assert rel > 0  # it did quantize


def test_prepare_from_bf16_inputs():
    q, k, v = _gqa_inputs(dtype=torch.bfloat16)
    x = fp8.prepare(q, k, v)
    assert x.q.data.dtype == x.k.data.dtype == x.v.data.dtype == torch.float8_e4m3fn
    assert x.q.scale.dtype == torch.float32


# ---- fp8_ops: descales and input checks (CPU tensors, no kernel) ------------------------------

def test_descale_per_tensor():
    q, _, _ = _gqa_inputs()
    quant = fp8.quantize_e4m3(q, "tensor")
    d = fp8_ops._descale(quant, 200, 4, 2, 128, "q")
    assert isinstance(d, abi.Descale)
    assert d.scale == quant.scale.data_ptr() and d.scale != 0
    assert (d.batch_stride, d.block_stride, d.head_stride, d.block_rows) == (0, 0, 0, 1)


def test_descale_per_head():
    q, _, _ = _gqa_inputs()
    quant = fp8.quantize_e4m3(q, "head")
    d = fp8_ops._descale(quant, 200, 4, 2, 128, "q")
    assert d.scale == quant.scale.data_ptr()
    assert (d.batch_stride, d.block_stride, d.head_stride, d.block_rows) == (4, 0, 1, 1)
    with pytest.raises(ValueError, match=r"q's per-head scale must be \(batch, nheads\) = \(2, 3\)"):
        fp8_ops._descale(quant, 200, 3, 2, 128, "q")


@pytest.mark.parametrize("block_size", [128, 256])
def test_descale_per_block(block_size):
    q, k, _ = _gqa_inputs()
    quant = fp8.quantize_e4m3(q, "block", block_size)
    d = fp8_ops._descale(quant, 200, 4, 2, 128, "q")
    nblocks = -(-200 // block_size)
    assert tuple(quant.scale.shape) == (2, nblocks, 4)
    assert d.scale == quant.scale.data_ptr()
    assert (d.batch_stride, d.block_stride, d.head_stride) == quant.scale.stride() == (nblocks * 4, 4, 1)
    assert d.block_rows == block_size
    kq = fp8.quantize_e4m3(k, "block", block_size)
    dk = fp8_ops._descale(kq, 77, 2, 2, 128, "k")
    assert (dk.batch_stride, dk.block_stride, dk.head_stride, dk.block_rows) == (2, 2, 1, block_size)


def test_descale_rejects_blocks_that_split_a_key_block_or_a_warpgroups_rows():
    q, _, _ = _gqa_inputs()
    quant = fp8.quantize_e4m3(q, "block", 64)
    with pytest.raises(ValueError, match=r"k's scale blocks of 64 rows must be a multiple of the kernel's key "
                                         r"blocks of 128 rows"):
        fp8_ops._descale(quant, 200, 4, 2, 128, "k")
    with pytest.raises(ValueError, match=r"q's scale blocks of 96 rows must be a multiple of a consumer "
                                         r"warpgroup's 64 rows"):
        fp8_ops._descale(fp8.quantize_e4m3(q, "block", 96), 200, 4, 2, 64, "q")
    with pytest.raises(ValueError, match=r"per-block scale must be \(batch, blocks, nheads\)"):
        fp8_ops._descale(fp8.quantize_e4m3(q, "block", 128), 300, 4, 2, 128, "q")


def test_check_inputs_accepts_prepared_inputs_up_to_the_device():
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v)
    with pytest.raises(ValueError, match=r"q is on cpu; fa3gen kernels run on CUDA"):
        fp8_ops._check_inputs(x)


def test_check_inputs_takes_v_as_the_model_holds_it():
    """V not in the kernel layout is (batch, seqlen_k, nheads_kv, head_dim_v), for the kernels
    that transpose it themselves; its shape is checked like that."""
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v)
    natural = fp8.prepare(q, k, v, kernel_v_layout=False)
    assert not natural.v.kernel_v_layout and natural.v.data.shape == v.shape and natural.head_dim_v == v.shape[3]
    assert torch.equal(natural.dequantized()[2], x.dequantized()[2])
    with pytest.raises(ValueError, match=r"q is on cpu; fa3gen kernels run on CUDA"):
        fp8_ops._check_inputs(natural)
    vq = fp8.quantize_e4m3(v[:, :-1], "block", 128)  # one key short
    with pytest.raises(ValueError, match=r"fp8 v \(batch, seqlen_k, nheads_kv, head_dim_v\) must be"):
        fp8_ops._check_inputs(fp8.Fp8Inputs(x.q, x.k, vq, x.seqlen_k))


def test_check_inputs_rejects_unpadded_kernel_v():
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v)
    short = fp8.Quantized(x.v.data[..., :80].contiguous(), x.v.scale, "block", 128, kernel_v_layout=True)
    with pytest.raises(ValueError, match=r"kernel's layout .*96"):
        fp8_ops._check_inputs(fp8.Fp8Inputs(x.q, x.k, short, x.seqlen_k))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_check_inputs_rejects_16_bit_data(which):
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v)
    parts = {"q": x.q, "k": x.k, "v": x.v}
    parts[which] = fp8.Quantized(parts[which].data.to(torch.bfloat16), parts[which].scale, "block", 128)
    with pytest.raises(TypeError, match=rf"fp8 {which} must be torch.float8_e4m3fn, got torch.bfloat16"):
        fp8_ops._check_inputs(fp8.Fp8Inputs(parts["q"], parts["k"], parts["v"], x.seqlen_k))


def test_check_inputs_rejects_seqlen_mismatch_and_bad_gqa():
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v)
    with pytest.raises(ValueError, match=r"k has 77 keys but the inputs say seqlen_k=64"):
        fp8_ops._check_inputs(fp8.Fp8Inputs(x.q, x.k, x.v, 64))
    q3 = fp8.prepare(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match=r"nheads_q=3 must be a multiple of nheads_kv=2"):
        fp8_ops._check_inputs(q3)


def test_flash_attn_fp8_func_on_cpu_asks_for_cuda():
    q, k, v = _gqa_inputs()
    x = fp8.prepare(q, k, v)
    with pytest.raises(ValueError, match=r"fa3gen: q is on cpu; fa3gen kernels run on CUDA"):
        fp8_ops.flash_attn_fp8_func(x, causal=True)
    with pytest.raises(ValueError, match=r"run on CUDA"):
        fp8_ops.fp8_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())


# ---- accuracy guard of the emulation ---------------------------------------------------------

def test_emulated_block_hadamard_beats_per_tensor():
    q, k, v = fp8.outlier_inputs(1, 512, 2, 128, seed=2)
    ref, _ = attention_reference(q.double(), k.double(), v.double())
    block = fp8.rmse(fp8.emulate_fp8_attention(q, k, v, granularity="block", use_hadamard=True), ref)
    tensor = fp8.rmse(fp8.emulate_fp8_attention(q, k, v, granularity="tensor", use_hadamard=False), ref)
    assert block < 1.2e-2, block
    assert block < tensor, (block, tensor)


def test_kernel_layout_v_is_dequantized_through_the_inputs() -> None:
    """V in the kernel's layout cannot be dequantized as if it were (b, s, h, d); the inputs undo
    the layout first and give back what the kernel sees."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, s, 2, 64) for s in (100, 300, 300))
    x = fp8.prepare(q, k, v, "block", 128, hadamard=False)
    with pytest.raises(ValueError, match="kernel's layout"):
        x.v.dequantize()
    qd, kd, vd = x.dequantized()
    assert vd.shape == v.shape and vd.dtype == torch.float64
    assert ((vd - v.double()).abs() <= v.abs().double() / 8 + 1e-2).all()  # e4m3: 3 mantissa bits
    assert torch.equal(qd, x.q.dequantize(torch.float64)) and torch.equal(kd, x.k.dequantize(torch.float64))


def test_e4m3_pingpong_default_only_with_two_consumer_warpgroups() -> None:
    assert not KernelSpec(head_dim=64, dtype="e4m3", block_m=192).pingpong  # three warpgroups: no pingpong
    assert not KernelSpec(head_dim=128, dtype="e4m3", pingpong=False).pingpong  # an explicit choice stays
    # 16-bit: pingpong comes with the chained tiles (PINGPONG_DEFAULT), built-in variants included,
    # but not with a custom score_mod or mask_mod
    assert KernelSpec(head_dim=128).pingpong
    assert all(KernelSpec(head_dim=128, **{v: True}).pingpong for v in ("window", "softcap", "alibi"))
    assert not KernelSpec(head_dim=128, mask_mod={"expr": "kv_idx <= q_idx"}).pingpong
    assert not KernelSpec(head_dim=128, score_mod={"expr": "score * 0.5f"}).pingpong
    assert not KernelSpec(head_dim=128, q_buffers=1).pingpong


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prepare_scale_blocks_default_to_blocks_every_registry_kernel_takes(d) -> None:
    q, k, v = (torch.randn(1, 500, 2, d) for _ in range(3))
    x = fp8.prepare(q, k, v)
    default = fa3gen.registry.default_fp8_spec(d, d, "bf16", False)
    kernels = [s for s in fa3gen.registry.REGISTRY.values() if s.dtype == "e4m3" and s.head_dim == d]
    assert default in kernels and len(kernels) >= 2
    key_blocks = {s.block_n for s in kernels}
    # Q: one tile of the default kernel; K/V: the smallest that is whole key blocks of all of them
    assert x.q.block_size == default.block_m and x.k.block_size == x.v.block_size == math.lcm(*key_blocks)
    assert all(x.q.block_size % 64 == 0 and x.k.block_size % s.block_n == 0 for s in kernels)
    assert x.k.scale.shape == (1, -(-500 // x.k.block_size), 2)
    pair = fp8.prepare(q, k, v, block_size=(256, 384))
    assert (pair.q.block_size, pair.k.block_size, pair.v.block_size) == (256, 384, 384)


def test_prepare_rounds_scales_to_powers_of_two():
    """prepare()'s default: every scale a power of two, so a lazy-rescale kernel's ratios of V
    scales are exact in P; the values still fit e4m3 and dequantize close to the input."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 384, 2, 64, generator=gen) * (1 + i) for i in range(3))
    inputs = fp8.prepare(q, k, v, "block", 128)
    for quantized in (inputs.q, inputs.k, inputs.v):
        exponent = torch.log2(quantized.scale)
        assert torch.equal(exponent, exponent.round())
    exact = fp8.prepare(q, k, v, "block", 128, power_of_two_scales=False)
    assert not torch.equal(torch.log2(exact.v.scale), torch.log2(exact.v.scale).round())
    qd, kd, vd = inputs.dequantized(torch.float64)
    assert float((vd - v.double()).abs().max() / v.abs().max()) < 0.07


def test_v_transpose_in_kernel_spec():
    """e4m3 only; its shared memory holds V's stages as loaded beside the transposed ones; the
    producer gets 40 registers; the name says it; specs without it keep their JSON (and cache key)."""
    spec = KernelSpec(head_dim=128, dtype="e4m3", v_transpose_in_kernel=True)
    plain = KernelSpec(head_dim=128, dtype="e4m3")
    assert spec.name.replace("_vtk", "", 1) == plain.name != spec.name and spec.register_split == (40, 232)
    assert spec.smem_bytes - plain.smem_bytes == spec.stages * spec.block_n * spec.head_dim_v
    assert "v_transpose_in_kernel" not in plain.canonical_json() and '"v_transpose_in_kernel":true' in spec.canonical_json()
    assert KernelSpec.from_json(plain.canonical_json()) == plain
    with pytest.raises(ValidationError, match="v_transpose_in_kernel applies to dtype='e4m3'"):
        KernelSpec(head_dim=128, v_transpose_in_kernel=True)
    with pytest.raises(ValidationError, match="does not combine with epilogue='tma_v'"):
        KernelSpec(head_dim=256, dtype="e4m3", v_transpose_in_kernel=True, epilogue="tma_v")
    src = render(spec)
    assert "transpose_v(p, smem, pipeline_v_load, pipeline_v" in src and "SmemLayoutVLoad" in src
    assert "transpose_v" not in render(plain) and "PipelineV" not in render(plain)
    causal = render(KernelSpec(head_dim=128, dtype="e4m3", causal=True, v_transpose_in_kernel=True))
    assert "tile_params.consumer_arv_count = kMmaThreads + kTransposeThreads;" in causal  # the transposers take tiles too


def test_checked_kernel_matches_the_v_layout(monkeypatch):
    """V as the model holds it (prepare(kernel_v_layout=False)) takes the kernel that transposes
    it; a kernel for the other layout is refused either way."""
    compiled = []
    monkeypatch.setattr(fa3gen, "compile", lambda spec: compiled.append(spec) or type("K", (), {"spec": spec})())
    monkeypatch.setattr(ops, "_KERNELS", {})
    q, k, v = _gqa_inputs()
    natural, pre = fp8.prepare(q, k, v, kernel_v_layout=False), fp8.prepare(q, k, v)
    assert fp8_ops._checked_kernel(natural, "bf16", True, False).spec.v_transpose_in_kernel
    assert not fp8_ops._checked_kernel(pre, "bf16", True, False).spec.v_transpose_in_kernel
    vtk, plain = (type("K", (), {"spec": KernelSpec(head_dim=128, dtype="e4m3", v_transpose_in_kernel=t)})()
                  for t in (True, False))
    with pytest.raises(ValueError, match=r"transposes it itself, but v is in the kernel layout"):
        fp8_ops._checked_kernel(pre, "bf16", False, False, vtk)
    with pytest.raises(ValueError, match=r"pass a spec with v_transpose_in_kernel=True"):
        fp8_ops._checked_kernel(natural, "bf16", False, False, plain)


_SERIAL_192 = dict(block_m=192, num_consumer_warpgroups=3, pingpong=False, row_sums_mma=True)
_PINGPONG_128 = dict(block_m=128, num_consumer_warpgroups=2, pingpong=True)


@pytest.mark.parametrize("head_dim, causal, threshold, short, long", [
    (64, False, 512, dict(_SERIAL_192, block_n=128, intra_wg_overlap=True, inter_tile_overlap=True),
     dict(_SERIAL_192, block_n=256, intra_wg_overlap=False, scores_f16=True, exp2_poly_every=8)),
    (64, True, 2048, dict(_SERIAL_192, block_n=128, intra_wg_overlap=True, warpgroup_key_trim=True, stages=3),
     dict(_SERIAL_192, block_n=128, intra_wg_overlap=True, inter_tile_overlap=True)),
    (128, False, 1024, dict(_PINGPONG_128, block_n=256, scores_f16=True, exp2_poly_every=8),
     dict(_SERIAL_192, block_n=256, q_buffers=1, intra_wg_overlap=False, scores_f16=True, exp2_poly_every=4)),
    (128, True, 1024, dict(_SERIAL_192, block_n=128, intra_wg_overlap=False, warpgroup_key_trim=True,
                           scores_f16=True, exp2_poly_every=8),
     dict(_SERIAL_192, block_n=256, q_buffers=1, intra_wg_overlap=False, warpgroup_key_trim=True, scores_f16=True,
          exp2_poly_every=4)),
])
def test_fp8_query_lengths_take_their_tiles(head_dim, causal, threshold, short, long) -> None:
    """The e4m3 tiles by query length (registry.FP8_SEQLEN_TILES): 192-row tiles on three consumer
    warpgroups (row sums on the tensor cores), hdim 64 overlapped up to 512 queries and the serial
    loop on 256-key blocks with fp16 scores past them, causal overlapped with per-warpgroup key
    trimming and three K/V stages up to 2k; hdim 128 the 128 x 256 pingpong kernel up to 1k and
    192 x 256 past it, causal the serial loop with trimming on 192 x 128 up to 1k and on 192 x
    256 past it, all with fp16 scores. Scale blocks that a bucket's key
    blocks do not divide take the default kernel (128 x 192 pingpong)."""
    name = f"fwd_d{head_dim}_e4m3" + ("_causal" if causal else "")
    default = fa3gen.registry.REGISTRY[name]
    assert default.pingpong and (default.block_m, default.block_n) == (128, 192)
    for seqlen_q in sorted({1, threshold, threshold + 1, 16384}):
        bucket, fields = ("short", short) if seqlen_q <= threshold else ("long", long)
        spec = fa3gen.registry.default_fp8_spec(head_dim, head_dim, "bf16", causal, seqlen_q=seqlen_q)
        assert spec is fa3gen.registry.REGISTRY[f"{name}_{bucket}"], (seqlen_q, spec.name)
        assert all(getattr(spec, k) == v for k, v in fields.items()), (seqlen_q, spec.name)
        q, k, v = (torch.randn(1, seqlen_q, 2, head_dim) for _ in range(3))
        assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v), causal=causal, window=False) == bucket
        assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v, block_size=(128, 64)), causal, False) is None
    assert fa3gen.registry.default_fp8_spec(head_dim, head_dim, "bf16", causal, seqlen_q=4096, window=True).block_m == 128
    assert fp8.default_block_rows(head_dim) == (128, 768)  # K/V blocks that 128-, 192- and 256-key blocks divide


def test_fp8_dispatch_takes_the_long_tiles_only_on_scale_blocks_they_fit() -> None:
    q, k, v = (torch.randn(1, 1100, 2, 128) for _ in range(3))
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v), causal=False, window=False) == "long"
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v), causal=True, window=False) == "long"
    assert fp8_ops._seqlen_bucket(fp8.prepare(q[:, :1024], k, v), causal=True, window=False) == "short"
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v), causal=False, window=True) is None
    assert fp8_ops._seqlen_bucket(fp8.prepare(q[:, :1024], k, v), causal=False, window=False) == "short"
    # 384-key scale blocks split the long kernel's 256-key blocks: the default kernel takes them,
    # unless Q and K are outside the fp16 scores' bound (its fp32-score tiles have 128-key blocks)
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v, block_size=(128, 384)), False, False) is None
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v, block_size=(128, 384), qk_max_abs=448.0), False, False) == "long"
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v, block_size=(128, 192)), False, False) is None
    assert fp8_ops._seqlen_bucket(fp8.prepare(q, k, v, "head"), False, False) == "long"
