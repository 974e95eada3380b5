"""The fused fp8 prepare kernels (Fp8PrepareSpec) on torch tensors: ``fa3gen.fp8.prepare`` on Hopper.

Per input, three launches on the current stream:
1. ``fa3gen_fp8_amax``: the largest |value| of each block of rows of one (batch, head), after the
   random-sign Hadamard transform for Q and K (a butterfly over 8 lanes per row in fp32 registers,
   not a GEMM);
2. ``fa3gen_fp8_scales``: the descales from those, exactly as ``fa3gen.fp8.scales_from_amax``
   (one CTA; per (batch, head) and per tensor reduce the blocks' amax first);
3. ``fa3gen_fp8_quantize`` (Q, K, and V for kernels that transpose it themselves) or
   ``fa3gen_fp8_quantize_v_layout`` (V straight into the attention kernel's layout): the same
   transform again, value / scale, the e4m3 cast.
Steps 1 and 3 each read the input once (step 3 mostly from L2). The result matches
``fa3gen.fp8.quantize_e4m3`` bit for bit on the same (transformed) values; the transform itself is
more exact than torch's, whose GEMM rounds Q·M to the input dtype.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from . import abi, ops
from .fp8 import E4M3_MAX, Granularity, Quantized, padded_keys, random_signs, range_factor
from .prepare_spec import LANES, MAX_HEAD_DIM, Fp8PrepareSpec

AMAX_ROWS = 256  # rows of one amax block when the scale is per (batch, head) or per tensor
_INPUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ROW_ALIGN = 16  # bytes: rows are read in 16-byte vectors
_INT32_MAX = 2**31 - 1


def unsupported_reason(x: torch.Tensor) -> str | None:
    """Why the fused kernels cannot prepare x (batch, seqlen, nheads, head_dim); None if they can."""
    if not x.is_cuda:
        return f"it is on {x.device}, not a CUDA device"
    try:
        ops._check_gpu(x.device)  # the attention kernels' check, cached per device
    except ops.UnsupportedGPUError as exc:
        return str(exc)
    if x.dtype not in _INPUT_DTYPES:
        return f"its dtype is {x.dtype}, not one of {tuple(_INPUT_DTYPES)}"
    if x.shape[-1] % LANES or x.shape[-1] > MAX_HEAD_DIM:
        return f"its head dim {x.shape[-1]} is not a multiple of {LANES} up to {MAX_HEAD_DIM}"
    if x.numel() == 0 or max(x.shape[:3]) > _INT32_MAX:
        return f"its shape {tuple(x.shape)} is empty or too large"
    if x.stride(-1) != 1:
        return "its last dim is not contiguous"
    row_starts = [x.data_ptr()] + [s * x.element_size() for s, n in zip(x.stride()[:3], x.shape[:3]) if n > 1]
    if any(offset % _ROW_ALIGN for offset in row_starts):
        return f"its rows do not start on {_ROW_ALIGN}-byte boundaries"
    return None


def kernel_for(x: torch.Tensor):
    """The fused prepare kernels for x's head dim and dtype (built on first use, then cached)."""
    return _kernel(x.shape[-1], _INPUT_DTYPES[x.dtype])


@functools.lru_cache(maxsize=None)
def _kernel(head_dim: int, input_dtype: str):
    from .kernel import compile

    return compile(Fp8PrepareSpec(head_dim=head_dim, input_dtype=input_dtype))


@functools.lru_cache(maxsize=64)
def _signs(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """The Hadamard's signs on the device, made once per (head dim, seed, device)."""
    return random_signs(head_dim, seed, device).contiguous()


@dataclass
class LaunchPlan:
    """What quantize launches: the params of the amax and scales kernels (`reduce`) and of the
    cast (`cast`, which reads the scales along the sequence), the cast's entry point, and the
    buffers the params point at (they must outlive the launches)."""

    reduce: abi.Fp8PrepareParams
    cast: abi.Fp8PrepareParams
    cast_entry: str
    amax: torch.Tensor
    out: Quantized
    range_factor: float = 1.0  # the scales kernel's e4m3 scales times this before the cast (fp8.range_factor)


def plan(x: torch.Tensor, granularity: Granularity, block_rows: int, power_of_two: bool,
         signs: torch.Tensor | None, kernel_v_layout: bool, max_abs: float = E4M3_MAX) -> LaunchPlan:
    """The launches of ``quantize`` with their buffers allocated beside x (host logic only)."""
    if granularity not in abi.FP8_SCALE_GRANULARITY:
        raise ValueError(f"granularity must be 'tensor', 'head' or 'block', got {granularity!r}")
    if granularity == "block" and block_rows <= 0:
        raise ValueError(f"block_size must be positive, got {block_rows}")
    b, s, h, d = x.shape
    amax_rows = block_rows if granularity == "block" else AMAX_ROWS
    blocks = math.ceil(s / amax_rows)
    amax = torch.empty((b, blocks, h), dtype=torch.float32, device=x.device)
    scale_shape = {"block": (b, blocks, h), "head": (b, h), "tensor": ()}[granularity]
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    if kernel_v_layout:
        out = torch.empty((b, h, d, padded_keys(s)), dtype=torch.float8_e4m3fn, device=x.device)
    else:
        out = torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn, device=x.device)
    reduce = abi.Fp8PrepareParams(
        x=x.data_ptr(), x_batch_stride=x.stride(0), x_row_stride=x.stride(1), x_head_stride=x.stride(2),
        signs=signs.data_ptr() if signs is not None else None, amax=amax.data_ptr(), scale=scale.data_ptr(),
        out=out.data_ptr(), batch=b, seqlen=s, nheads=h, block_rows=amax_rows, padded_keys=padded_keys(s),
        granularity=abi.FP8_SCALE_GRANULARITY[granularity], power_of_two=int(power_of_two),
    )
    cast = abi.Fp8PrepareParams.from_buffer_copy(reduce)
    # How the cast kernels index the scales: scale[b * sb + (row / block_rows) * sk + h * sh].
    if granularity == "block":
        cast.scale_batch_stride, cast.scale_block_stride, cast.scale_head_stride = blocks * h, h, 1
    else:
        cast.block_rows = _INT32_MAX  # row / block_rows = 0: one scale along the sequence
        if granularity == "head":
            cast.scale_batch_stride, cast.scale_head_stride = h, 1
    if not kernel_v_layout:  # the V layout's strides are fixed by its shape
        cast.out_batch_stride, cast.out_row_stride, cast.out_head_stride = out.stride()[:3]
    entry = "fa3gen_fp8_quantize_v_layout" if kernel_v_layout else "fa3gen_fp8_quantize"
    factor = range_factor(max_abs, power_of_two)
    quantized = Quantized(out, scale, granularity, block_rows if granularity == "block" else None,
                          kernel_v_layout=kernel_v_layout, power_of_two=power_of_two, max_abs=E4M3_MAX / factor)
    return LaunchPlan(reduce, cast, entry, amax, quantized, factor)


def quantize(x: torch.Tensor, granularity: Granularity, block_rows: int, power_of_two: bool,
             hadamard_seed: int | None = None, kernel_v_layout: bool = False, max_abs: float = E4M3_MAX) -> Quantized:
    """``fa3gen.fp8.quantize_e4m3(x, granularity, block_rows, power_of_two, max_abs)`` with the fused
    kernels, of x times the random-sign Hadamard of `hadamard_seed` (None: x as it is), the result
    in the e4m3 kernel's V layout when `kernel_v_layout` (``fa3gen.fp8.v_kernel_layout``).
    The caller checks ``unsupported_reason(x)`` first."""
    kernel = kernel_for(x)
    signs = _signs(x.shape[-1], hadamard_seed, x.device) if hadamard_seed is not None else None
    launches = plan(x, granularity, block_rows, power_of_two, signs, kernel_v_layout, max_abs)
    # Launches go to the current device: switch only when x is elsewhere (the guard costs).
    with torch.cuda.device(x.device) if x.device.index != torch.cuda.current_device() else contextlib.nullcontext():
        stream = torch.cuda.current_stream(x.device).cuda_stream
        kernel.fp8_prepare("fa3gen_fp8_amax", launches.reduce, stream)
        kernel.fp8_prepare("fa3gen_fp8_scales", launches.reduce, stream)
        if launches.range_factor != 1.0:  # as scales_from_amax: e4m3's scales times the factor, in fp32
            launches.out.scale.mul_(launches.range_factor)
        kernel.fp8_prepare(launches.cast_entry, launches.cast, stream)
    return launches.out
