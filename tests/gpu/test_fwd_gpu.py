"""GPU tests of the forward kernel on a Hopper GPU (skipped elsewhere).

Accuracy criterion (GUIDE §5): against float64 attention on the same (low-precision) inputs,
    ‖out − ref‖ / ‖ref‖  ≤  2 · (the same error of torch SDPA, same dtype, same inputs) + floor
(SDPA restricted to its fused flash / mem-efficient / cuDNN backends when one accepts the case, since
torch's math backend upcasts to fp32 and is not a same-dtype kernel; math is the fallback)
where floor = 0.1 · eps(dtype) absorbs the cases where both errors are ~0 (e.g. one visible key).
SDPA's causal mask is top-left aligned; fa3gen's is bottom-right, so for seqlen_q != seqlen_k the
SDPA baseline gets the bottom-right mask as an explicit boolean attn_mask (and its fully masked
rows, which SDPA leaves NaN, are zeroed: the reference has 0 there).

Every case uses fresh randn inputs. Outputs are poisoned two ways: (1) NaN-filled blocks of the
output sizes are freed into the caching allocator just before the call, so the op's torch.empty
most likely gets them back; (2) the same kernel is launched again into explicitly NaN-filled
buffers, which must come back bit-identical to (1) (every element written, deterministic).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa3gen import ops
from fa3gen.ops import flash_attn_func
from fa3gen.reference import attention_reference, causal_mask
from gpu_checks import poison_allocator


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU"),
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
EPS = {"fp16": 2.0**-10, "bf16": 2.0**-7}
DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256)]
SEQ_PAIRS = [(1, 1), (17, 17), (113, 113), (1000, 1000), (2049, 2049),
             (113, 1000), (1000, 113), (1, 2049), (2049, 17)]
RATIOS = [1, 2, 4, 8]
LAYOUTS = ["contiguous", "packed", "strided_heads", "bhsd"]


def _grid(seed: int = 20251129, extra: int = 60):
    """Every (dims, dtype, causal, seqlens) once, GQA ratio and layout balanced over them, plus
    `extra` random picks of the full cross product: ~240 cases."""
    rng = random.Random(seed)
    base = list(itertools.product(DIMS, DTYPES, (False, True), SEQ_PAIRS))
    ratios = [RATIOS[i % len(RATIOS)] for i in range(len(base))]
    layouts = [LAYOUTS[i % len(LAYOUTS)] for i in range(len(base))]
    rng.shuffle(ratios)
    rng.shuffle(layouts)
    cases = [(*b, r, lay) for b, r, lay in zip(base, ratios, layouts)]
    full = list(itertools.product(DIMS, DTYPES, (False, True), SEQ_PAIRS, RATIOS, LAYOUTS))
    cases += rng.sample(full, extra)
    out = []
    for i, ((d, dv), dt, causal, (sq, sk), ratio, layout) in enumerate(cases):
        batch = 1 + rng.randrange(3)
        hkv = rng.choice((1, 2))
        if sq * sk * batch * ratio * hkv > 2049 * 2049 * 8:  # keep the fp64 reference modest
            batch = 1
        out.append(pytest.param(
            d, dv, dt, causal, sq, sk, batch, ratio * hkv, hkv, layout, i,
            id=f"d{d}-{dt}-{'causal' if causal else 'full'}-sq{sq}-sk{sk}-b{batch}-"
               f"h{ratio * hkv}x{hkv}-{layout}-{i}",
        ))
    return out


def _randn(*shape, dtype, gen):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def make_inputs(b, sq, sk, hq, hkv, d, dv, dtype, layout, gen):
    """q, k, v in the requested memory layout (all valid for the kernel)."""
    if layout == "packed" and d == dv:
        if sq == sk and hq == hkv:  # FA's packed qkv: (b, s, 3, h, d)
            qkv = _randn(b, sq, 3, hq, d, dtype=dtype, gen=gen)
            return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if sq == sk:  # GQA packing along heads: (b, s, hq + 2 hkv, d)
            qkv = _randn(b, sq, hq + 2 * hkv, d, dtype=dtype, gen=gen)
            return qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
        kv = _randn(b, sk, 2, hkv, d, dtype=dtype, gen=gen)  # packed kv
        return _randn(b, sq, hq, d, dtype=dtype, gen=gen), kv[:, :, 0], kv[:, :, 1]
    if layout == "strided_heads":  # every other head of a row-padded buffer
        def strided(s, h, dd):
            return _randn(b, s, 2 * h, dd + 16, dtype=dtype, gen=gen)[:, :, ::2, :dd]
        return strided(sq, hq, d), strided(sk, hkv, d), strided(sk, hkv, dv)
    if layout == "bhsd":  # (b, h, s, d) storage seen as (b, s, h, d)
        return (_randn(b, hq, sq, d, dtype=dtype, gen=gen).transpose(1, 2),
                _randn(b, hkv, sk, d, dtype=dtype, gen=gen).transpose(1, 2),
                _randn(b, hkv, sk, dv, dtype=dtype, gen=gen).transpose(1, 2))
    return (_randn(b, sq, hq, d, dtype=dtype, gen=gen), _randn(b, sk, hkv, d, dtype=dtype, gen=gen),
            _randn(b, sk, hkv, dv, dtype=dtype, gen=gen))


def visible_rows(sq: int, sk: int, causal: bool) -> torch.Tensor:
    """Bool (sq,): True where the query row sees at least one key (bottom-right causal)."""
    i = torch.arange(sq, device="cuda")
    if sk == 0:
        return torch.zeros(sq, dtype=torch.bool, device="cuda")
    return i + (sk - sq) >= 0 if causal else torch.ones(sq, dtype=torch.bool, device="cuda")


def sdpa_out(q, k, v, scale, causal):
    """torch SDPA (a fused backend if one takes the case, else the default) in q's dtype, fa3gen's conventions: GQA, bottom-right causal."""
    sq, hq, sk, hkv = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    kk = k.repeat_interleave(hq // hkv, dim=2) if hq != hkv else k
    vv = v.repeat_interleave(hq // hkv, dim=2) if hq != hkv else v
    qt, kt, vt = (x.transpose(1, 2) for x in (q, kk, vv))
    if not causal:
        kwargs = {}
    elif sq == sk:  # top-left == bottom-right
        kwargs = {"is_causal": True}
    else:
        kwargs = {"attn_mask": causal_mask(sq, sk, device=q.device)}
    try:  # a fused backend (rounds P to q's dtype like fa3gen); torch's math SDPA computes in fp32
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **kwargs)
    except RuntimeError:
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **kwargs)
    o = o.transpose(1, 2)
    vis = visible_rows(sq, sk, causal)
    return torch.where(vis[None, :, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    num = torch.linalg.vector_norm(x.double() - ref)
    den = torch.linalg.vector_norm(ref)
    return float(num / den) if den > 0 else float(num)


def check_against_reference(q, k, v, scale, causal, dt_name):
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    dtype = q.dtype
    ref_out, ref_lse = attention_reference(q, k, v, scale, causal)

    poison_allocator(((b, sq, hq, dv), dtype), ((b, hq, sq), torch.float32))
    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype and out.device == q.device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32

    vis = visible_rows(sq, sk, causal)
    assert torch.isfinite(out).all(), "out has NaN/inf (unwritten or bad rows)"
    lse_vis = lse[:, :, vis]
    assert torch.isfinite(lse_vis).all(), "lse of rows with visible keys is not finite"
    if (~vis).any():
        assert (out[:, ~vis] == 0).all(), "fully masked rows must have out exactly 0"
        assert torch.isneginf(lse[:, :, ~vis]).all(), "fully masked rows must have lse exactly -inf"

    err = rel_err(out, ref_out)
    base = rel_err(sdpa_out(q, k, v, scale, causal), ref_out)
    floor = 0.1 * EPS[dt_name]
    assert err <= 2 * base + floor, f"rel err {err:.3e} > 2 x SDPA's {base:.3e} + {floor:.1e}"

    ref_lse_vis = ref_lse[:, :, vis]
    lse_err = ((lse_vis.double() - ref_lse_vis).abs() / ref_lse_vis.abs().clamp_min(1.0)).max() \
        if lse_vis.numel() else torch.tensor(0.0)
    assert float(lse_err) <= 1e-3, f"lse rel err {float(lse_err):.3e}"

    # explicitly poisoned buffers: every element written, same bits as the op's result
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    ops._launch(q, k, v, out2, lse2, scale, causal)
    torch.cuda.synchronize()
    assert torch.equal(out2, out), "kernel left elements unwritten or is not deterministic"
    assert torch.equal(lse2, lse), "kernel left lse unwritten or is not deterministic"
    return err, base


@pytest.fixture(scope="module", autouse=True)
def _prebuilt_kernels():
    """Build (or load) every registry kernel once, in parallel, before the grid (with the
    query-length ones of registry.SEQLEN_TILES)."""
    import fa3gen
    from gpu_checks import prebuild

    prebuild([spec for spec in fa3gen.REGISTRY.values() if spec.kind == "fwd" and spec.dtype in DTYPES])


@pytest.mark.parametrize("d, dv, dt, causal, sq, sk, b, hq, hkv, layout, seed", _grid())
def test_fwd_matches_reference(d, dv, dt, causal, sq, sk, b, hq, hkv, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    q, k, v = make_inputs(b, sq, sk, hq, hkv, d, dv, DTYPES[dt], layout, gen)
    scale = 1.0 / math.sqrt(d) if seed % 3 else 0.7 / math.sqrt(d)
    check_against_reference(q, k, v, scale, causal, dt)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_large_many_tiles(dt, causal):
    """Enough tiles and heads to fill the GPU several times (exercises the scheduler)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = make_inputs(2, 4096, 4096, 16, 4, 128, 128, DTYPES[dt], "contiguous", gen)
    check_against_reference(q, k, v, 1 / math.sqrt(128), causal, dt)


@pytest.mark.parametrize("d, causal", sorted(__import__("fa3gen").registry.SEQLEN_TILES))
def test_fwd_short_and_long_queries_pick_their_tiles(d, causal):
    """Query lengths at and past each registry limit (SEQLEN_TILES) run the tiles of their bucket,
    through flash_attn_func; all against float64, with several tiles per CTA."""
    import fa3gen
    from fa3gen.registry import SEQLEN_TILES, _bucket_fields

    tiers = SEQLEN_TILES[(d, causal)]
    gen = torch.Generator(device="cuda").manual_seed(9)
    for sq in sorted({n for _, limit, _ in tiers if limit is not None for n in (limit, limit + 1)}):
        bucket = fa3gen.registry.seqlen_bucket(d, causal, sq)
        spec = fa3gen.default_spec(d, d, "bf16", causal, seqlen_q=sq)
        assert all(getattr(spec, f) == value for f, value in _bucket_fields(tiers, bucket).items())
        q, k, v = make_inputs(8, sq, 1500, 2048 // d, 4, d, d, torch.bfloat16, "contiguous", gen)
        check_against_reference(q, k, v, 1 / math.sqrt(d), causal, "bf16")
        assert ops._KERNELS[(d, d, "bf16", causal, False, False, False, bucket)].spec == spec


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_fwd_causal_lpt_several_l2_groups(dt):
    """75 (batch, head) pairs, 5 query heads per 2 MB K/V head: the causal lpt scheduler splits
    them into L2 groups (about 60 query heads on an H100/H200) with a short last group; ragged
    query blocks, sq < sk."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = make_inputs(3, 3001, 4096, 25, 5, 128, 128, DTYPES[dt], "contiguous", gen)
    check_against_reference(q, k, v, 1 / math.sqrt(128), True, dt)


def test_lpt_tile_counter_between_launches():
    """The causal (lpt) kernels share one tile counter per stream, which each launch leaves zeroed:
    back-to-back launches with different tile counts on one stream, and launches on two streams at
    once, each with its own counter, must all compute every tile. Nothing synchronizes between
    the launches; each writes into NaN-poisoned outputs."""
    from gpu_checks import check_poisoned_outputs

    gen = torch.Generator(device="cuda").manual_seed(21)
    problems = [(2, 1000, 1000, 8, 2), (1, 300, 4100, 16, 4), (3, 2048, 2048, 4, 4), (1, 64, 64, 2, 1)]
    inputs = [make_inputs(b, sq, sk, hq, hkv, 128, 128, torch.bfloat16, "contiguous", gen)
              for b, sq, sk, hq, hkv in problems]
    scale = 1 / math.sqrt(128)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    launched = []
    for round_ in range(3):
        for i, (q, k, v) in enumerate(inputs):
            with torch.cuda.stream(streams[(i + round_) % 2]):
                b, sq, hq, _ = q.shape
                out = torch.full((b, sq, hq, 128), float("nan"), device="cuda", dtype=q.dtype)
                lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
                ops._launch(q, k, v, out, lse, scale, True)
                launched.append((i, out, lse))
    torch.cuda.synchronize()
    references = [attention_reference(q, k, v, scale, True) for q, k, v in inputs]
    for i, out, lse in launched:
        ref, ref_lse = references[i]
        check_poisoned_outputs(out, lse, ref, ref_lse, 1e-2, 1e-3, f"problem {problems[i]}")


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_signature_runs_from_its_plan(causal):
    """Calls of one signature after the first launch from its plan (fa3gen.launch) with their own
    pointers: every call is right for its own inputs, into outputs of its own; a view whose pointer
    is not 16-byte aligned still gets the alignment error."""
    from gpu_checks import check_poisoned_outputs

    from fa3gen import launch

    gen = torch.Generator(device="cuda").manual_seed(22)
    shape = (2, 700, 900, 8, 2)
    calls = [make_inputs(*shape, 128, 128, torch.bfloat16, "contiguous", gen) for _ in range(3)]
    results = []
    for q, k, v in calls:
        poison_allocator(((2, 700, 8, 128), torch.bfloat16), ((2, 8, 700), torch.float32))
        results.append(flash_attn_func(q, k, v, causal=causal, return_lse=True))
    assert launch.plan_for(launch.plan_key(*calls[0], None, causal, (-1, -1), 0.0, None)) is not None
    assert len({out.data_ptr() for out, _ in results}) == 3
    torch.cuda.synchronize()
    for (q, k, v), (out, lse) in zip(calls, results):
        ref, ref_lse = attention_reference(q, k, v, 1 / math.sqrt(128), causal)
        check_poisoned_outputs(out, lse, ref, ref_lse, 1e-2, 1e-3, f"causal={causal}")
    q, k, v = calls[0]
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    shifted = flat[1:1 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        flash_attn_func(shifted, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_dependent_launches_read_the_previous_output(causal):
    """Forward kernels launch as programmatic dependents (spec.programmatic_launch): a call's CTAs
    may start while the previous kernel still runs, and must not read its inputs before that kernel
    has completed. A chain of calls, each taking the previous call's O as its Q, with no sync
    between them: every O lands in a NaN-poisoned block, so a call that read its Q early would
    see NaN; each call is checked against float64 attention of the O it was given."""
    from gpu_checks import check_poisoned_outputs

    gen = torch.Generator(device="cuda").manual_seed(23)
    b, s, h, d = 4, 2048, 16, 128
    q, k, v = make_inputs(b, s, s, h, h, d, d, torch.bfloat16, "contiguous", gen)
    scale = 1.0  # peaked rows: each O is near one V row, unit-scale like the first Q
    chain = [(q, None)]
    for _ in range(4):
        poison_allocator(((b, s, h, d), torch.bfloat16), ((b, h, s), torch.float32))
        chain.append(flash_attn_func(chain[-1][0], k, v, softmax_scale=scale, causal=causal, return_lse=True))
    torch.cuda.synchronize()
    for step, ((given, _), (out, lse)) in enumerate(zip(chain, chain[1:])):
        ref, ref_lse = attention_reference(given, k, v, scale, causal)
        check_poisoned_outputs(out, lse, ref, ref_lse, 1e-2, 1e-3, f"step {step}")


def test_fwd_head_dim_v_differs():
    import fa3gen

    try:
        fa3gen.default_spec(192, 128, "bf16", False)
    except ValueError as e:
        pytest.skip(f"no spec for head_dim 192 / head_dim_v 128: {e}")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for causal in (False, True):
        q, k, v = make_inputs(2, 300, 517, 4, 2, 192, 128, torch.bfloat16, "contiguous", gen)
        check_against_reference(q, k, v, 1 / math.sqrt(192), causal, "bf16")


def test_default_scale_and_return_types():
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = make_inputs(1, 77, 77, 2, 2, 64, 64, torch.bfloat16, "contiguous", gen)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    out2, lse = flash_attn_func(q, k, v, softmax_scale=1 / 8, return_lse=True)
    assert torch.equal(out, out2) and lse.dtype == torch.float32


def test_inputs_requiring_grad_run_forward():
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = make_inputs(1, 64, 64, 2, 2, 128, 128, torch.float16, "contiguous", gen)
    out = flash_attn_func(q.requires_grad_(), k, v)
    ref, _ = attention_reference(q.detach(), k, v)
    assert rel_err(out.detach(), ref) < 1e-2


@pytest.mark.parametrize("b, sq, sk", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_problems(b, sq, sk):
    q = torch.randn(b, sq, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert out.shape == (b, sq, 4, 64) and lse.shape == (b, 4, sq)
    if sk == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_cuda_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = make_inputs(2, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, "contiguous", gen)
    flash_attn_func(q, k, v, causal=True)  # compile/load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static, lse_static = flash_attn_func(q, k, v, causal=True, return_lse=True)
    for step in range(2):
        q2, k2, v2 = make_inputs(2, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, "contiguous", gen)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        out, lse = flash_attn_func(q2, k2, v2, causal=True, return_lse=True)
        assert torch.equal(out_static, out) and torch.equal(lse_static, lse)


def test_torch_compile_fullgraph():
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = make_inputs(2, 333, 500, 8, 4, 64, 64, torch.float16, "packed", gen)

    def f(q, k, v):
        o, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        return o.float() * 2 + 1, lse.exp()

    compiled = torch.compile(f, fullgraph=True)
    got, want = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)


def test_runs_on_current_stream():
    """Inputs are written on a side stream after a long sleep; the op on that stream must see them."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = make_inputs(1, 512, 512, 4, 4, 128, 128, torch.bfloat16, "contiguous", gen)
    flash_attn_func(q, k, v)  # warm
    q_new = torch.randn_like(q)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write
        q.copy_(q_new)
        out = flash_attn_func(q, k, v)
    side.synchronize()
    ref, _ = attention_reference(q_new, k, v)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_device():
    gen = torch.Generator(device="cuda:1").manual_seed(9)
    q, k, v = (torch.randn(1, 100, 2, 64, device="cuda:1", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    out = flash_attn_func(q, k, v)
    assert out.device == q.device
    ref, _ = attention_reference(q, k, v)
    assert rel_err(out, ref) < 1e-2


def test_errors_on_gpu():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float16 and torch.bfloat16"):
        flash_attn_func(q.float(), q.float(), q.float())
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attn_func(q, q.half(), q)
    with pytest.raises(ValueError, match="k is on cpu"):
        flash_attn_func(q, q.cpu(), q)
    with pytest.raises(ValueError, match="head_dim 80"):
        x = torch.randn(1, 8, 2, 80, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(x, x, x)
    flat = torch.randn(q.numel() + 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        flash_attn_func(flat[1:1 + q.numel()].view(q.shape), q, q)
    with pytest.raises(ValueError, match="multiple of 8"):
        y = torch.randn(1, 8, 2, 68, device="cuda", dtype=torch.bfloat16)[..., :64]
        flash_attn_func(y, q, q)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        flash_attn_func(q.transpose(2, 3).contiguous().transpose(2, 3), q, q)
