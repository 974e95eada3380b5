"""GPU tests of the backward kernels on a Hopper GPU (skipped elsewhere).

Accuracy criterion, test_fwd_gpu.py's applied to each gradient: against the float64 gradients of
the same (low-precision) inputs (``attention_reference_grads``), for each of dq, dk, dv
    ‖g − ref‖ / ‖ref‖  ≤  2 · (the same error of torch SDPA's gradient, same dtype, same inputs) + floor
with floor = 0.5 · eps(dtype) (the rounding of fa3gen's gradient to the dtype, which the GQA
baseline below does not pay: its per-head sums are taken in float64). SDPA runs on a fused backend (flash, mem-efficient, cuDNN) when one
takes the case, math otherwise. Its causal mask is top-left aligned, fa3gen's bottom-right: with
seqlen_q != seqlen_k it gets the bottom-right mask as an explicit boolean attn_mask, and the query
rows that see no key (SDPA would give NaN there; their dq is 0 and they add nothing to dk, dv) are
left out of its problem. GQA: SDPA gets k, v repeated per query head and its dk, dv are summed over
each group in float64, so the baseline is its kernel's rounding alone.

Every case uses fresh randn inputs; the kernels write into NaN-poisoned dq, dk, dv (``_launch_bwd``),
so an unwritten element shows.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa3gen
from fa3gen import ops
from fa3gen.ops import flash_attn_func
from fa3gen.reference import attention_reference_grads, causal_mask
from gpu_checks import prebuild, reference_gradient_is_zero
from test_fwd_gpu import DTYPES, EPS, make_inputs, rel_err


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU"),
]

HEAD_DIMS = (64, 96, 128, 192, 256)
SEQ_PAIRS = [(1, 1), (64, 64), (113, 113), (128, 300), (300, 128), (1000, 1000), (517, 1031), (1031, 517),
             (1, 777), (777, 1), (2049, 2049)]
HEADS = [(1, 1), (4, 1), (6, 2), (8, 2), (3, 3)]  # (nheads_q, nheads_kv)
LAYOUTS = ["contiguous", "packed", "strided_heads", "bhsd"]


def _grid(seed: int = 20251204):
    """Every (head dim, dtype, causal, seqlens) once; heads, layout, batch and deterministic spread
    over them: 220 cases."""
    rng = random.Random(seed)
    out = []
    for i, (d, dt, causal, (sq, sk)) in enumerate(itertools.product(HEAD_DIMS, DTYPES, (False, True), SEQ_PAIRS)):
        hq, hkv = HEADS[i % len(HEADS)]
        layout = LAYOUTS[rng.randrange(len(LAYOUTS))]
        batch = 1 + rng.randrange(3)
        if sq * sk * batch * hq > 2049 * 2049 * 4:  # keep the fp64 reference modest
            batch = 1
        deterministic = i % 3 == 0
        out.append(pytest.param(
            d, dt, causal, sq, sk, batch, hq, hkv, layout, deterministic, i,
            id=f"d{d}-{dt}-{'causal' if causal else 'full'}-sq{sq}-sk{sk}-b{batch}-h{hq}x{hkv}-{layout}"
               f"{'-det' if deterministic else ''}",
        ))
    return out


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def make_dout(b, sq, hq, dv, dtype, layout, gen):
    """The output gradient, in (b, h, s, d) storage for the strided layouts (the kernel takes any
    legal strides for dout too)."""
    if layout in ("bhsd", "strided_heads"):
        return _randn(b, hq, sq, dv, dtype=dtype, gen=gen).transpose(1, 2)
    return _randn(b, sq, hq, dv, dtype=dtype, gen=gen)


def sdpa_grads(q, k, v, dout, scale, causal):
    """torch SDPA's (dq, dk, dv) in float64 (computed in q's dtype), fa3gen's conventions."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    dvv = torch.zeros(v.shape, dtype=torch.float64, device=q.device)
    first = max(0, sq - sk) if causal else 0  # rows before it see no key
    if sk == 0 or first == sq:
        return dq, dk, dvv
    rows = sq - first
    qt = q[:, first:].transpose(1, 2).detach().requires_grad_()
    kt = k.repeat_interleave(group, dim=2).transpose(1, 2).detach().requires_grad_()
    vt = v.repeat_interleave(group, dim=2).transpose(1, 2).detach().requires_grad_()
    dot = dout[:, first:].transpose(1, 2)
    if not causal:
        kwargs = {}
    elif rows == sk:  # top-left == bottom-right
        kwargs = {"is_causal": True}
    else:
        kwargs = {"attn_mask": causal_mask(rows, sk, device=q.device)}

    def grads():
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **kwargs)
        return torch.autograd.grad(o, (qt, kt, vt), dot)

    try:  # a fused backend (rounds like fa3gen's kernels); torch's math SDPA computes in fp32
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.CUDNN_ATTENTION]):
            gq, gk, gv = grads()
    except RuntimeError:
        gq, gk, gv = grads()
    dq[:, first:] = gq.transpose(1, 2).double()
    dk = gk.transpose(1, 2).double().reshape(b, sk, hkv, group, d).sum(dim=3)
    dvv = gv.transpose(1, 2).double().reshape(b, sk, hkv, group, dv).sum(dim=3)
    return dq, dk, dvv


def check_grads(q, k, v, dout, scale, causal, dt, grads):
    """dq, dk, dv finite, exactly 0 where no key is seen, and within the SDPA-relative bound."""
    sq, sk = q.shape[1], k.shape[1]
    for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype and g.device == like.device, name
        assert torch.isfinite(g).all(), f"{name} has NaN/inf (unwritten or bad elements)"
    if causal and sq > sk:
        assert (grads[0][:, :sq - sk] == 0).all(), "rows that see no key must have dq exactly 0"
    ref = attention_reference_grads(q, k, v, dout, scale, causal)
    base = sdpa_grads(q, k, v, dout, scale, causal)
    # Rounding a gradient to the dtype alone costs up to eps/2 per element: SDPA can land on ~0
    # where one key per row makes dv a copy of dO (it rounds once, fa3gen's P·dO in fp32 too, but
    # from P = exp(s − lse) within an fp32 ulp of 1), so the floor is that rounding, not 0.1 eps.
    floor = 0.5 * EPS[dt]
    errs = {}
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref, base):
        if reference_gradient_is_zero(name, g, r, EPS[dt]):
            continue
        err, sdpa_err = rel_err(g, r), rel_err(s, r)
        assert err <= 2 * sdpa_err + floor, \
            f"{name}: rel err {err:.3e} > 2 x SDPA's {sdpa_err:.3e} + {floor:.1e} (q {tuple(q.shape)}, k {tuple(k.shape)})"
        errs[name] = (err, sdpa_err)
    return errs


def poisoned_bwd(dout, q, k, v, scale, causal, deterministic):
    """fa3gen's forward, then the backward kernels into NaN-filled dq, dk, dv."""
    out, lse = ops._forward_impl(q, k, v, scale, causal)
    dq, dk, dv = (torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in (q, k, v))
    ops._launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, deterministic)
    torch.cuda.synchronize()
    return (dq, dk, dv), out, lse


@pytest.fixture(scope="module", autouse=True)
def _prebuilt_kernels(request):
    """Build (or load) the kernels of this module's selected parametrized tests once, in parallel,
    before them (so a -k selection builds only its own); the others compile theirs on first use."""
    specs = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is not request.module or "d" not in params:
            continue
        d, dt, causal = params["d"], params.get("dt", "bf16"), params.get("causal", False)
        deterministic = params.get("deterministic", item.originalname == "test_deterministic_is_bit_identical")
        specs += [fa3gen.default_spec(d, d, dt, causal), fa3gen.default_bwd_spec(d, d, dt, causal, deterministic)]
        if item.originalname == "test_persistent_and_grid_schedulers_agree":
            specs += [fa3gen.KernelSpec(kind="bwd", head_dim=d, dtype=dt, causal=causal, deterministic=deterministic,
                                        scheduler=sched) for sched in ("grid", "lpt")]
    prebuild(specs)


@pytest.mark.parametrize("d, dt, causal, sq, sk, b, hq, hkv, layout, deterministic, seed", _grid())
def test_bwd_matches_reference(d, dt, causal, sq, sk, b, hq, hkv, layout, deterministic, seed):
    gen = torch.Generator(device="cuda").manual_seed(5000 + seed)
    q, k, v = make_inputs(b, sq, sk, hq, hkv, d, d, DTYPES[dt], layout, gen)
    dout = make_dout(b, sq, hq, d, DTYPES[dt], layout, gen)
    scale = 1.0 / math.sqrt(d) if seed % 4 else 0.7 / math.sqrt(d)
    grads, out, lse = poisoned_bwd(dout, q, k, v, scale, causal, deterministic)
    check_grads(q, k, v, dout, scale, causal, dt, grads)
    # the op's own allocation path: dk and dv come from one CTA each (no reduction), so they are the
    # same bits; dq too when deterministic
    again = ops._backward_impl(dout, q, k, v, out, lse, scale, causal, deterministic)
    torch.cuda.synchronize()
    for name, g, h in zip(("dq", "dk", "dv"), grads, again):
        if name == "dq" and not deterministic:
            torch.testing.assert_close(h, g, rtol=2 * EPS[dt], atol=2 * EPS[dt] * float(g.abs().max()))
        else:
            assert torch.equal(h, g), f"{name} differs between two launches"


# The persistent backward (scheduler "lpt", the default up to hdim 192) against one CTA per key
# block ("grid"): both run each key block's arithmetic in the same order, so dk and dv (one CTA
# each, no reduction) are the same bits, and dq too when deterministic. More key blocks than SMs,
# ragged lengths, GQA, and key blocks that no query sees (causal, seqlen_k > seqlen_q).
SCHEDULER_CASES = [
    # d, dt, causal, deterministic, b, sq, sk, hq, hkv
    (64, "bf16", True, False, 2, 2049, 2049, 6, 2),
    (64, "fp16", False, True, 3, 1031, 517, 4, 4),
    (96, "bf16", True, True, 1, 777, 2049, 4, 1),
    (128, "bf16", False, False, 2, 1000, 4100, 8, 2),
    (128, "fp16", True, True, 4, 517, 1031, 3, 3),
    (192, "fp16", True, True, 2, 1031, 777, 4, 2),
    (256, "bf16", True, False, 2, 1031, 1031, 4, 2),
]
# K and V held in registers for Sᵀ and dPᵀ (kv_registers) against read from shared memory at every
# step: the same products in the same order, so the same bits (dq too when deterministic).
KV_REGISTER_CASES = [
    # d, dt, causal, deterministic, b, sq, sk, hq, hkv
    (64, "bf16", False, False, 2, 1031, 1031, 4, 2),
    (64, "bf16", True, True, 1, 2049, 2049, 6, 2),
    (64, "fp16", True, False, 3, 517, 1031, 4, 4),
    (64, "fp16", False, True, 2, 960, 300, 2, 1),
]

# Each step's dQ issued in the next step (dq_deferred) against in its own: the same GEMMs on the
# same operands, so the same bits. Steps that cross heads (GQA), one step per key block (its dQ only
# after the loop), key blocks with no steps (causal, seqlen_k > seqlen_q), deterministic.
DQ_DEFERRED_CASES = [
    # d, dt, causal, deterministic, b, sq, sk, hq, hkv
    (64, "bf16", True, False, 2, 2049, 2049, 6, 2),
    (64, "fp16", False, True, 3, 1031, 517, 4, 4),
    (64, "fp16", True, False, 1, 40, 300, 2, 2),
    (96, "bf16", True, True, 1, 777, 2049, 4, 1),
    (128, "bf16", False, False, 2, 1000, 4100, 8, 2),
]


# Each step's dQ in one warpgroup over the whole head dim (dq_single_warpgroup) against both
# warpgroups' halves: the same dot products, so the same dk and dv bits. Odd and even step counts
# per key block (the warpgroups take turns by step, and the dQ buffers by tile), steps across heads,
# one step or none per key block, several key blocks per persistent CTA, deterministic.
DQ_SINGLE_WARPGROUP_CASES = [
    # d, dt, causal, deterministic, b, sq, sk, hq, hkv
    (64, "bf16", True, False, 2, 2049, 2049, 6, 2),
    (64, "fp16", False, True, 3, 1031, 517, 4, 4),
    (64, "fp16", True, False, 1, 40, 300, 2, 2),
    (64, "bf16", False, False, 4, 130, 5000, 4, 2),
    (96, "bf16", True, True, 1, 777, 2049, 4, 1),
    (128, "bf16", False, True, 2, 1000, 4100, 8, 2),  # at the step's end (hdim 128 does not defer it)
]


# field -> (its values whose kernels must agree, the cases); scripts/gpu_specs.py prebuilds them.
AGREEMENTS = {"scheduler": (("lpt", "grid"), SCHEDULER_CASES), "kv_registers": ((True, False), KV_REGISTER_CASES),
              "dq_deferred": ((True, False), DQ_DEFERRED_CASES),
              "dq_single_warpgroup": ((True, False), DQ_SINGLE_WARPGROUP_CASES)}


def agreement_spec(field, value, d, dt, causal, deterministic):
    return fa3gen.KernelSpec(kind="bwd", head_dim=d, dtype=dt, causal=causal, deterministic=deterministic,
                             **{field: value})


def assert_same_gradients(field, seed, d, dt, causal, deterministic, b, sq, sk, hq, hkv):
    """The backward kernels that differ only in `field` (AGREEMENTS; the first value's checked
    against float64) give the same dk and dv bits, and dq too when deterministic (else equal
    within rounding)."""
    values = AGREEMENTS[field][0]
    kernels = [fa3gen.compile(agreement_spec(field, value, d, dt, causal, deterministic)) for value in values]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = make_inputs(b, sq, sk, hq, hkv, d, d, DTYPES[dt], "contiguous", gen)
    dout = make_dout(b, sq, hq, d, DTYPES[dt], "contiguous", gen)
    scale = 1.0 / math.sqrt(d)
    out, lse = ops._forward_impl(q, k, v, scale, causal)
    grads = []
    for kernel in kernels:
        dq, dk, dv = (torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in (q, k, v))
        ops._launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, deterministic, kernel)
        torch.cuda.synchronize()
        grads.append((dq, dk, dv))
    check_grads(q, k, v, dout, scale, causal, dt, grads[0])
    for name, g, h in zip(("dq", "dk", "dv"), *grads):
        if name == "dq" and not deterministic:
            torch.testing.assert_close(g, h, rtol=2 * EPS[dt], atol=2 * EPS[dt] * float(h.abs().max()))
        else:
            assert torch.equal(g, h), f"{name} differs between {field}={values[0]} and {field}={values[1]}"


@pytest.mark.parametrize("d, dt, causal, deterministic, b, sq, sk, hq, hkv", SCHEDULER_CASES)
def test_persistent_and_grid_schedulers_agree(d, dt, causal, deterministic, b, sq, sk, hq, hkv):
    assert_same_gradients("scheduler", 7000 + d + sq, d, dt, causal, deterministic, b, sq, sk, hq, hkv)


@pytest.mark.parametrize("d, dt, causal, deterministic, b, sq, sk, hq, hkv", KV_REGISTER_CASES)
def test_kv_registers_agree(d, dt, causal, deterministic, b, sq, sk, hq, hkv):
    assert_same_gradients("kv_registers", 9100 + sq, d, dt, causal, deterministic, b, sq, sk, hq, hkv)


@pytest.mark.parametrize("d, dt, causal, deterministic, b, sq, sk, hq, hkv", DQ_DEFERRED_CASES)
def test_dq_deferred_agrees(d, dt, causal, deterministic, b, sq, sk, hq, hkv):
    assert_same_gradients("dq_deferred", 9300 + sq, d, dt, causal, deterministic, b, sq, sk, hq, hkv)


@pytest.mark.parametrize("d, dt, causal, deterministic, b, sq, sk, hq, hkv", DQ_SINGLE_WARPGROUP_CASES)
def test_dq_single_warpgroup_agrees(d, dt, causal, deterministic, b, sq, sk, hq, hkv):
    assert_same_gradients("dq_single_warpgroup", 9500 + sq, d, dt, causal, deterministic, b, sq, sk, hq, hkv)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, sq, sk, hq, hkv, d, dt", [(2, 2048, 2048, 8, 2, 128, "bf16"),
                                                        (1, 1000, 3001, 6, 2, 64, "fp16"),
                                                        (2, 1537, 1024, 4, 4, 96, "bf16"),
                                                        (1, 1100, 2000, 4, 2, 256, "bf16"),
                                                        (1, 2048, 1500, 2, 1, 192, "fp16")])
def test_deterministic_is_bit_identical(causal, b, sq, sk, hq, hkv, d, dt):
    """deterministic=True: ten runs give the same bits (several key blocks add to every dQ row)."""
    gen = torch.Generator(device="cuda").manual_seed(77)
    q, k, v = make_inputs(b, sq, sk, hq, hkv, d, d, DTYPES[dt], "contiguous", gen)
    dout = make_dout(b, sq, hq, d, DTYPES[dt], "contiguous", gen)
    scale = 1 / math.sqrt(d)
    first, out, lse = poisoned_bwd(dout, q, k, v, scale, causal, True)
    check_grads(q, k, v, dout, scale, causal, dt, first)
    for run in range(10):
        grads = ops._backward_impl(dout, q, k, v, out, lse, scale, causal, True)
        torch.cuda.synchronize()
        for name, g, f in zip(("dq", "dk", "dv"), grads, first):
            assert torch.equal(g, f), f"run {run}: {name} is not bit-identical"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "packed"])
def test_autograd_through_flash_attn_func(deterministic, layout):
    """requires_grad inputs (views of one packed leaf for "packed"), an expanded output gradient."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    b, s, hq, hkv, d = 2, 777, 6, 2, 128
    if layout == "packed":  # q, k, v: views of one leaf (b, s, hq + 2 hkv, d)
        leaf = _randn(b, s, hq + 2 * hkv, d, dtype=torch.bfloat16, gen=gen).requires_grad_()
        q, k, v = leaf[:, :, :hq], leaf[:, :, hq:hq + hkv], leaf[:, :, hq + hkv:]
    else:
        q, k, v = (t.requires_grad_() for t in make_inputs(b, s, s, hq, hkv, d, d, torch.bfloat16, layout, gen))
    w = torch.randn(1, 1, hq, d, device="cuda", generator=gen)
    out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    (out.float() * w).sum().backward()  # out's gradient: w expanded (strides 0), cast to bf16
    dout = w.expand(b, s, hq, d).to(torch.bfloat16)
    if layout == "packed":
        g = leaf.grad
        grads = (g[:, :, :hq], g[:, :, hq:hq + hkv], g[:, :, hq + hkv:])
    else:
        grads = (q.grad, k.grad, v.grad)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    check_grads(qd, kd, vd, dout, 1 / math.sqrt(d), True, "bf16", grads)
    if deterministic:  # the same bits as the op on a contiguous copy of the same gradient
        out2, lse2 = ops._forward_impl(qd, kd, vd, 1 / math.sqrt(d), True)
        direct = ops._backward_impl(dout.contiguous(), qd, kd, vd, out2, lse2, 1 / math.sqrt(d), True, True)
        for got, want in zip(grads, direct):
            assert torch.equal(got, want)


def test_autograd_sum_and_gqa_mqa():
    gen = torch.Generator(device="cuda").manual_seed(22)
    for hq, hkv, causal in ((4, 1, False), (6, 2, True)):
        q, k, v = (t.detach().requires_grad_()
                   for t in make_inputs(2, 300, 517, hq, hkv, 64, 64, torch.float16, "contiguous", gen))
        flash_attn_func(q, k, v, causal=causal).sum().backward()  # out's gradient: an expanded scalar
        dout = torch.ones(2, 300, hq, 64, device="cuda", dtype=torch.float16)
        check_grads(q.detach(), k.detach(), v.detach(), dout, 1 / 8, causal, "fp16", (q.grad, k.grad, v.grad))


def test_torch_compile_forward_and_backward():
    gen = torch.Generator(device="cuda").manual_seed(23)
    q, k, v = (t.detach().requires_grad_()
               for t in make_inputs(2, 333, 500, 8, 4, 64, 64, torch.bfloat16, "contiguous", gen))
    w = torch.randn(2, 333, 8, 64, device="cuda", generator=gen)

    def f(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() * w).sum()

    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=0, atol=0)
    check_grads(q.detach(), k.detach(), v.detach(), w.to(torch.bfloat16), 1 / 8, True, "bf16", got)


def test_cuda_graph_capture_of_the_backward():
    gen = torch.Generator(device="cuda").manual_seed(24)
    q, k, v = make_inputs(2, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, "contiguous", gen)
    dout = make_dout(2, 1000, 8, 128, torch.bfloat16, "contiguous", gen)
    out, lse = ops._forward_impl(q, k, v, 1 / math.sqrt(128), True)
    ops._backward_impl(dout, q, k, v, out, lse, 1 / math.sqrt(128), True, True)  # compile/load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = ops._backward_impl(dout, q, k, v, out, lse, 1 / math.sqrt(128), True, True)
    for _ in range(2):
        dout.copy_(make_dout(2, 1000, 8, 128, torch.bfloat16, "contiguous", gen))
        graph.replay()
        torch.cuda.synchronize()
        eager = ops._backward_impl(dout, q, k, v, out, lse, 1 / math.sqrt(128), True, True)
        for s, e in zip(static, eager):
            assert torch.equal(s, e)


@pytest.mark.parametrize("b, sq, sk", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_problems(b, sq, sk):
    q = torch.randn(b, sq, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flash_attn_func(q, k, v, causal=True).float().sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_errors_on_gpu():
    dout, q, k, v = (torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = ops._forward_impl(q, k, v, 0.1, False)
    with pytest.raises(ValueError, match="dout is on cpu"):
        ops._backward_impl(dout.cpu(), q, k, v, out, lse, 0.1, False)
    flat = torch.randn(dout.numel() + 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dout's data pointer .* 16-byte aligned"):
        ops._backward_impl(flat[1:1 + dout.numel()].view(dout.shape), q, k, v, out, lse, 0.1, False)
    with pytest.raises(ValueError, match="lse must be contiguous"):
        ops._backward_impl(dout, q, k, v, out, lse.transpose(1, 2).contiguous().transpose(1, 2), 0.1, False)
