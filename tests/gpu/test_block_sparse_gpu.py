"""Block sparsity for a mask_mod (KernelSpec.block_sparse) on the GPU: the classifier's key block
ranges against the same classification done in torch, and the block-sparse forward into
NaN-poisoned outputs against float64 and against the dense kernel of the same mask. Packed
documents (causal within each), prefix-LM, and documents in a causal window (the spec's causal
bounds cut with the ranges). Ragged shapes, GQA, sq != sk, and the cache per problem."""

from __future__ import annotations

import math

import pytest
import torch

import fa3gen
from fa3gen import block_sparsity, ops
from fa3gen.launch import current_stream
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_launch, prebuild

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

TOLERANCE = 8e-3  # bf16, as the dense variants' tests
DOC_PARAM = {"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"}
DOCUMENTS = fa3gen.KernelSpec(head_dim=64, mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx"},
                              params=[DOC_PARAM], block_sparse=True)
PREFIX_LM = fa3gen.KernelSpec(head_dim=128, mask_mod={"expr": "kv_idx <= q_idx || kv_idx < prefix(b)"},
                              params=[{"kind": "tensor", "name": "prefix", "ndim": 1, "dtype": "int32"}],
                              block_sparse=True)
DOCUMENTS_IN_A_CAUSAL_WINDOW = fa3gen.KernelSpec(
    head_dim=128, causal=True, mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && q_idx - kv_idx < window"},
    params=[DOC_PARAM, {"kind": "scalar", "name": "window", "dtype": "int32"}], block_sparse=True)
SPARSE = [DOCUMENTS, PREFIX_LM, DOCUMENTS_IN_A_CAUSAL_WINDOW]
DENSE = [fa3gen.KernelSpec(**{**s.model_dump(exclude_unset=True), "block_sparse": False}) for s in SPARSE]
SPECS = SPARSE + DENSE
SHAPES = [(2, 1000, 1000, 4, 2), (1, 2049, 2049, 2, 2), (1, 700, 1100, 4, 4), (3, 300, 2049, 2, 1)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    prebuild(SPECS)


def packed_documents(b: int, s: int, seed: int) -> torch.Tensor:
    """int32 (b, s) document ids: 1 to 12 documents of random lengths per row."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(1, max(2, s // 3), (b, 12), device="cuda", generator=gen)
    return (torch.cumsum(lengths, 1).unsqueeze(-1) <= torch.arange(s, device="cuda")).sum(1).int()


def problem(spec: fa3gen.KernelSpec, b: int, sq: int, sk: int, hq: int, hkv: int, seed: int):
    """Inputs, the call's variant values and the same mask as a torch function (for the reference)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, sk, hkv, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    if spec.mask_mod.expr.startswith("kv_idx <= q_idx ||"):  # prefix-LM
        prefix = torch.randint(0, sk, (b,), device="cuda", generator=gen, dtype=torch.int32)
        lengths = prefix.long()
        return q, k, v, {"prefix": prefix}, lambda bb, hh, i, j: (j <= i) | (j < lengths[bb])
    doc = packed_documents(b, max(sq, sk), seed)
    ids = doc.long()
    if "window" in spec.mask_mod.expr:
        window = 700
        return q, k, v, {"doc": doc, "window": window}, lambda bb, hh, i, j: (ids[bb, i] == ids[bb, j]) & (i - j < window)
    return q, k, v, {"doc": doc}, lambda bb, hh, i, j: (ids[bb, i] == ids[bb, j]) & (j <= i)


def launched_ranges(kernel, q, k, v, params: dict) -> torch.Tensor:
    """The classifier's ranges for this call, as the forward launch computes them."""
    b, sq, hq, _ = q.shape
    out = torch.empty((b, sq, hq, v.shape[-1]), device="cuda", dtype=q.dtype)
    lse = torch.empty((b, hq, sq), device="cuda", dtype=torch.float32)
    fwd_params = ops._make_params(q, k, v, out, lse, 1 / math.sqrt(q.shape[-1]))
    variant = VariantArgs(params=params)
    ops._fill_variant(fwd_params, kernel, variant, q, k, kernel.spec.causal)
    tensors = tuple(t for t in params.values() if isinstance(t, torch.Tensor))
    ranges = block_sparsity.block_ranges(kernel, fwd_params, tensors, q.device, current_stream(q.device))
    torch.cuda.synchronize()
    return ranges


def torch_ranges(mask, b: int, hq: int, sq: int, sk: int, bm: int, bn: int) -> torch.Tensor:
    """The same classification in torch: per query block the first and last key block with a shown
    element, and the longest run of blocks with every element shown (rows < sq, keys < sk)."""
    shown = mask(torch.arange(b, device="cuda")[:, None, None, None], torch.arange(hq, device="cuda")[None, :, None, None],
                 torch.arange(sq, device="cuda")[None, None, :, None], torch.arange(sk, device="cuda")[None, None, None, :])
    shown = shown.expand(b, hq, sq, sk)
    nm, nn = -(-sq // bm), -(-sk // bn)
    out = torch.zeros(b, hq, nm, 4, dtype=torch.int32)
    for m in range(nm):
        rows = shown[:, :, m * bm:(m + 1) * bm]
        some = torch.stack([rows[..., n * bn:(n + 1) * bn].flatten(2).any(-1) for n in range(nn)], -1).cpu()
        every = torch.stack([rows[..., n * bn:(n + 1) * bn].flatten(2).all(-1) for n in range(nn)], -1).cpu()
        for bb in range(b):
            for hh in range(hq):
                blocks = [n for n in range(nn) if some[bb, hh, n]]
                first, end = (blocks[0], blocks[-1] + 1) if blocks else (nn, 0)
                best, best_begin, run = 0, 0, 0
                for n in range(nn):
                    run = run + 1 if (some[bb, hh, n] and every[bb, hh, n]) else 0
                    if run > best:
                        best, best_begin = run, n - run + 1
                out[bb, hh, m] = torch.tensor([first, end, best_begin, best_begin + best])
    return out


@pytest.mark.parametrize("spec", [DOCUMENTS, PREFIX_LM], ids=lambda s: s.name)
def test_block_ranges_match_torch(spec):
    """The classifier (no causal or window bounds in these specs: every key block is a candidate)
    against torch on the same mask; empty query blocks read {nn, 0} in torch and {nn, -1 + 1} there."""
    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v, params, mask = problem(spec, b, sq, sk, hq, hkv, seed=10 + i)
        got = launched_ranges(kernel, q, k, v, params).cpu()
        want = torch_ranges(mask, b, hq, sq, sk, spec.block_m, spec.block_n)
        visible = want[..., 1] > want[..., 0]
        assert torch.equal(got[visible], want[visible]), f"shape {(b, sq, sk, hq, hkv)}"
        assert (got[~visible][:, 1] <= got[~visible][:, 0]).all(), "an empty query block must have an empty range"


@pytest.mark.parametrize("index", range(len(SPARSE)), ids=[s.name for s in SPARSE])
def test_block_sparse_forward_matches_reference_and_dense(index):
    """Into NaN-poisoned outputs against float64, and against the dense kernel of the same mask
    (which evaluates the mask_mod on every block): the same up to the order of fp32 additions."""
    spec, dense_spec = SPARSE[index], DENSE[index]
    kernel, dense = fa3gen.compile(spec), fa3gen.compile(dense_spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v, params, mask = problem(spec, b, sq, sk, hq, hkv, seed=20 + i)
        variant = VariantArgs(params=params)
        check_poisoned_launch(q, k, v, spec.causal, kernel, variant, TOLERANCE, mask_mod=mask)
        out = kernel(q, k, v, **params)
        ref = dense(q, k, v, **params)
        diff = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
        assert diff < 1e-3, f"block-sparse vs dense {diff:.2e}"


def test_block_ranges_cached_per_problem():
    """One classification per problem: a second call with the same document ids reuses the ranges;
    ids changed in place (a new version of the tensor) are classified again, and the output follows."""
    kernel = fa3gen.compile(DOCUMENTS)
    q, k, v, params, _ = problem(DOCUMENTS, 2, 1000, 1000, 4, 2, seed=40)
    block_sparsity.clear()
    kernel(q, k, v, **params)
    kernel(q, k, v, **params)
    assert len(block_sparsity._cache) == 1
    doc = params["doc"]
    doc.copy_(packed_documents(2, 1000, seed=41))  # in place: same pointer, new version
    ids = doc.long()
    check_poisoned_launch(q, k, v, False, kernel, VariantArgs(params=params), TOLERANCE,
                          mask_mod=lambda bb, hh, i, j: (ids[bb, i] == ids[bb, j]) & (j <= i))
    assert len(block_sparsity._cache) == 2
