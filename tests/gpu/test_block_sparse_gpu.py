"""Block sparsity for a mask_mod (KernelSpec.block_sparse) on the GPU: the classifiers' block ranges
(the forward's key blocks per query block, the backward's query blocks per key block over the
query heads of a kv head) against the same classification done in torch, and the block-sparse
forward and backward into NaN-poisoned outputs against float64 and against the dense kernels of
the same mask. Packed documents (causal within each), prefix-LM, documents in a causal window (the
spec's causal bounds cut with the ranges) and a causal span per head (ranges per head; the
backward's the union over a GQA group). Ragged shapes, GQA, sq != sk, and the cache per problem."""

from __future__ import annotations

import math

import pytest
import torch

import fa3gen
from fa3gen import block_sparsity, ops
from fa3gen.launch import current_stream
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_launch, prebuild
from test_variants_bwd_gpu import check_variant_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

TOLERANCE = 8e-3  # bf16, as the dense variants' tests
BWD_TOLERANCE = 1e-2  # bf16 gradients, as the dense variants' backward tests
DOC_PARAM = {"kind": "tensor", "name": "doc", "ndim": 2, "dtype": "int32"}
DOCUMENTS = fa3gen.KernelSpec(head_dim=64, mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && kv_idx <= q_idx"},
                              params=[DOC_PARAM], block_sparse=True)
PREFIX_LM = fa3gen.KernelSpec(head_dim=128, mask_mod={"expr": "kv_idx <= q_idx || kv_idx < prefix(b)"},
                              params=[{"kind": "tensor", "name": "prefix", "ndim": 1, "dtype": "int32"}],
                              block_sparse=True)
DOCUMENTS_IN_A_CAUSAL_WINDOW = fa3gen.KernelSpec(
    head_dim=128, causal=True, mask_mod={"expr": "doc(b, q_idx) == doc(b, kv_idx) && q_idx - kv_idx < window"},
    params=[DOC_PARAM, {"kind": "scalar", "name": "window", "dtype": "int32"}], block_sparse=True)
# Each head h sees the span(h) keys up to its diagonal: ranges per head (per kv head's group backward).
HEAD_SPANS = fa3gen.KernelSpec(head_dim=64, mask_mod={"expr": "kv_idx <= q_idx && q_idx - kv_idx < span(h)"},
                               params=[{"kind": "tensor", "name": "span", "ndim": 1, "dtype": "int32"}],
                               block_sparse=True)
SPARSE = [DOCUMENTS, PREFIX_LM, DOCUMENTS_IN_A_CAUSAL_WINDOW]
DENSE = [fa3gen.KernelSpec(**{**s.model_dump(exclude_unset=True), "block_sparse": False}) for s in SPARSE]
SPECS = SPARSE + DENSE + [HEAD_SPANS]
SPECS += [s.backward_spec() for s in SPECS]
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
    if "span(h)" in spec.mask_mod.expr:
        span = torch.randint(1, sk + 100, (hq,), device="cuda", generator=gen, dtype=torch.int32)
        spans = span.long()
        return q, k, v, {"span": span}, lambda bb, hh, i, j: (j <= i) & (i - j < spans[hh])
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
    """The classifier's ranges for this call, as the forward (backward) launch computes them."""
    b, sq, hq, _ = q.shape
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.empty((b, sq, hq, v.shape[-1]), device="cuda", dtype=q.dtype)
    lse = torch.empty((b, hq, sq), device="cuda", dtype=torch.float32)
    if kernel.spec.kind == "bwd":
        launch_params = ops._make_bwd_params(out, q, k, v, out, lse, q, k, v, scale)  # sizes only: nothing runs
    else:
        launch_params = ops._make_params(q, k, v, out, lse, scale)
    variant = VariantArgs(params=params)
    ops._fill_variant(launch_params, kernel, variant, q, k, kernel.spec.causal)
    tensors = tuple(t for t in params.values() if isinstance(t, torch.Tensor))
    ranges = block_sparsity.block_ranges(kernel, launch_params, tensors, q.device, current_stream(q.device))
    torch.cuda.synchronize()
    return ranges


def torch_ranges(shown: torch.Tensor, tile: int, block: int) -> torch.Tensor:
    """The same classification in torch. `shown` (b, heads, tile positions, group, visited
    positions): per tile the first and last visited block with a shown element (of any of the
    group), and the longest run of blocks with every element shown (of all of the group)."""
    b, heads, length, _, visited = shown.shape
    nt, nv = -(-length // tile), -(-visited // block)
    out = torch.zeros(b, heads, nt, 4, dtype=torch.int32)
    for t in range(nt):
        rows = shown[:, :, t * tile:(t + 1) * tile]
        some = torch.stack([rows[..., n * block:(n + 1) * block].flatten(2).any(-1) for n in range(nv)], -1).cpu()
        every = torch.stack([rows[..., n * block:(n + 1) * block].flatten(2).all(-1) for n in range(nv)], -1).cpu()
        for bb in range(b):
            for hh in range(heads):
                blocks = [n for n in range(nv) if some[bb, hh, n]]
                first, end = (blocks[0], blocks[-1] + 1) if blocks else (nv, 0)
                best, best_begin, run = 0, 0, 0
                for n in range(nv):
                    run = run + 1 if (some[bb, hh, n] and every[bb, hh, n]) else 0
                    if run > best:
                        best, best_begin = run, n - run + 1
                out[bb, hh, t] = torch.tensor([first, end, best_begin, best_begin + best])
    return out


def shown_elements(mask, b: int, hq: int, sq: int, sk: int) -> torch.Tensor:
    """bool (b, hq, sq, sk): where the mask shows query i of (b, h) key j."""
    shown = mask(torch.arange(b, device="cuda")[:, None, None, None], torch.arange(hq, device="cuda")[None, :, None, None],
                 torch.arange(sq, device="cuda")[None, None, :, None], torch.arange(sk, device="cuda")[None, None, None, :])
    return shown.expand(b, hq, sq, sk)


def check_ranges(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal where the tile visits some block; an empty tile's range is empty (torch writes {nv, 0},
    the classifier {nv, -1 + 1} or its band's bounds)."""
    visible = want[..., 1] > want[..., 0]
    assert torch.equal(got[visible], want[visible]), what
    assert (got[~visible][:, 1] <= got[~visible][:, 0]).all(), f"{what}: an empty tile must have an empty range"


@pytest.mark.parametrize("spec", [DOCUMENTS, PREFIX_LM, HEAD_SPANS], ids=lambda s: s.name)
def test_block_ranges_match_torch(spec):
    """Both classifiers (no causal or window bounds in these specs: every block is a candidate)
    against torch on the same mask: the forward's per query block and head, the backward's per key
    block and kv head (the union of its group's query heads)."""
    kernel, bwd_kernel = fa3gen.compile(spec), fa3gen.compile(spec.backward_spec())
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v, params, mask = problem(spec, b, sq, sk, hq, hkv, seed=10 + i)
        shown = shown_elements(mask, b, hq, sq, sk)
        want = torch_ranges(shown[:, :, :, None, :], spec.block_m, spec.block_n)
        check_ranges(launched_ranges(kernel, q, k, v, params).cpu(), want, f"forward, shape {(b, sq, sk, hq, hkv)}")
        by_key = shown.reshape(b, hkv, hq // hkv, sq, sk).permute(0, 1, 4, 2, 3)  # (b, hkv, sk, group, sq)
        want = torch_ranges(by_key, bwd_kernel.spec.block_n, bwd_kernel.spec.block_m)
        check_ranges(launched_ranges(bwd_kernel, q, k, v, params).cpu(), want, f"backward, shape {(b, sq, sk, hq, hkv)}")


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


@pytest.mark.parametrize("spec", SPARSE + [HEAD_SPANS], ids=lambda s: s.name)
def test_block_sparse_backward_matches_reference_and_dense(spec):
    """The block-sparse backward (after the block-sparse forward) into NaN-poisoned dq, dk, dv
    against float64, and against the dense backward of the same mask: dK and dV bit-identical (a
    skipped block adds exact zeros), dQ up to the order of its fp32 additions."""
    pair = fa3gen.compile(spec), fa3gen.compile(spec.backward_spec())
    dense_spec = fa3gen.KernelSpec(**{**spec.model_dump(exclude_unset=True), "block_sparse": False})
    dense = fa3gen.compile(dense_spec.backward_spec()) if dense_spec in DENSE else None
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v, params, mask = problem(spec, b, sq, sk, hq, hkv, seed=50 + i)
        variant = VariantArgs(params=params)
        check_variant_grads(q, k, v, spec.causal, pair, variant, BWD_TOLERANCE, mask_mod=mask)
        if dense is None:
            continue
        out, lse = pair[0](q, k, v, return_lse=True, **params)
        dout = torch.randn_like(out)
        sparse_grads = pair[1].backward(dout, q, k, v, out, lse, **params)
        dense_grads = dense.backward(dout, q, k, v, out, lse, **params)
        assert torch.equal(sparse_grads[1], dense_grads[1]) and torch.equal(sparse_grads[2], dense_grads[2]), \
            f"dk / dv differ from the dense backward's (shape {(b, sq, sk, hq, hkv)})"
        diff = float((sparse_grads[0].float() - dense_grads[0].float()).norm() / dense_grads[0].float().norm())
        assert diff < 2e-3, f"dq vs dense {diff:.2e}"

