"""The built-ins that take a tensor, through flash_attn_func's autograd on the GPU: packed
documents (document_ids; causal, GQA) and prefix-LM (prefix_lengths), block-sparse by default, and
an additive bias (attn_bias; a relative position bias broadcast over the batch, with a window).
Out and lse into NaN-poisoned buffers against float64, then dq, dk, dv against the float64
gradients of the same variant. Ragged lengths; empty prefixes and prefixes past the sequence."""

from __future__ import annotations

import pytest
import torch

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads
from gpu_checks import check_poisoned_outputs, poison_allocator, prebuild
from test_block_sparse_gpu import packed_documents
from test_fwd_gpu import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

TOLERANCE, GRAD_TOLERANCE = 8e-3, 1e-2  # bf16, as the variants' tests
DOCUMENTS = fa3gen.default_spec(128, 128, "bf16", True, documents=True)
PREFIX_LM = fa3gen.default_spec(64, 64, "bf16", False, prefix_lm=True)
BIAS = fa3gen.default_spec(128, 128, "bf16", True, window=True, bias=True)
SPECS = [spec for fwd in (DOCUMENTS, PREFIX_LM, BIAS) for spec in (fwd, fwd.backward_spec())]
SHAPES = [(2, 1000, 4, 2), (1, 2049, 2, 2), (3, 300, 4, 1)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    prebuild(SPECS)


def run_and_check(q, k, v, reference: dict, **args) -> None:
    """flash_attn_func into poisoned buffers against float64 (the reference's variant arguments),
    then its gradients."""
    b, s, hq, d = q.shape
    poison_allocator(((b, s, hq, d), torch.bfloat16), ((b, hq, s), torch.float32))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = fa3gen.flash_attn_func(q, k, v, return_lse=True, **args)
    ref, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), **reference)
    check_poisoned_outputs(out.detach(), lse.detach(), ref, ref_lse, TOLERANCE, 1e-3, f"{args.keys()} {q.shape}")
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = attention_reference_grads(q.detach(), k.detach(), v.detach(), dout, **reference)
    for name, g, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads):
        err = rel_err(g, r)
        assert err < GRAD_TOLERANCE, f"{name}: rel err {err:.2e} (q {tuple(q.shape)})"


def inputs(b: int, s: int, hq: int, hkv: int, d: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_documents_causal(shape):
    b, s, hq, hkv = shape
    q, k, v = inputs(b, s, hq, hkv, 128, seed=s)
    doc = packed_documents(b, s, seed=s)
    ids = doc.long()
    run_and_check(q, k, v, {"mask_mod": lambda bb, hh, i, j: (ids[bb, i] == ids[bb, j]) & (j <= i)},
                  causal=True, document_ids=doc)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_prefix_lm(shape):
    b, s, hq, hkv = shape
    q, k, v = inputs(b, s, hq, hkv, 64, seed=s + 1)
    gen = torch.Generator(device="cuda").manual_seed(s)
    prefix = torch.randint(0, s + 50, (b,), device="cuda", generator=gen, dtype=torch.int32)
    prefix[0] = 0  # no prefix: plain causal
    lengths = prefix.long()
    run_and_check(q, k, v, {"mask_mod": lambda bb, hh, i, j: (j <= i) | (j < lengths[bb])}, prefix_lengths=prefix)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_relative_position_bias_in_a_causal_window(shape):
    """A learned-looking bias per head and distance, (1, h, s, s) expanded over the batch."""
    b, s, hq, hkv = shape
    q, k, v = inputs(b, s, hq, hkv, 128, seed=s + 2)
    gen = torch.Generator(device="cuda").manual_seed(s + 3)
    per_distance = torch.randn(hq, 2 * s - 1, device="cuda", generator=gen)
    distance = torch.arange(s, device="cuda")[:, None] - torch.arange(s, device="cuda")[None, :] + s - 1
    bias = per_distance[:, distance].unsqueeze(0).expand(b, -1, -1, -1)  # stride 0 over the batch
    window = (300, 0)
    run_and_check(q, k, v, {"score_mod": lambda score, bb, hh, i, j: score + bias[bb, hh, i, j].double(),
                            "causal": True, "window_size": window}, causal=True, window_size=window, attn_bias=bias)
