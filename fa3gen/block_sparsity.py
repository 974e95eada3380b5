"""Block sparsity for a mask_mod (``KernelSpec.block_sparse``): the blocks every tile visits (a
forward's key blocks per query block, a backward's query blocks per key block), computed on the
GPU by the kernel library's classifier and cached per problem.

A problem is the kernel, the device, the sizes, and the call's variant values: scalars, and each
tensor param by identity (the same tensor object: a new tensor that the allocator happens to place
at a freed one's address is a new problem) and version (an in-place change to a document-id tensor
bumps it, so the ranges are computed again). Pass the same tensor object to reuse the ranges. The
kernels read them through the last tensor param slot.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

from .abi import MAX_TENSOR_DIMS, BwdParams, FwdParams

MAX_CACHED = 64  # problems whose ranges are kept (least recently used dropped first)
# problem key -> (ranges, weak references to the problem's tensor params)
_cache: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, tuple[weakref.ref, ...]]] = OrderedDict()


def _problem_key(kernel: Any, params: FwdParams | BwdParams, tensors: tuple[torch.Tensor, ...],
                 device: torch.device) -> tuple[Any, ...]:
    sizes = (params.batch, params.seqlen_q, params.seqlen_k, params.nheads_q, params.nheads_kv)
    # the variant's values as the kernel reads them (window sizes, scalars, tensor pointers and strides)
    values = bytes(params.variant)
    return (str(kernel.library_path), str(device), sizes, values, tuple((t.data_ptr(), t._version) for t in tensors))


def _same_tensors(refs: tuple[weakref.ref, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
    return len(refs) == len(tensors) and all(ref() is t for ref, t in zip(refs, tensors))


def block_ranges(kernel: Any, params: FwdParams | BwdParams, tensors: tuple[torch.Tensor, ...],
                 device: torch.device, stream: int) -> torch.Tensor:
    """int32 (batch, heads, tiles, 4): per tile the blocks [begin, end) some of whose elements the
    mask_mod shows, and [full_begin, full_end) the longest run it shows whole. A forward kernel's
    tiles are query blocks (heads: nheads_q) visiting key blocks; a backward's are key blocks
    (heads: nheads_kv) visiting query blocks. Stride 0 along the batch or the heads where the
    mask_mod does not use b or h. `params` holds the problem's sizes and variant values (filled);
    `tensors` are its tensor params."""
    key = _problem_key(kernel, params, tensors, device)
    if (hit := _cache.get(key)) is not None and _same_tensors(hit[1], tensors):
        _cache.move_to_end(key)
        return hit[0]
    spec = kernel.spec
    if spec.kind == "bwd":
        heads, tiles = params.nheads_kv, -(-params.seqlen_k // spec.block_n)
    else:
        heads, tiles = params.nheads_q, -(-params.seqlen_q // spec.block_m)
    per_batch, per_head = spec.block_ranges_per  # a mask_mod without b (h): one table for all
    ranges = torch.empty((params.batch if per_batch else 1, heads if per_head else 1, tiles, 4),
                         dtype=torch.int32, device=device)
    kernel.block_ranges(params, ranges.data_ptr(), stream)
    ranges = ranges.expand(params.batch, heads, tiles, 4)  # broadcast: stride 0
    _cache[key] = (ranges, tuple(weakref.ref(t) for t in tensors))
    _cache.move_to_end(key)
    while len(_cache) > MAX_CACHED:
        _cache.popitem(last=False)
    return ranges


def attach(params: FwdParams | BwdParams, slot: int, ranges: torch.Tensor) -> None:
    """Points the launch's tensor param `slot` at the ranges (the kernel's BLOCK_RANGES_SLOT)."""
    params.variant.tensor_args[slot] = ranges.data_ptr()
    for d in range(MAX_TENSOR_DIMS):
        params.variant.tensor_strides[slot][d] = int(ranges.stride(d)) if d < ranges.dim() else 0


def clear() -> None:
    """Drop every cached range table."""
    _cache.clear()


__all__ = ["MAX_CACHED", "attach", "block_ranges", "clear"]
