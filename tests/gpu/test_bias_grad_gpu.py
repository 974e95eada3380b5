"""The gradient of attn_bias on the GPU (bias_grad backward kernels, through flash_attn_func's
autograd): d(attn_bias) against float64 autograd through the reference, and against torch SDPA's
gradient of the same bias in the same dtype (ours within 2x of its error). Bias shapes that
broadcast over the batch or the heads (the kernel adds their entries into one element), GQA, causal
with seqlen_q != seqlen_k, a window, hdim 256 (the backward that splits the head dim), soft-capping
before the bias and a score_mod after it, bf16 and fp16 biases (bias_dtype; their gradient returned
in their dtype), forwards that stage the bias through shared memory (bias_staging). dq, dk, dv of
the same calls against float64 too."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fa3gen
from fa3gen import KernelSpec
from fa3gen.reference import attention_reference, attention_reference_grads
from gpu_checks import prebuild
from test_fwd_gpu import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

GRAD_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2}  # as the other backward tests
SCALED_BIAS = KernelSpec(head_dim=128, bias=True, score_mod={"expr": "score * gain", "grad": "gain"},
                         params=[{"kind": "scalar", "name": "gain"}])
# (name, b, sq, sk, hq, hkv, d, dtype, bias shape (its batch and head dims), flash_attn_func keywords)
CASES = [
    ("d128_causal_batch_broadcast", 2, 1000, 1000, 4, 2, 128, torch.bfloat16, (1, 4), dict(causal=True)),
    # 1001 fp32 keys: rows not 16-byte aligned, so hdim 128's default reads the bias in registers
    # (aligned, the other hdim 128 cases stage it through shared memory).
    ("d128_causal_sq_ne_sk", 2, 300, 1001, 4, 1, 128, torch.bfloat16, (2, 4), dict(causal=True)),
    ("d64_full", 3, 113, 517, 8, 2, 64, torch.bfloat16, (3, 8), {}),
    ("d64_head_broadcast_window", 2, 1000, 1000, 4, 4, 64, torch.float16, (2, 1), dict(causal=True, window_size=(200, 0))),
    ("d256_causal", 1, 700, 700, 2, 2, 256, torch.bfloat16, (1, 2), dict(causal=True)),
    ("d96_shared_everywhere", 2, 257, 257, 4, 2, 96, torch.float16, (1, 1), {}),
    # The tile orders follow the dim the bias broadcasts over: (1, h) the batch fastest (the cases
    # above), (b, 1) the heads, (b, h) the query blocks of one (batch, head) (d64_full).
    ("d128_head_broadcast", 3, 500, 640, 4, 2, 128, torch.bfloat16, (3, 1), {}),
    ("d128_softcap", 2, 600, 600, 4, 2, 128, torch.bfloat16, (1, 4), dict(causal=True, softcap=20.0)),
    ("d128_score_mod", 2, 600, 600, 4, 2, 128, torch.bfloat16, (2, 4),
     dict(variant_spec=SCALED_BIAS, variant_params={"gain": 0.75})),
    ("d128_bf16_bias", 2, 1000, 1000, 4, 2, 128, torch.bfloat16, (1, 4), dict(causal=True)),
    ("d64_fp16_bias_window", 2, 777, 1000, 4, 4, 64, torch.float16, (2, 1), dict(causal=True, window_size=(200, 0))),
    # bias_staging (a forward spec of its own): rows of 1301 fp32 / 999 bf16 keys are not 16-byte
    # multiples, so flash_attn_func pads them, and the last key block's cut chunk is copied entry by entry.
    ("d128_staged_causal", 2, 777, 1301, 4, 2, 128, torch.bfloat16, (1, 4),
     dict(causal=True, variant_spec=KernelSpec(head_dim=128, causal=True, bias=True, bias_staging=True))),
    ("d128_bf16_staged", 2, 1000, 999, 4, 2, 128, torch.bfloat16, (2, 4),
     dict(variant_spec=KernelSpec(head_dim=128, bias=True, bias_dtype="bfloat16", bias_staging=True))),
]
# The attn_bias dtype of a case (bias_dtype), float32 where not named: 16-bit biases are read as they are.
BIAS_DTYPES = {"d128_bf16_bias": torch.bfloat16, "d64_fp16_bias_window": torch.float16, "d128_bf16_staged": torch.bfloat16}
_BIAS_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _specs() -> list[KernelSpec]:
    specs = []
    for name, _, _, sk, _, _, d, dtype, _, kw in CASES:
        bias_dtype = BIAS_DTYPES.get(name, torch.float32)
        fwd = kw.get("variant_spec") or fa3gen.default_spec(
            d, d, "bf16" if dtype == torch.bfloat16 else "fp16", kw.get("causal", False),
            window="window_size" in kw, softcap="softcap" in kw, bias=True,
            bias_dtype=_BIAS_DTYPE_NAMES[bias_dtype], bias_rows_aligned=sk * bias_dtype.itemsize % 16 == 0)
        specs += [fwd, fwd.backward_spec(bias_grad=True)]
    return specs


@pytest.fixture(scope="module", autouse=True)
def _built():
    prebuild(_specs())


def _reference_mods(kw: dict) -> dict:
    mods = {"causal": kw.get("causal", False), "window_size": kw.get("window_size", (-1, -1)),
            "softcap": kw.get("softcap", 0.0)}
    if "variant_params" in kw:
        gain = kw["variant_params"]["gain"]
        mods["score_mod"] = lambda score, b, h, i, j: score * gain
    return mods


def _sdpa_bias_grad(q, k, v, dout, base, kw) -> torch.Tensor | None:
    """torch SDPA's gradient of the bias in q's dtype (the math backend), the masks as -inf in its
    attn_mask; None where SDPA cannot express the variant."""
    if "softcap" in kw or "variant_spec" in kw:
        return None
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    i = torch.arange(sq, device="cuda")[:, None] + sk - sq
    j = torch.arange(sk, device="cuda")[None, :]
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device="cuda")
    if kw.get("causal"):
        hidden |= j > i
    left = kw.get("window_size", (-1, -1))[0]
    if left >= 0:
        hidden |= j < i - left
    bias = base.detach().to(q.dtype).requires_grad_()
    mask = bias.masked_fill(hidden, float("-inf"))
    group = hq // k.shape[2]
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    (grad,) = torch.autograd.grad(out.transpose(1, 2), bias, dout)
    return grad


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bias_gradient(case):
    name, b, sq, sk, hq, hkv, d, dtype, (bb, bh), kw = case
    gen = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    bias_dtype = BIAS_DTYPES.get(name, torch.float32)
    base = torch.randn(bb, bh, sq, sk, device="cuda", generator=gen).to(bias_dtype).requires_grad_()
    out = fa3gen.flash_attn_func(q, k, v, attn_bias=base, **kw)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen)
    out.backward(dout)
    assert base.grad is not None and base.grad.shape == base.shape and base.grad.dtype == bias_dtype
    assert torch.isfinite(base.grad).all()

    mods = _reference_mods(kw)
    full = (b, hq, sq, sk)
    with torch.enable_grad():
        base64 = base.detach().double().requires_grad_()
        ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), None, attn_bias=base64.expand(full), **mods)
        (ref_grad,) = torch.autograd.grad(ref, base64, dout.double())
    tol = GRAD_TOLERANCE[dtype]
    out_err = rel_err(out, ref.detach())
    assert out_err < tol, f"{name}: out rel err {out_err:.2e}"
    err = rel_err(base.grad, ref_grad)
    assert err < tol, f"{name}: d(attn_bias) rel err {err:.2e} >= {tol:.0e}"
    sdpa = _sdpa_bias_grad(q, k, v, dout, base, kw)
    if sdpa is not None:
        sdpa_err = rel_err(sdpa.float(), ref_grad)
        print(f"{name}: d(attn_bias) rel err {err:.2e}, torch SDPA (math, {dtype}) {sdpa_err:.2e}")
        assert err <= 2 * sdpa_err, f"{name}: d(attn_bias) rel err {err:.2e} > 2x SDPA's {sdpa_err:.2e}"

    grads = attention_reference_grads(q.detach(), k.detach(), v.detach(), dout, None, attn_bias=base.detach().expand(full), **mods)
    for gname, g, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads):
        gerr = rel_err(g, r)
        assert gerr < tol, f"{name}: {gname} rel err {gerr:.2e}"


def test_bias_gradient_adds_into_zeros_each_call():
    """Each backward adds into its own zeroed buffer (a reused one would carry the last call's
    gradient): two identical calls leave .grad at twice the first, as torch accumulates it."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    base = torch.randn(1, 2, 256, 256, device="cuda", generator=gen).requires_grad_()
    dout = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    fa3gen.flash_attn_func(q, k, v, causal=True, attn_bias=base).backward(dout)
    first = base.grad.clone()
    assert float(first.abs().max()) > 0
    fa3gen.flash_attn_func(q, k, v, causal=True, attn_bias=base).backward(dout)
    assert rel_err(base.grad, 2 * first.double()) < 1e-5
    assert math.isfinite(float(base.grad.sum()))
