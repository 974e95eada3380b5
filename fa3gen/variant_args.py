"""The per-call values of a kernel's variants: checked against the spec, written into the
ABI's VariantParams (forward and backward).

``window_size``, ``softcap`` and ``alibi_slopes`` follow FlashAttention's conventions; the values of a
custom spec's params are given by name. A value the spec does not compile in, or a spec variant
with no value, is a clear error rather than a silently different kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .abi import MAX_TENSOR_DIMS, VariantParams
from .spec import KernelSpec
from .variant import ScalarParam

_TORCH_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64,
                 "float16": torch.float16, "bfloat16": torch.bfloat16, "bool": torch.bool}


@dataclass(frozen=True)
class VariantArgs:
    """Run-time variant values of one call. window_size (-1, -1) and softcap 0 mean off."""

    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def window(self) -> bool:
        return tuple(self.window_size) != (-1, -1)

    def check(self, spec: KernelSpec | None = None) -> None:
        """Values are well-formed, and (given a spec) are exactly the ones the spec takes."""
        ws = tuple(self.window_size)
        if len(ws) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in ws):
            raise ValueError(f"fa3gen: window_size must be two ints >= -1 (-1: unbounded), got {self.window_size!r}")
        if not isinstance(self.softcap, (int, float)) or not self.softcap >= 0:
            raise ValueError(f"fa3gen: softcap must be a number >= 0 (0: off), got {self.softcap!r}")
        if spec is None:
            return
        for name, has, wants in (("window_size", self.window, spec.window), ("softcap", self.softcap > 0, spec.softcap),
                                 ("alibi_slopes", self.alibi_slopes is not None, spec.alibi)):
            if has != wants:
                raise ValueError(f"fa3gen: kernel {spec.name} {'needs' if wants else 'does not take'} {name}")
        declared = {p.name for p in spec.variant_params}
        missing, unknown = sorted(declared - set(self.params)), sorted(set(self.params) - declared)
        if missing or unknown:
            raise ValueError(f"fa3gen: kernel {spec.name} takes params {sorted(declared)}; "
                             f"missing {missing}, unknown {unknown}")

    def check_tensors(self, spec: KernelSpec, q: torch.Tensor, k: torch.Tensor) -> None:
        """Devices, dtypes and shapes of the tensors (alibi slopes, tensor params)."""
        b, _, hq, _ = q.shape
        if self.alibi_slopes is not None:
            s = self.alibi_slopes
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != q.device:
                raise ValueError(f"fa3gen: alibi_slopes must be a float32 tensor on {q.device}")
            if tuple(s.shape) not in ((hq,), (b, hq)) or s.stride(-1) != 1:
                raise ValueError(f"fa3gen: alibi_slopes must have shape ({hq},) or ({b}, {hq}) with a "
                                 f"contiguous last dim, got shape {tuple(s.shape)} strides {s.stride()}")
        self._check_built_in_tensors(spec, q, k)
        for param in spec.variant_params:
            value = self.params[param.name]
            if isinstance(param, ScalarParam):
                kind = float if param.dtype == "float32" else int
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
                    raise ValueError(f"fa3gen: param {param.name} is a {param.dtype} scalar, got {value!r}")
                continue
            want = _TORCH_DTYPES[param.dtype]
            if not isinstance(value, torch.Tensor) or value.dtype != want or value.device != q.device \
                    or value.dim() != param.ndim:
                got = (f"{value.dtype} {value.dim()}-d on {value.device}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"fa3gen: param {param.name} must be a {param.ndim}-d {want} tensor on "
                                 f"{q.device}, got {got}")

    def _check_built_in_tensors(self, spec: KernelSpec, q: torch.Tensor, k: torch.Tensor) -> None:
        """The built-in masks' and bias's tensors cover the indices the kernel reads (a custom
        param's bounds are its expression's business)."""
        b, sq = q.shape[0], q.shape[1]
        if spec.documents:
            if k.shape[1] != sq:
                raise ValueError(f"fa3gen: documents (packed sequences) index queries and keys by the same document "
                                 f"ids: seqlen_q must equal seqlen_k, got {sq} and {k.shape[1]}")
            ids = self.params["document_ids"]
            if isinstance(ids, torch.Tensor) and tuple(ids.shape) != (b, sq):
                raise ValueError(f"fa3gen: document_ids must have shape (batch, seqlen) = ({b}, {sq}), got "
                                 f"{tuple(ids.shape)} (a batch row's ids may be shared: ids.expand({b}, -1))")
        full = (b, q.shape[2], sq, k.shape[1])
        for on, name in ((spec.bias, "attn_bias"), (spec.bias_grad, "attn_bias_grad")):
            tensor = self.params[name] if on else None
            if isinstance(tensor, torch.Tensor):
                _check_bias_layout(name, tensor, full, spec)
        if spec.prefix_lm:
            lengths = self.params["prefix_lengths"]
            if isinstance(lengths, torch.Tensor) and tuple(lengths.shape) != (b,):
                raise ValueError(f"fa3gen: prefix_lengths must have shape (batch,) = ({b},), got {tuple(lengths.shape)}")

    def fill(self, p: VariantParams, spec: KernelSpec, causal: bool, seqlen_q: int, seqlen_k: int) -> None:
        """Writes the values into the ABI struct (unbounded window sides become sq + sk)."""
        unbounded = int(seqlen_q) + int(seqlen_k)
        left, right = self.window_size
        p.window_left = unbounded if left < 0 else left
        p.window_right = unbounded if right < 0 else right
        if causal:  # causal caps the window's right side at the diagonal
            p.window_right = min(p.window_right, 0)
        p.softcap = float(self.softcap)
        if self.alibi_slopes is not None:
            s = self.alibi_slopes
            p.alibi_slopes = s.data_ptr()
            p.alibi_batch_stride = int(s.stride(0)) if s.dim() == 2 else 0
        for param, array, slot in spec.param_slots:
            value = self.params[param.name]
            if array != "tensor_args":
                getattr(p, array)[slot] = value
                continue
            p.tensor_args[slot] = value.data_ptr()
            for d in range(MAX_TENSOR_DIMS):
                p.tensor_strides[slot][d] = int(value.stride(d)) if d < value.dim() else 0


def _check_bias_layout(name: str, t: torch.Tensor, full: tuple[int, ...], spec: KernelSpec) -> None:
    """attn_bias (or its gradient) as the kernels index it: the full shape, keys contiguous, and a
    tile's rows within int offsets of its first element."""
    if tuple(t.shape) != full:
        raise ValueError(f"fa3gen: {name} must have shape (batch, nheads_q, seqlen_q, seqlen_k) = {full}, got "
                         f"{tuple(t.shape)} (a batch or head dim of 1 broadcasts through flash_attn_func)")
    if t.shape[3] > 1 and t.stride(3) != 1:
        raise ValueError(f"fa3gen: {name} must have contiguous keys (stride 1 in its last dim), got strides {t.stride()}")
    assert spec.block_m is not None and spec.block_n is not None
    if (spec.block_m - 1) * t.stride(2) + spec.block_n >= 2**31:
        raise ValueError(f"fa3gen: {name}'s row stride {t.stride(2)} is too large: a {spec.block_m} x {spec.block_n} "
                         "tile must span fewer than 2^31 elements")
    # The kernels that move rows in 16-byte pieces: bias_staging's copies, the vector atomics of d(bias).
    if name == "attn_bias" and spec.bias_staging:
        sixteen_byte_use = "copies attn_bias rows in 16-byte pieces (bias_staging)"
    elif name == "attn_bias_grad" and spec.bwd_bias_under_gemms:
        sixteen_byte_use = "adds attn_bias_grad four keys per 16-byte atomic"
    else:
        return
    if not bias_rows_aligned(t):
        raise ValueError(f"fa3gen: {spec.name} {sixteen_byte_use}: its address and batch, head and row strides must "
                         f"be multiples of 16 bytes, got address {t.data_ptr()} and strides {t.stride()[:3]} of "
                         f"{t.element_size()}-byte elements (flash_attn_func pads its rows itself)")


def bias_rows_aligned(t: torch.Tensor) -> bool:
    """Every row of the bias starts on a 16-byte boundary (bias_staging's copies); a size-1 dim's
    stride moves no row."""
    return t.data_ptr() % 16 == 0 and all(x * t.element_size() % 16 == 0 for x, n in zip(t.stride()[:3], t.shape) if n > 1)


def empty_with_aligned_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor of `shape` whose rows start on 16-byte boundaries: a view of one
    with its last dim padded to a multiple of 16 bytes."""
    per_16_bytes = 16 // (torch.finfo(dtype).bits // 8)
    keys = shape[-1]
    return torch.empty((*shape[:-1], -(-keys // per_16_bytes) * per_16_bytes), dtype=dtype, device=device)[..., :keys]
