"""The fused fp8 prepare kernels on the GPU: the same e4m3 bytes and scales as torch's
quantization (``fa3gen.fp8.quantize_e4m3``, ``v_kernel_layout``) where no transform is involved,
the Hadamard transform against float64, strided inputs, and attention on fused-prepared inputs
against float64. Outputs are allocated over poisoned memory, so a byte the kernels do not write
(padding keys included) shows."""

from __future__ import annotations

import math

import pytest
import torch

from fa3gen import fp8, fp8_ops, fp8_prepare
from fa3gen.reference import attention_reference
from fa3gen.prepare_spec import Fp8PrepareSpec
from gpu_checks import poison_allocator, prebuild

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEAD_DIMS = [64, 96, 128, 192, 256]
# (batch, seqlen, nheads): ragged lengths (not a multiple of 32 or of a scale block), and one
# (batch, head) with a single row.
SHAPES = [(2, 1000, 3), (1, 113, 4), (3, 1, 2)]
# The prepare kernel of every head dim and input dtype (scripts/gpu_specs.py packs them too).
SPECS = [Fp8PrepareSpec(head_dim=d, input_dtype=t) for d in HEAD_DIMS for t in ("bf16", "fp16", "fp32")]


@pytest.fixture(scope="module", autouse=True)
def _prebuilt_kernels():
    """Build (or load) the prepare kernels once, in parallel."""
    prebuild(SPECS)


def inputs(shape, head_dim, dtype, seed):
    """N(0, 1) with magnitudes that differ by row block and head, so every scale differs."""
    b, s, h = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, s, h, head_dim, device="cuda", generator=gen)
    ramp = 1.0 + 3.0 * torch.rand(b, s, h, 1, device="cuda", generator=gen) * (torch.arange(s, device="cuda") // 50 % 4)[None, :, None, None]
    return (x * ramp).to(dtype)


def poison(*nbytes: int) -> None:
    """Free blocks of these sizes filled with 0xff (an e4m3 NaN) into the caching allocator: the
    kernels' outputs are allocated next."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in nbytes for _ in range(2)]
    del blocks


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fused_quantization_is_torchs(head_dim, dtype, granularity):
    """Without the transform the fused bytes and scales equal quantize_e4m3's, in both layouts."""
    for i, shape in enumerate(SHAPES):
        x = inputs(shape, head_dim, dtype, i)
        for block_rows, power_of_two in ((128, True), (192, False), (100, True)):
            want = fp8.quantize_e4m3(x, granularity, block_rows, power_of_two)
            poison(x.numel(), x.shape[0] * x.shape[2] * head_dim * fp8.padded_keys(x.shape[1]))
            got = fp8_prepare.quantize(x, granularity, block_rows, power_of_two)
            assert torch.equal(got.scale, want.scale), (shape, block_rows)
            assert same_bytes(got.data, want.data), (shape, block_rows)
            assert (got.granularity, got.block_size, got.power_of_two) == (want.granularity, want.block_size, power_of_two)
            got_v = fp8_prepare.quantize(x, granularity, block_rows, power_of_two, kernel_v_layout=True)
            assert got_v.kernel_v_layout and torch.equal(got_v.scale, want.scale)
            assert same_bytes(got_v.data, fp8.v_kernel_layout(want.data)), (shape, block_rows, "V layout")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fused_hadamard_against_float64(head_dim, dtype):
    """Q times the random-sign Hadamard, in fp32 registers: its dequantized bytes are within e4m3's
    rounding of the float64 transform, and its block scales are float64's amax / 448 (rounded up
    to a power of two) up to the fp32 transform's error."""
    for i, shape in enumerate(SHAPES[:2]):
        x = inputs(shape, head_dim, dtype, 10 + i)
        got = fp8_prepare.quantize(x, "block", 128, True, hadamard_seed=i)
        signs = fp8.random_signs(head_dim, i, "cuda").double()
        exact = fp8.hadamard_transform(x.double() * signs)
        b, s, h, d = exact.shape
        nblocks = math.ceil(s / 128)
        padded = torch.nn.functional.pad(exact.abs(), (0, 0, 0, 0, 0, nblocks * 128 - s))
        amax = padded.view(b, nblocks, 128, h, d).amax(dim=(2, 4))
        exact_scale = amax / fp8.E4M3_MAX
        assert torch.all(got.scale >= exact_scale * (1 - 1e-5)) and torch.all(got.scale < 2 * exact_scale * (1 + 1e-5))
        deq = got.dequantize(torch.float64)
        row_scale = got.scale.double().repeat_interleave(128, dim=1)[:, :s, :, None]
        # e4m3: 3 mantissa bits (relative half-ulp 2^-4), subnormal steps of 2^-9 times the scale.
        # Plus the fp32 transform's error, which may move a value across a rounding boundary.
        bound = exact.abs() * 2.0**-4 + row_scale * (2.0**-10 + 1e-3)
        err = (deq - exact).abs()
        assert torch.all(err <= bound), f"worst excess {(err - bound).max().item():.3e}"


def test_strided_inputs_give_the_contiguous_result():
    """Q, K, V as views of one packed (batch, seqlen, 3, nheads, head_dim) tensor."""
    qkv = inputs((2, 777, 3 * 4), 128, torch.bfloat16, 3).view(2, 777, 3, 4, 128)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous() and fp8_prepare.unsupported_reason(q) is None
    strided = fp8.prepare(q, k, v, fused=True)
    packed = fp8.prepare(q.contiguous(), k.contiguous(), v.contiguous(), fused=True)
    for a, b in ((strided.q, packed.q), (strided.k, packed.k), (strided.v, packed.v)):
        assert same_bytes(a.data, b.data) and torch.equal(a.scale, b.scale)


def test_unsupported_inputs_fall_back_or_say_why():
    x = torch.randn(1, 64, 2, 80, device="cuda", dtype=torch.bfloat16)
    assert "head dim 80" in fp8_prepare.unsupported_reason(x)
    misaligned = torch.randn(1 * 64 * 2 * 128 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(1, 64, 2, 128)
    assert "16-byte" in fp8_prepare.unsupported_reason(misaligned)
    with pytest.raises(ValueError, match="16-byte"):
        fp8.prepare(misaligned, misaligned, misaligned, fused=True)
    auto = fp8.prepare(misaligned, misaligned, misaligned)  # torch ops
    assert auto.q.data.shape == (1, 64, 2, 128)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_on_fused_inputs(head_dim, causal):
    """The fp8 kernel on fused-prepared inputs, poisoned output, against float64 attention of the
    dequantized inputs; and within the same distance of the unquantized inputs' attention as the
    torch-prepared inputs."""
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (torch.randn(2, 1500, 4, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    fused = fp8.prepare(q, k, v, fused=True)
    ops = fp8.prepare(q, k, v, fused=False)
    scale = 1 / math.sqrt(head_dim)
    poison_allocator(((2, 1500, 4, head_dim), torch.bfloat16))
    out = fp8_ops.flash_attn_fp8_func(fused, causal=causal)
    ref, _ = attention_reference(*fused.dequantized(), scale, causal)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert not out.isnan().any() and rel < 3e-2, rel
    exact, _ = attention_reference(q.double(), k.double(), v.double(), scale, causal)
    rel_fused = float((out.double() - exact).norm() / exact.norm())
    out_ops = fp8_ops.flash_attn_fp8_func(ops, causal=causal)
    rel_ops = float((out_ops.double() - exact).norm() / exact.norm())
    print(f"d{head_dim} causal={causal}: vs dequantized {rel:.2e}; vs bf16 inputs fused {rel_fused:.3e}, torch ops {rel_ops:.3e}")
    assert rel_fused <= 1.05 * rel_ops
