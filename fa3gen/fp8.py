"""FP8 (e4m3) input preparation: block quantization and incoherent processing.

These are the torch-side halves of FP8 attention (FA3 paper, section 3.3): they run on any device
(CPU included) and need no compiled kernel.

* Quantization to float8_e4m3fn with one scale per tensor, per (batch, head), or per block of
  `block_size` sequence rows of one (batch, head): a block's outliers then cost precision only in
  that block. Scales are float32 "descales": the fp8 value times its scale is the input.
* Incoherent processing: Q and K multiplied along the head dim by the same random-sign Hadamard
  matrix M = H·diag(s) / sqrt(n). M is orthogonal, so Q·Kᵀ is unchanged in exact arithmetic,
  while a few large entries are spread over the whole head dim before quantization.
* An emulation of FP8 attention in float64 (quantize, dequantize, attention with P rounded to
  e4m3) for accuracy studies, e.g. the paper's experiment in ``outlier_inputs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
Granularity = Literal["tensor", "head", "block"]


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

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
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


def quantize_e4m3(x: torch.Tensor, granularity: Granularity = "block", block_size: int = 128) -> Quantized:
    """Quantizes x (batch, seqlen, nheads, head_dim) to float8_e4m3fn, scaled per `granularity`."""
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
    # An all-zero block keeps scale 1 (any scale is exact for zeros; this avoids 0/0).
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    q = Quantized(torch.empty(0), scale, granularity, block_size if granularity == "block" else None)
    data = (xf / _expand_scale(q, xf.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Quantized(data, scale, granularity, q.block_size)


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
    signs = random_signs(q.shape[-1], seed, q.device)
    return hadamard_transform(q * signs.to(q.dtype)), hadamard_transform(k * signs.to(k.dtype))


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


def emulate_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          granularity: Granularity = "block", block_size: int = 128,
                          use_hadamard: bool = True, seed: int = 0,
                          softmax_scale: float | None = None) -> torch.Tensor:
    """What an FP8 attention forward computes, emulated in float64 (no causal, nheads_q == nheads_kv).

    Q, K, V are quantized to e4m3 (after the incoherent transform of Q and K when asked) and
    dequantized; the probabilities P = exp(S - rowmax) in [0, 1] are scaled by 448 and rounded to
    e4m3 before P·V, as the kernel's second GEMM consumes them; the row sums use the unrounded P.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if use_hadamard:
        q, k = incoherent(q, k, seed)
    qd, kd, vd = (quantize_e4m3(t, granularity, block_size).dequantize(torch.float64) for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    p8 = (p * E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64) / E4M3_MAX
    out = torch.einsum("bhqk,bkhd->bqhd", p8, vd) / p.sum(dim=-1)[..., None].transpose(1, 2)
    return out


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((x.double() - ref.double()) ** 2).mean().sqrt())
