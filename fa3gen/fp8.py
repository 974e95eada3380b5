"""FP8 (e4m3) input preparation: block quantization and incoherent processing.

These are the input halves of FP8 attention (FA3 paper, section 3.3), written in torch: they run
on any device (CPU included) and need no compiled kernel. On Hopper, ``prepare`` runs the same
steps as fused kernels instead (``fa3gen.fp8_prepare``).

* Quantization to float8_e4m3fn with one scale per tensor, per (batch, head), or per block of
  `block_size` sequence rows of one (batch, head): a block's outliers then cost precision only in
  that block. Scales are float32 "descales": the fp8 value times its scale is the input.
* Incoherent processing: Q and K multiplied along the head dim by the same random-sign Hadamard
  matrix M = H·diag(s) / sqrt(n). M is orthogonal, so Q·Kᵀ is unchanged in exact arithmetic,
  while a few large entries are spread over the whole head dim before quantization.
* The kernel's V layout: an fp8 WGMMA reads both operands K-major, so V goes to the kernel
  transposed, (batch, nheads, head_dim, keys), with its keys padded to a multiple of 32 and
  permuted within each group of 32 (``V_KEY_ORDER``) to match where the kernel's P registers put
  them; ``v_kernel_layout`` makes it (one pass, fused into ``prepare`` with the quantization).
* An emulation of FP8 attention in float64 (quantize, dequantize, attention with P rounded to
  e4m3) for accuracy studies, e.g. the paper's experiment in ``outlier_inputs``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from .spec import scores_f16_qk_max

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
INV_E4M3_MAX = 1.0 / E4M3_MAX  # exact in fp32 only after rounding: scales are amax times its fp32 value
Granularity = Literal["tensor", "head", "block"]
KEY_GROUP = 32  # keys per fp8 P·V WGMMA (its K): V's keys are padded to and permuted within these


def _key_order() -> tuple[int, ...]:
    """Slot p of a group of 32 keys holds key sigma(p). The kernel hands P to the P·V WGMMA without
    moving it between threads: thread t of a quad holds score columns 2t, 2t+1, 8+2t, 8+2t+1, ...
    of a 32-key slab but fills the A-operand slots 4t..4t+3 and 16+4t..16+4t+3, slot
    4t + a + 16h with column 2t + (a & 1) + 8 (a >> 1) + 16h (fa3gen/wgmma.cuh)."""
    order = []
    for slot in range(KEY_GROUP):
        t, a, h = (slot >> 2) & 3, slot & 3, slot >> 4
        order.append(2 * t + (a & 1) + 8 * (a >> 1) + 16 * h)
    return tuple(order)


V_KEY_ORDER = _key_order()


@dataclass(frozen=True)
class Quantized:
    """An e4m3 tensor (batch, seqlen, nheads, head_dim) and the float32 scales that undo it.

    ``scale`` has shape () for "tensor", (batch, nheads) for "head", and
    (batch, ceil(seqlen / block_size), nheads) for "block".
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: Granularity
    block_size: int | None = None
    kernel_v_layout: bool = False  # data is V in the e4m3 kernel's layout (v_kernel_layout)
    # Every scale is a power of two (quantize_e4m3(power_of_two=True)): then ratios of scales are
    # exact, which the lazy-rescale kernels need of V's block scales (fa3gen.fp8_ops dispatches on
    # it). The producer's statement, not checked here (that would read the scales back to the host).
    power_of_two: bool = False
    # The largest |value| the data may hold (the quantization's target range, fp8.range_factor):
    # e4m3's 448, or less for Q and K of the scores_f16 kernels, whose fp16 scores need
    # |q|, |k| <= spec.scores_f16_qk_max(head_dim). The producer's statement, like power_of_two.
    max_abs: float = E4M3_MAX

    @property
    def exact_ratios_along_sequence(self) -> bool:
        """Whether the ratio of any two of one (batch, head)'s scales is exact: one scale per
        (batch, head) or tensor, or power-of-two block scales. A lazy-rescale kernel's P carries
        V's ratios (fa3gen.fp8_ops takes the eager kernel when they are not exact)."""
        return self.granularity != "block" or self.power_of_two

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kernel_v_layout:
            raise ValueError("this is V in the kernel's layout: dequantize Fp8Inputs with .dequantized(), or "
                             "undo the layout with fa3gen.fp8.v_from_kernel_layout first")
        return self.data.to(dtype) * _expand_scale(self, self.data.shape).to(dtype)


def _check_bshd(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be (batch, seqlen, nheads, head_dim), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _expand_scale(q: Quantized, shape: torch.Size) -> torch.Tensor:
    """The per-element scale, broadcastable to `shape` (batch, seqlen, nheads, head_dim)."""
    if q.granularity == "tensor":
        return q.scale
    if q.granularity == "head":
        return q.scale[:, None, :, None]
    assert q.block_size is not None
    rows = q.scale.repeat_interleave(q.block_size, dim=1)[:, : shape[1]]  # (b, s, h)
    return rows[..., None]


def range_factor(max_abs: float, power_of_two: bool) -> float:
    """What e4m3's scales (amax / 448) are multiplied by so that the values stay within max_abs:
    448 / max_abs, or with power-of-two scales the next power of two up from it (so they stay
    powers of two). The bound the data then keeps is 448 / range_factor (Quantized.max_abs)."""
    if not 0 < max_abs <= E4M3_MAX:
        raise ValueError(f"max_abs must be in (0, {E4M3_MAX:g}], got {max_abs}")
    ratio = E4M3_MAX / max_abs
    return float(2 ** math.ceil(math.log2(ratio))) if power_of_two else ratio


def scales_from_amax(amax: torch.Tensor, power_of_two: bool = False, max_abs: float = E4M3_MAX) -> torch.Tensor:
    """float32 descales from the largest |value| of each scale's group: amax / 448 (as amax times
    fp32(1 / 448)), or that rounded up to a power of two, times range_factor(max_abs) when the
    values must stay within max_abs. Shared by ``quantize_e4m3`` and the fused prepare kernels."""
    # Any scale is exact for an all-zero block; it takes the smallest of the others (1 if all are
    # zero), not 1: a lazy-rescale kernel's O unit moves to any larger V scale, and one from an
    # empty block would force rescales (and shrink the other blocks' ratios) for nothing.
    smallest = torch.where(amax > 0, amax, torch.inf).amin()  # no host sync
    fill = torch.where(smallest.isinf(), E4M3_MAX, smallest)
    # Times the fp32 reciprocal, not a division: torch divides a CUDA tensor by a Python scalar as
    # a multiplication by its reciprocal, on the CPU exactly; a product is the same everywhere.
    scale = (torch.where(amax > 0, amax, fill) * INV_E4M3_MAX).float()
    if power_of_two:
        # scale = m * 2^e with m in [0.5, 1): the next power of two up is 2^e, or scale itself when
        # m is 0.5 (exact, where exp2(ceil(log2(scale))) could round the wrong way).
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
    factor = range_factor(max_abs, power_of_two)
    return scale if factor == 1.0 else scale * factor


def quantize_e4m3(x: torch.Tensor, granularity: Granularity = "block", block_size: int = 128,
                  power_of_two: bool = False, max_abs: float = E4M3_MAX) -> Quantized:
    """Quantizes x (batch, seqlen, nheads, head_dim) to float8_e4m3fn, scaled per `granularity`.
    power_of_two: each scale rounded up to a power of two (e4m3 is floating point, so this costs
    its values next to no precision, and ratios of scales stay exact). max_abs: the values stay
    within it (scales_from_amax; below e4m3's 448 the smallest values turn subnormal sooner)."""
    _check_bshd(x)
    if granularity not in ("tensor", "head", "block"):
        raise ValueError(f"granularity must be 'tensor', 'head' or 'block', got {granularity!r}")
    if granularity == "block" and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().amax()
    elif granularity == "head":
        amax = xf.abs().amax(dim=(1, 3))  # (b, h)
    else:
        b, s, h, d = xf.shape
        nblocks = math.ceil(s / block_size)
        padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, nblocks * block_size - s))
        amax = padded.view(b, nblocks, block_size, h, d).abs().amax(dim=(2, 4))  # (b, nblocks, h)
    scale = scales_from_amax(amax, power_of_two, max_abs)
    q = Quantized(torch.empty(0), scale, granularity, block_size if granularity == "block" else None)
    data = (xf / _expand_scale(q, xf.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Quantized(data, scale, granularity, q.block_size, power_of_two=power_of_two,
                     max_abs=E4M3_MAX / range_factor(max_abs, power_of_two))


def padded_keys(seqlen_k: int) -> int:
    """Keys of one row of the kernel's transposed V: seqlen_k rounded up to a multiple of 32."""
    return -(-seqlen_k // KEY_GROUP) * KEY_GROUP


def v_kernel_layout(v: torch.Tensor) -> torch.Tensor:
    """V (batch, seqlen_k, nheads, head_dim_v) in the e4m3 kernel's layout: (batch, nheads,
    head_dim_v, padded_keys(seqlen_k)), contiguous, zeros past seqlen_k, and within each group of
    32 keys slot p holding key V_KEY_ORDER[p]. Any dtype (float8 is moved as bytes)."""
    _check_bshd(v, "v")
    b, s, h, d = v.shape
    raw = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
    sp = padded_keys(s)
    if sp != s:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, sp - s))
    # Key 16h + 8m + 2t + j of a group goes to slot 16h + 4t + 2m + j (V_KEY_ORDER): one permuted copy.
    keys = raw.view(b, sp // KEY_GROUP, 2, 2, 4, 2, h, d)  # (b, group, h, m, t, j, heads, dim)
    out = keys.permute(0, 6, 7, 1, 2, 4, 3, 5).reshape(b, h, d, sp)
    return out.view(torch.float8_e4m3fn) if v.dtype == torch.float8_e4m3fn else out


def v_from_kernel_layout(vt: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The inverse of v_kernel_layout: (batch, seqlen_k, nheads, head_dim_v)."""
    b, h, d, sp = vt.shape
    raw = vt.view(torch.uint8) if vt.dtype == torch.float8_e4m3fn else vt
    slots = raw.reshape(b, h, d, sp // KEY_GROUP, 2, 4, 2, 2)  # (b, heads, dim, group, h, t, m, j)
    out = slots.permute(0, 3, 4, 6, 5, 7, 1, 2).reshape(b, sp, h, d)[:, :seqlen_k].contiguous()
    return out.view(torch.float8_e4m3fn) if vt.dtype == torch.float8_e4m3fn else out


@dataclass(frozen=True)
class Fp8Inputs:
    """What the e4m3 forward kernel takes: Q and K quantized (batch, seqlen, nheads, head_dim), V
    quantized and in the kernel's layout (``v.data`` is (batch, nheads_kv, head_dim_v, padded
    keys); ``v.scale`` is indexed like K's), the number of keys, and whether Q and K went through
    the random-sign Hadamard transform (with which seed)."""

    q: Quantized
    k: Quantized
    v: Quantized
    seqlen_k: int
    hadamard_seed: int | None = None

    def dequantized(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as the kernel sees them, in (batch, seqlen, nheads, head_dim) and `dtype`."""
        v = self.v
        if v.kernel_v_layout:
            v = Quantized(v_from_kernel_layout(v.data, self.seqlen_k), v.scale, v.granularity, v.block_size)
        return self.q.dequantize(dtype), self.k.dequantize(dtype), v.dequantize(dtype)

    @property
    def head_dim_v(self) -> int:
        return self.v.data.shape[2] if self.v.kernel_v_layout else self.v.data.shape[3]


def default_block_rows(head_dim: int) -> tuple[int, int]:
    """Rows per scale block of (Q, K/V) that every registry e4m3 kernel of this head dim takes:
    Q one tile of the default kernel (a warpgroup's rows are what a kernel needs), K/V the least
    common multiple of their key blocks (hdim 128: 192 keys by default, 128 past 1k queries not
    causal, so 384)."""
    from fa3gen.registry import fp8_key_block_sizes
    from fa3gen.spec import FP8_TILES

    if head_dim not in FP8_TILES:
        raise ValueError(f"head_dim={head_dim} has no e4m3 kernel; choose one of {tuple(FP8_TILES)}")
    return FP8_TILES[head_dim][0], math.lcm(*fp8_key_block_sizes(head_dim))


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, granularity: Granularity = "block",
            block_size: int | tuple[int, int] | None = None, hadamard: bool = True, seed: int = 0,
            power_of_two_scales: bool = True, kernel_v_layout: bool = True, fused: bool | None = None,
            qk_max_abs: float | None = None) -> Fp8Inputs:
    """FP8 inputs for ``fa3gen.fp8_ops.flash_attn_fp8_func`` from 16- or 32-bit q, k, v
    (batch, seqlen, nheads, head_dim): Q and K through the random-sign Hadamard transform (when
    `hadamard`; it leaves Q·Kᵀ unchanged), all three quantized to e4m3 with one scale per tensor,
    per (batch, head) or per block of rows, V into the kernel's layout.

    block_size: rows per scale block, for Q and for K/V (an int for both, or a (q, kv) pair); a
    kernel needs Q's to be multiples of 64 (a consumer warpgroup's rows) and K/V's of its key
    blocks. None: blocks every registry kernel of the head dim takes
    (``default_block_rows(head_dim)``, e.g. 128 query and 384 key rows at hdim 128).

    power_of_two_scales: scales rounded up to powers of two (``quantize_e4m3``). A lazy-rescale
    kernel moves V's block factors into P, exactly only when their ratios are powers of two; and
    on the FA3 paper's experiment (emulated) they also lower the RMSE at 8k (9.42e-3 -> 8.96e-3).

    kernel_v_layout: V in the default kernels' layout (``v_kernel_layout``, one permuted copy; the
    result's ``v.kernel_v_layout``).
    False keeps V as (batch, seqlen_k, nheads, head_dim_v), for the kernels that transpose it in
    shared memory themselves (``KernelSpec.v_transpose_in_kernel``, which
    ``fa3gen.fp8_ops.flash_attn_fp8_func`` then picks).

    qk_max_abs: Q and K quantized to |x| <= this (``quantize_e4m3``'s max_abs). None:
    ``spec.scores_f16_qk_max(head_dim)``, which keeps every score finite in fp16 (16 up to hdim
    192, 15 at 256: an e4m3 value under sqrt(65504 / 256)), the bound the scores_f16 kernels need,
    at no cost in accuracy (FA3 paper's experiment: RMSE 8.998e-3 at 448 and at 16, CPU
    emulation; 8.978e-3 both on the GPU; hdim 256 s8k 8.0005e-3 at 16 on the lazy fp32-score
    kernel, H100). Inputs outside the bound take fp32-score kernels. The scores_f16 kernels'
    exp2 offset is fp16 as well: logits (q·k · softmax_scale) past about 45400 give NaN rows
    there; give such inputs qk_max_abs=448 (fp32 scores).

    fused: run the fused prepare kernels (``fa3gen.fp8_prepare``: Hadamard, amax, cast and V's
    layout in a few memory-bound passes, JIT-compiled like the attention kernels) instead of
    torch ops. None: when every input allows it (CUDA tensors on Hopper, bf16/fp16/fp32, head dims
    multiples of 32 up to 256, rows 16-byte aligned) and a compiler or a cached build is there.
    True: an error says why not. The quantization is the same; the fused transform runs in fp32,
    where torch's GEMM rounds Q and K times the Hadamard to their dtype first.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_bshd(t, name)
    if qk_max_abs is None:
        qk_max_abs = scores_f16_qk_max(q.shape[-1])
    if block_size is None:
        q_rows, kv_rows = default_block_rows(q.shape[-1]) if granularity == "block" else (128, 128)
    elif isinstance(block_size, int):
        q_rows = kv_rows = block_size
    else:
        q_rows, kv_rows = block_size
    if hadamard and q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if _use_fused(fused, q, k, v):
        from . import fp8_prepare

        seed_or_none = seed if hadamard else None
        qq, kq = (fp8_prepare.quantize(t, granularity, rows, power_of_two_scales, seed_or_none, max_abs=qk_max_abs)
                  for t, rows in ((q, q_rows), (k, kv_rows)))
        vq = fp8_prepare.quantize(v, granularity, kv_rows, power_of_two_scales, kernel_v_layout=kernel_v_layout)
        return Fp8Inputs(qq, kq, vq, int(v.shape[1]), seed_or_none)
    if hadamard:
        q, k = incoherent(q, k, seed)
    qq, kq, vq = (quantize_e4m3(t, granularity, rows, power_of_two_scales, max_abs)
                  for t, rows, max_abs in ((q, q_rows, qk_max_abs), (k, kv_rows, qk_max_abs), (v, kv_rows, E4M3_MAX)))
    if kernel_v_layout:
        vq = Quantized(v_kernel_layout(vq.data), vq.scale, vq.granularity, vq.block_size, kernel_v_layout=True,
                       power_of_two=vq.power_of_two)
    return Fp8Inputs(qq, kq, vq, int(v.shape[1]), seed if hadamard else None)


def _use_fused(fused: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether prepare runs the fused kernels (see its `fused`)."""
    if fused is False:
        return False
    from . import fp8_prepare

    reasons = [f"{name}: {why}" for name, t in zip("qkv", tensors) if (why := fp8_prepare.unsupported_reason(t))]
    if fused is None and not reasons:
        from .build import JitDisabledError
        from .toolchain import ToolchainError

        try:  # built once, then cached: fall back to torch ops if it cannot be
            for t in tensors:
                fp8_prepare.kernel_for(t)
        except (ToolchainError, JitDisabledError) as exc:
            warnings.warn(f"fa3gen.fp8.prepare: the fused kernels are unavailable ({exc}); using torch ops",
                          stacklevel=3)
            return False
    if fused and reasons:
        raise ValueError("fa3gen.fp8.prepare(fused=True) cannot use the fused kernels: " + "; ".join(reasons))
    return not reasons


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform along the last dim, in x's dtype (at least fp32 inside).

    For a head dim that is not a power of two (96, 192) the transform is block-diagonal, with the
    largest power-of-two block that divides it (32, 64): still orthogonal, so dot products keep.
    """
    n = x.shape[-1]
    block = n & -n  # largest power of two dividing n
    if block < 2:
        raise ValueError(f"the last dim ({n}) must be even for a Hadamard transform")
    work = x.double() if x.dtype == torch.float64 else x.float()
    y = work.reshape(*x.shape[:-1], n // block, block)
    h = 1
    while h < block:
        pairs = y.reshape(*y.shape[:-1], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*y.shape[:-1], block)
        h *= 2
    return (y / math.sqrt(block)).reshape(x.shape).to(x.dtype)


def random_signs(head_dim: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """A reproducible ±1 vector of length head_dim."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
    return signs.to(device)


def incoherent(q: torch.Tensor, k: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K times the same random-sign Hadamard along the head dim: Q·Kᵀ is unchanged."""
    _check_bshd(q, "q")
    _check_bshd(k, "k")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    # One GEMM per tensor with M = diag(signs)·H / sqrt(n) (hadamard_transform is linear): on a GPU
    # a d x d matmul on the tensor cores costs far less than the butterfly's log2(d) passes.
    m = hadamard_transform(torch.diag(random_signs(q.shape[-1], seed)).double())
    return q @ m.to(q.device, q.dtype), k @ m.to(k.device, k.dtype)


def outlier_inputs(batch: int, seqlen: int, nheads: int, head_dim: int, seed: int = 0,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FA3 paper's FP8 accuracy inputs: N(0, 1) + N(0, 100) · Bernoulli(0.001), in float32."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one() -> torch.Tensor:
        shape = (batch, seqlen, nheads, head_dim)
        base = torch.randn(shape, generator=gen)
        outliers = torch.randn(shape, generator=gen) * 10.0 * (torch.rand(shape, generator=gen) < 1e-3)
        return (base + outliers).to(device)

    return one(), one(), one()


# The kernel's factor on P before its e4m3 cast (OnlineSoftmax's kProbLog2Scale = 8); a
# lazy-rescale kernel scales by 64 times a block's V ratio to O's unit, in (1/4, 1]
# (KernelSpec.prob_log2_scale): emulated, a factor of 16 to 64 moves the RMSE by < 0.04%.
P_SCALE = 256.0


def emulate_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          granularity: Granularity = "block", block_size: int | tuple[int, int] | None = 128,
                          use_hadamard: bool = True, seed: int = 0,
                          softmax_scale: float | None = None) -> torch.Tensor:
    """What the FP8 attention forward computes, emulated in float64 (no causal, nheads_q == nheads_kv).

    The inputs are prepared as for the kernel (``prepare``: Hadamard, quantization, same
    arguments) and dequantized; the probabilities P = exp(S - rowmax) are scaled by 256 and
    rounded to e4m3 before P·V, as the kernel's second GEMM consumes them; the row sums use the
    unrounded P. (The kernel rounds P against the running max of the key blocks seen so far.)
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qd, kd, vd = prepare(q, k, v, granularity, block_size, use_hadamard, seed).dequantized(torch.float64)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    p8 = (p * P_SCALE).to(torch.float8_e4m3fn).to(torch.float64) / P_SCALE
    out = torch.einsum("bhqk,bkhd->bqhd", p8, vd) / p.sum(dim=-1)[..., None].transpose(1, 2)
    return out


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((x.double() - ref.double()) ** 2).mean().sqrt())
