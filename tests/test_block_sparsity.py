"""fa3gen.block_sparsity's cache of block ranges per problem, with a stand-in for the kernel's
classifier (the classifier itself runs in tests/gpu/test_block_sparse_gpu.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fa3gen import KernelSpec, block_sparsity
from fa3gen.abi import FwdParams
from fa3gen.kernel import CompiledKernel


class Classifier:
    """Counts classifications; writes nothing (the ranges' values are the GPU test's business)."""

    def __init__(self, name: str = "a", per: tuple[bool, bool] = (True, True), kind: str = "fwd") -> None:
        self.spec = SimpleNamespace(kind=kind, block_m=128, block_n=176, block_ranges_per=per)
        self.library_path = Path(f"/cache/{name}/kernel.so")
        self.calls = 0

    def block_ranges(self, params, ranges, stream) -> None:
        self.calls += 1


def problem(seqlen_q: int = 1000, window: int = 0) -> FwdParams:
    p = FwdParams()
    p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv = 2, seqlen_q, 1000, 4, 2
    p.variant.int_args[0] = window
    return p


def test_ranges_are_reused_for_the_same_problem_only():
    block_sparsity.clear()
    kernel, doc = Classifier(), torch.zeros(2, 1000, dtype=torch.int32)
    cpu = torch.device("cpu")
    first = block_sparsity.block_ranges(kernel, problem(), (doc,), cpu, 0)
    assert first.shape == (2, 4, 8, 4) and first.dtype == torch.int32
    assert block_sparsity.block_ranges(kernel, problem(), (doc,), cpu, 0) is first and kernel.calls == 1
    # another size, another scalar, another kernel: each its own problem
    block_sparsity.block_ranges(kernel, problem(seqlen_q=999), (doc,), cpu, 0)
    block_sparsity.block_ranges(kernel, problem(window=5), (doc,), cpu, 0)
    block_sparsity.block_ranges(Classifier("b"), problem(), (doc,), cpu, 0)
    assert kernel.calls == 3
    # an in-place change bumps the tensor's version: classified again
    doc.add_(1)
    block_sparsity.block_ranges(kernel, problem(), (doc,), cpu, 0)
    assert kernel.calls == 4
    # another tensor object at the same address (the allocator reusing a freed block looks the
    # same): classified again, never answered from the old one's ranges
    alias = doc.view_as(doc)
    assert alias.data_ptr() == doc.data_ptr() and alias._version == doc._version
    block_sparsity.block_ranges(kernel, problem(), (alias,), cpu, 0)
    assert kernel.calls == 5


def test_cache_keeps_the_most_recent_problems():
    block_sparsity.clear()
    kernel, cpu = Classifier(), torch.device("cpu")
    docs = [torch.zeros(2, 1000, dtype=torch.int32) for _ in range(block_sparsity.MAX_CACHED + 1)]
    for doc in docs:
        block_sparsity.block_ranges(kernel, problem(), (doc,), cpu, 0)
    assert len(block_sparsity._cache) == block_sparsity.MAX_CACHED
    block_sparsity.block_ranges(kernel, problem(), (docs[-1],), cpu, 0)  # the newest: kept
    block_sparsity.block_ranges(kernel, problem(), (docs[0],), cpu, 0)  # the oldest: dropped
    assert kernel.calls == block_sparsity.MAX_CACHED + 2


def test_attach_points_the_last_tensor_slot_at_the_ranges():
    params, ranges = problem(), torch.zeros(2, 4, 8, 4, dtype=torch.int32)
    block_sparsity.attach(params, 7, ranges)
    assert params.variant.tensor_args[7] == ranges.data_ptr()
    assert list(params.variant.tensor_strides[7]) == [128, 32, 4, 1]


def test_ranges_of_a_mask_without_b_or_h_are_classified_once_and_broadcast():
    """A mask_mod that uses b but not h (document ids per sequence): one table per batch row, the
    heads reading it through stride 0; neither: one table for all."""
    block_sparsity.clear()
    cpu, doc = torch.device("cpu"), torch.zeros(2, 1000, dtype=torch.int32)
    per_batch = block_sparsity.block_ranges(Classifier("b", (True, False)), problem(), (doc,), cpu, 0)
    assert per_batch.shape == (2, 4, 8, 4) and per_batch.stride()[:2] == (32, 0)
    shared = block_sparsity.block_ranges(Classifier("c", (False, False)), problem(), (doc,), cpu, 0)
    assert shared.shape == (2, 4, 8, 4) and shared.stride()[:2] == (0, 0)
    params = problem()
    block_sparsity.attach(params, 7, per_batch)
    assert list(params.variant.tensor_strides[7]) == [32, 0, 4, 1]


def test_backward_ranges_are_per_key_block_and_kv_head():
    """A backward kernel's tiles are key blocks of a kv head: (batch, nheads_kv, ceil(seqlen_k /
    block_n), 4), and a problem of its own beside the forward's."""
    block_sparsity.clear()
    cpu, doc = torch.device("cpu"), torch.zeros(2, 1000, dtype=torch.int32)
    bwd = Classifier("bwd", (True, True), kind="bwd")
    ranges = block_sparsity.block_ranges(bwd, problem(), (doc,), cpu, 0)
    assert ranges.shape == (2, 2, 6, 4) and ranges.is_contiguous()
    assert block_sparsity.block_ranges(Classifier("fwd"), problem(), (doc,), cpu, 0).shape == (2, 4, 8, 4)
    assert len(block_sparsity._cache) == 2 and bwd.calls == 1


def test_a_raw_launch_without_the_ranges_says_what_is_missing():
    """The library refuses a block-sparse launch whose ranges slot is empty (cudaErrorInvalidValue);
    the error names the missing ranges and how to supply them."""
    spec = KernelSpec(head_dim=64, mask_mod={"expr": "kv_idx <= q_idx"}, block_sparse=True)
    lib = SimpleNamespace(fa3gen_fwd_workspace_bytes=lambda: 0, fa3gen_fwd=lambda params, stream: 1)
    kernel = CompiledKernel(spec, SimpleNamespace(), lib)
    with pytest.raises(RuntimeError, match="is block_sparse: its launch needs the block ranges in tensor param slot 7"):
        kernel.fwd(problem(), 0)
    params = problem()
    block_sparsity.attach(params, 7, torch.zeros(2, 4, 8, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="failed: CUDA error 1"):
        kernel.fwd(params, 0)
