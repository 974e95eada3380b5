"""CPU tests of the torch face: input validation, fake-tensor shapes, tracing, the reference, bench math.

No GPU here: where a test needs the op to run, it routes the op's implementation to the float64
reference on CPU (monkeypatching ``fa3gen.ops._forward_impl``), which exercises the op's
registration, fake impl and torch.compile path; the kernel itself is tested in tests/gpu.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa3gen import launch, ops
from fa3gen.bench import attn_fwd_flops, bench_cases, _int_list
from fa3gen.reference import attention_reference, causal_mask


def qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=64, dv=None, dtype=torch.bfloat16, device="cpu"):
    dv = d if dv is None else dv
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype, device=device)
    return q, k, v


@pytest.fixture
def cpu_op(monkeypatch):
    """Route the op's real implementation to the reference on CPU (validation kept)."""
    calls = []

    def impl(q, k, v, softmax_scale, causal, kernel=None, variant=ops.NO_VARIANT, meta_checked=False, plan_key=None):
        ops._check_meta(q, k, v)
        calls.append((tuple(q.shape), softmax_scale, causal))
        out, lse = attention_reference(q, k, v, softmax_scale, causal, window_size=variant.window_size,
                                       softcap=variant.softcap, alibi_slopes=variant.alibi_slopes)
        return out.to(q.dtype), lse.to(torch.float32)

    monkeypatch.setattr(ops, "_forward_impl", impl)
    return calls


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

def test_cpu_tensors_rejected_with_clear_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q is on cpu.*CUDA"):
        ops.fwd(q, k, v, 0.125, False)


def test_public_function_rejects_cpu_tensors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="CUDA"):
        ops.flash_attn_func(q, k, v)


def test_same_device_required_on_fake_cuda():
    with FakeTensorMode():
        q = torch.empty(1, 4, 2, 64, dtype=torch.float16, device="cuda:0")
        k = torch.empty(1, 4, 2, 64, dtype=torch.float16, device="cuda:1")
        with pytest.raises(ValueError, match="same device"):
            ops._check_device(q, k, k)


@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_rank_must_be_4(bad):
    t = dict(zip("qkv", qkv()))
    t[bad] = t[bad][0]
    with pytest.raises(ValueError, match=rf"{bad} must have 4 dims"):
        ops.flash_attn_func(t["q"], t["k"], t["v"])


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        ops.flash_attn_func(q, [1, 2], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_dtype_must_be_half(dtype):
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match="float16 and torch.bfloat16"):
        ops.flash_attn_func(q.to(dtype), k.to(torch.float16), v.to(torch.float16))


def test_dtypes_must_match():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        ops.flash_attn_func(q, k.half(), v)


@pytest.mark.parametrize(
    "shapes, msg",
    [
        (dict(q=(2, 5, 4, 64), k=(3, 7, 2, 64), v=(3, 7, 2, 64)), "batch sizes differ"),
        (dict(q=(2, 5, 4, 64), k=(2, 7, 2, 64), v=(2, 8, 2, 64)), "same seqlen"),
        (dict(q=(2, 5, 4, 64), k=(2, 7, 2, 64), v=(2, 7, 1, 64)), "same number of heads"),
        (dict(q=(2, 5, 6, 64), k=(2, 7, 4, 64), v=(2, 7, 4, 64)), r"multiple of nheads_kv \(4\)"),
        (dict(q=(2, 5, 4, 64), k=(2, 7, 2, 128), v=(2, 7, 2, 64)), "same head_dim"),
        (dict(q=(2, 5, 4, 80), k=(2, 7, 2, 80), v=(2, 7, 2, 80)), "head_dim 80 is not supported"),
        (dict(q=(2, 5, 4, 32), k=(2, 7, 2, 32), v=(2, 7, 2, 32)), "head_dim 32 is not supported"),
        (dict(q=(2, 5, 4, 64), k=(2, 7, 2, 64), v=(2, 7, 2, 72)), "head_dim_v 72"),
    ],
)
def test_shape_errors(shapes, msg):
    q, k, v = (torch.empty(shapes[n], dtype=torch.float16, device="meta") for n in "qkv")
    with pytest.raises(ValueError, match=msg):
        ops.flash_attn_func(q, k, v)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_supported_head_dims_pass_meta_checks(d):
    q, k, v = qkv(d=d, device="meta")
    ops._check_meta(q, k, v)


def test_head_dim_v_may_differ():
    q, k, v = qkv(d=192, dv=128, device="meta")
    ops._check_meta(q, k, v)


def test_last_dim_must_be_contiguous():
    q, k, v = qkv()
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, last-dim stride != 1
    with pytest.raises(ValueError, match=r"contiguous in its last dim.*q.contiguous\(\)"):
        ops.flash_attn_func(qt, k, v)


def test_strides_must_be_multiples_of_8():
    q, k, v = qkv()
    big = torch.randn(2, 7, 2, 68, dtype=torch.bfloat16)  # head stride 68: not a multiple of 8
    with pytest.raises(ValueError, match=r"k's head stride 68 is not a multiple of 8"):
        ops.flash_attn_func(q, big[..., :64], v)


def test_strides_multiple_of_8_accepted():
    q, k, v = qkv()
    padded = torch.randn(2, 7, 2, 72, dtype=torch.bfloat16)[..., :64]  # head stride 72
    ops._check_meta(q, padded, v)
    packed = torch.randn(2, 5, 3, 4, 64, dtype=torch.bfloat16)  # packed qkv views
    ops._check_meta(packed[:, :, 0], packed[:, :, 1], packed[:, :, 2])
    bhsd = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16).transpose(1, 2)  # (b, h, s, d) storage
    ops._check_meta(bhsd, bhsd, bhsd)


def test_broadcast_stride_rejected():
    q, k, v = qkv(hkv=1)
    with pytest.raises(ValueError, match="broadcast"):
        ops.flash_attn_func(q, k.expand(2, 7, 4, 64), v.expand(2, 7, 4, 64))


def test_size_one_dims_ignore_strides():
    q = torch.randn(1, 1, 1, 64, dtype=torch.float16).as_strided((1, 1, 1, 64), (3, 5, 7, 1))
    k = torch.randn(1, 3, 1, 64, dtype=torch.float16)
    ops._check_meta(q, k, k)
    # the kernel gets legal packed strides for them
    assert [ops._kernel_stride(q, i) for i in range(3)] == [64, 64, 64]
    t = torch.empty(2, 1, 4, 64, dtype=torch.float16)
    assert [ops._kernel_stride(t, i) for i in range(3)] == [256, 256, 64]


def test_unaligned_pointer_rejected():
    q, k, v = qkv()
    flat = torch.empty(k.numel() + 8, dtype=k.dtype)
    k_off = flat[1 : 1 + k.numel()].view(k.shape)  # 2-byte offset
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops._check_alignment(q, k_off, v)
    k_ok = flat[8 : 8 + k.numel()].view(k.shape)  # 16-byte offset
    if k_ok.data_ptr() % 16 == 0:
        ops._check_alignment(q, k_ok, v)


def test_non_hopper_gpu_named(monkeypatch):
    monkeypatch.setattr(ops, "_GPU_OK", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ops.UnsupportedGPUError, match=r"A100.*capability 8\.0.*Hopper"):
        ops._check_gpu(torch.device("cuda", 0))
    assert issubclass(ops.UnsupportedGPUError, RuntimeError)


def test_hopper_gpu_accepted_and_cached(monkeypatch):
    monkeypatch.setattr(ops, "_GPU_OK", {})
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: seen.append(i) or (9, 0))
    ops._check_gpu(torch.device("cuda", 0))
    ops._check_gpu(torch.device("cuda", 0))
    assert seen == [0]


# ---------------------------------------------------------------------------------------------
# the op: fake impl, empty problems, kernel selection, params
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_tensor_shapes(d, dv, dtype):
    with FakeTensorMode():
        q = torch.empty(3, 17, 8, d, dtype=dtype, device="cuda")
        k = torch.empty(3, 113, 2, d, dtype=dtype, device="cuda")
        v = torch.empty(3, 113, 2, dv, dtype=dtype, device="cuda")
        out, lse = torch.ops.fa3gen.fwd(q, k, v, 0.1, True)
        assert out.shape == (3, 17, 8, dv) and out.dtype == dtype and out.device.type == "cuda"
        assert lse.shape == (3, 8, 17) and lse.dtype == torch.float32 and lse.device.type == "cuda"
        assert out.is_contiguous() and lse.is_contiguous()
        o2, l2 = ops.flash_attn_func(q, k, v, return_lse=True)
        assert o2.shape == out.shape and l2.shape == lse.shape


def test_fake_impl_validates():
    with FakeTensorMode():
        q = torch.empty(1, 4, 3, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(1, 4, 2, 64, dtype=torch.float16, device="cuda")
        with pytest.raises(ValueError, match="multiple of nheads_kv"):
            torch.ops.fa3gen.fwd(q, k, k, 0.1, False)


def test_opcheck(cpu_op):
    q, k, v = qkv(sq=9, sk=13, hq=4, hkv=1)
    torch.library.opcheck(torch.ops.fa3gen.fwd.default, (q, k, v, 0.2, True))


def test_flash_attn_func_defaults_and_return_lse(cpu_op):
    q, k, v = qkv(d=128)
    out = ops.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 4, 128)
    assert cpu_op[-1] == ((2, 5, 4, 128), 1 / math.sqrt(128), False)
    out2, lse = ops.flash_attn_func(q, k, v, softmax_scale=0.5, causal=True, return_lse=True)
    assert lse.shape == (2, 4, 5) and cpu_op[-1][1:] == (0.5, True)


def test_opcheck_with_variants(cpu_op):
    q, k, v = qkv(sq=9, sk=13, hq=4, hkv=1)
    slopes = torch.rand(2, 4)
    torch.library.opcheck(torch.ops.fa3gen.fwd.default, (q, k, v, 0.2, True, 3, -1, 20.0, slopes))


def test_flash_attn_func_passes_variants_to_the_op(cpu_op):
    q, k, v = qkv(sq=9, sk=13, d=64)
    out = ops.flash_attn_func(q, k, v, window_size=(4, 2), softcap=10.0, alibi_slopes=torch.rand(4))
    ref, _ = attention_reference(q, k, v, None, False, window_size=(4, 2), softcap=10.0)
    assert out.shape == ref.shape
    with pytest.raises(ValueError, match="window_size must be two ints"):
        ops.flash_attn_func(q, k, v, window_size=(4, -3))
    with pytest.raises(ValueError, match="softcap must be a number >= 0"):
        ops.flash_attn_func(q, k, v, softcap=-2.0)


def test_torch_compile_fullgraph_with_a_window(cpu_op):
    q, k, v = qkv(sq=6, sk=11)

    def f(q, k, v):
        return ops.flash_attn_func(q * 1, k, v, causal=True, window_size=(3, -1), softcap=5.0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


def test_torch_compile_fullgraph(cpu_op):
    q, k, v = qkv(sq=6, sk=11)

    def f(q, k, v):
        o, lse = ops.flash_attn_func(q * 1, k, v, causal=True, return_lse=True)
        return o.float().sum(-1) + lse.transpose(1, 2)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


class _Recorder:
    def __init__(self):
        self.specs, self.params = [], []

    def compile(self, spec):
        self.specs.append(spec)
        rec = self

        class K:
            workspace_bytes = 16  # like an lpt kernel: _launch must hand it scratch

            def fwd(self, params, stream):
                rec.params.append((params, stream))

        return K()


def _recording_kernels(monkeypatch) -> _Recorder:
    """fa3gen.compile and the registry replaced by a recorder, the device and GPU checks passed for
    CPU tensors, fresh memos: _launch runs through ops and fa3gen.launch down to kernel.fwd."""
    import fa3gen

    rec = _Recorder()
    fake_registry = types.SimpleNamespace(default_spec=lambda *key: ("spec",) + key)
    monkeypatch.setitem(__import__("sys").modules, "fa3gen.registry", fake_registry)
    monkeypatch.setattr(fa3gen, "registry", fake_registry, raising=False)
    monkeypatch.setattr(fa3gen, "compile", rec.compile, raising=False)
    monkeypatch.setattr(ops, "_KERNELS", {})
    monkeypatch.setattr(launch, "_FWD_WORKSPACES", {})
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(ops, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(ops, "_check_gpu", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # "same device" as the CPU tensors
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=1234))
    return rec


def test_kernel_selection_memo_and_params(monkeypatch):
    """_launch picks default_spec(d, dv, dtype, causal, ..., seqlen_q bucket), compiles once per
    bucket, fills FwdParams."""
    rec = _recording_kernels(monkeypatch)
    d = 256  # causal, its registry has tiles of its own up to 1k queries
    packed = torch.randn(2, 9, 3, 4, d, dtype=torch.bfloat16)
    q, k, v = packed[:, :, 0], packed[:, :, 1, :2], packed[:, :, 2, :2]
    out = torch.empty(2, 9, 4, d, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 9)
    for _ in range(2):
        ops._launch(q, k, v, out, lse, 0.3, True)
    # 9 query rows: hdim 256 causal takes the short-sequence tiles (registry.SEQLEN_TILES).
    assert rec.specs == [("spec", d, d, "bf16", True, False, False, False, "short")]
    p, stream = rec.params[-1]
    assert stream == 1234
    assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                           out.data_ptr(), lse.data_ptr())
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (9 * 3 * 4 * d, 3 * 4 * d, d)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == q.stride()[:3]
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == (9 * 4 * d, 4 * d, d)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv) == (2, 9, 9, 4, 2)
    assert p.softmax_scale == pytest.approx(0.3)
    # The scratch the kernel asked for: zeroed once, then shared by the stream's launches.
    assert p.workspace and p.workspace == rec.params[0][0].workspace
    # The bench preloads kernels by their keys, which name the bucket: the same memoized kernel.
    assert ops._kernel_for(d, d, "bf16", True, False, False, False, "short") is ops._kernel_for(
        d, d, "bf16", True, seqlen_q=9)
    assert len(rec.specs) == 1
    (workspace,) = launch._FWD_WORKSPACES.values()
    assert workspace.data_ptr() == p.workspace and workspace.numel() >= 16 and not workspace.any()
    long_q = torch.randn(1, 3000, 4, d, dtype=torch.bfloat16)
    ops._launch(long_q, long_q[:, :, :2], long_q[:, :, :2], torch.empty_like(long_q), torch.empty(1, 4, 3000),
                0.3, True)
    assert rec.specs[-1] == ("spec", d, d, "bf16", True, False, False, False, None)  # the default tiles


def _without_pointers(p) -> bytes:
    p = type(p).from_buffer_copy(p)
    p.q = p.k = p.v = p.o = p.lse = None
    return bytes(p)


def test_eager_calls_reuse_their_plan(monkeypatch):
    """A second eager call of the same signature launches from the first one's plan: same packed
    parameters with its own pointers, no checks run again; another shape, another option or a
    misaligned pointer takes the full path (with its errors)."""
    rec = _recording_kernels(monkeypatch)
    q, k, v = qkv(b=2, sq=40, sk=56, hq=4, hkv=2, d=64)
    out1, lse1 = ops.flash_attn_func(q, k, v, causal=True, window_size=(8, -1), return_lse=True)
    checks = []
    real_check_meta = ops._check_meta
    monkeypatch.setattr(ops, "_check_meta", lambda *a: (checks.append(a), real_check_meta(*a)))
    q2, k2, v2 = qkv(b=2, sq=40, sk=56, hq=4, hkv=2, d=64)
    out2, lse2 = ops.flash_attn_func(q2, k2, v2, causal=True, window_size=(8, -1), return_lse=True)
    assert checks == [] and len(rec.specs) == 1 and len(rec.params) == 2
    (p1, s1), (p2, s2) = rec.params
    assert s1 == s2 == 1234 and _without_pointers(p1) == _without_pointers(p2)
    assert (p2.q, p2.k, p2.v, p2.o, p2.lse) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out2.data_ptr(),
                                                lse2.data_ptr())
    assert p1.workspace and p2.workspace == p1.workspace
    assert out2.shape == out1.shape and out2.dtype == out1.dtype and lse2.shape == lse1.shape
    # Another option, another shape: the full path, checks included.
    ops.flash_attn_func(q2, k2, v2, causal=False, window_size=(8, -1))
    ops.flash_attn_func(q2[:, :20], k2, v2, causal=True, window_size=(8, -1))
    assert len(checks) == 2 and len(rec.params) == 4
    # (-1.0, -1) hashes like (-1, -1) but is not a window the checks accept.
    ops.flash_attn_func(q2, k2, v2, causal=True)
    with pytest.raises(ValueError, match="window_size must be two ints"):
        ops.flash_attn_func(q2, k2, v2, causal=True, window_size=(-1.0, -1))
    # Same shape and strides, pointer 2 bytes off: the full path's alignment error.
    flat = torch.randn(q2.numel() + 8, dtype=q2.dtype)
    shifted = flat[1:1 + q2.numel()].view(q2.shape)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        ops.flash_attn_func(shifted, k2, v2, causal=True, window_size=(8, -1))


def test_custom_kernel_calls_reuse_their_plan(monkeypatch):
    """kernel(q, k, v, **params) of a custom spec: scalar params are part of the signature (with
    their types: an int32 param still rejects 1.0 after a call with 1); a tensor param gets no
    plan (its own checks and pointer every call)."""
    from fa3gen import KernelSpec

    _recording_kernels(monkeypatch)
    launched = []
    spec = KernelSpec(head_dim=64, score_mod={"expr": "score * gain + shift"},
                      params=[{"kind": "scalar", "name": "gain"}, {"kind": "scalar", "name": "shift", "dtype": "int32"}])
    kernel = types.SimpleNamespace(spec=spec, workspace_bytes=0, fwd=lambda p, s: launched.append(p))
    checks = []
    real_check_meta = ops._check_meta
    monkeypatch.setattr(ops, "_check_meta", lambda *a: (checks.append(a), real_check_meta(*a)))
    q, k, v = qkv(b=1, sq=8, sk=8, hq=2, hkv=2, d=64)
    ops.run_kernel(kernel, q, k, v, gain=0.5, shift=1)
    ops.run_kernel(kernel, *qkv(b=1, sq=8, sk=8, hq=2, hkv=2, d=64), gain=0.5, shift=1)
    assert len(checks) == 1 and len(launched) == 2
    assert _without_pointers(launched[0]) == _without_pointers(launched[1])
    ops.run_kernel(kernel, q, k, v, gain=0.25, shift=1)  # another value: the full path, its own plan
    assert len(checks) == 2 and launched[2].variant.float_args[0] == 0.25
    with pytest.raises(ValueError, match="shift is a int32 scalar"):
        ops.run_kernel(kernel, q, k, v, gain=0.5, shift=1.0)
    tensor_spec = KernelSpec(head_dim=64, score_mod={"expr": "score + bias[0][kv_idx]"},
                             params=[{"kind": "tensor", "name": "bias", "ndim": 2}])
    tensor_kernel = types.SimpleNamespace(spec=tensor_spec, workspace_bytes=0, fwd=lambda p, s: launched.append(p))
    bias = torch.zeros(1, 8)
    for _ in range(2):
        ops.run_kernel(tensor_kernel, q, k, v, bias=bias)
    assert len(checks) == 5  # both tensor-param calls checked in full


def test_fwd_workspace_per_stream_and_per_capture(monkeypatch):
    """One zeroed scratch per (device, stream), reused (the kernels leave it zeroed); a launch
    being captured gets its own, zeroed in the graph; none for 0 bytes."""
    monkeypatch.setattr(launch, "_FWD_WORKSPACES", {})
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cpu = torch.device("cpu")
    a, b = launch.fwd_workspace(16, cpu, 1), launch.fwd_workspace(16, cpu, 2)
    assert a.data_ptr() != b.data_ptr() and not a.any() and not b.any()
    assert launch.fwd_workspace(16, cpu, 1) is a
    assert launch.fwd_workspace(4096, cpu, 1).numel() >= 4096  # a larger ask replaces it
    assert launch.fwd_workspace(0, cpu, 1) is None
    capturing[0] = True
    c, d = launch.fwd_workspace(16, cpu, 1), launch.fwd_workspace(16, cpu, 1)
    assert c.data_ptr() != d.data_ptr() and not c.any() and c is not launch._FWD_WORKSPACES[(None, 1)]


def _fake_cuda_device(monkeypatch):
    """Let CPU tensors pass the device check (for the empty-problem paths, which launch nothing)."""
    monkeypatch.setattr(ops, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(ops, "_launch", lambda *a: pytest.fail("empty problems must not launch"))


@pytest.mark.parametrize("b, sq, hq", [(0, 5, 4), (2, 0, 4), (2, 5, 0)])
def test_empty_problems_launch_nothing(monkeypatch, b, sq, hq):
    _fake_cuda_device(monkeypatch)
    q = torch.randn(b, sq, hq, 64, dtype=torch.float16)
    k = torch.randn(b, 7, 2 if hq else 0, 64, dtype=torch.float16)
    out, lse = ops._forward_impl(q, k, k, 0.1, False)
    assert out.shape == (b, sq, hq, 64) and lse.shape == (b, hq, sq) and lse.dtype == torch.float32


def test_empty_keys_give_zero_out_and_neg_inf_lse(monkeypatch):
    _fake_cuda_device(monkeypatch)
    q = torch.randn(2, 5, 4, 64, dtype=torch.float16)
    k = torch.randn(2, 0, 2, 64, dtype=torch.float16)
    v = torch.randn(2, 0, 2, 128, dtype=torch.float16)
    out, lse = ops._forward_impl(q, k, v, 0.1, True)
    assert out.shape == (2, 5, 4, 128) and (out == 0).all()
    assert lse.shape == (2, 4, 5) and torch.isneginf(lse).all()
    ref_out, ref_lse = attention_reference(q, k, v, 0.1, True)
    assert (ref_out == 0).all() and torch.isneginf(ref_lse).all()


def test_exported_from_package():
    import fa3gen

    try:
        f = fa3gen.flash_attn_func
    except AttributeError:
        pytest.skip("fa3gen/__init__ does not export flash_attn_func yet")
    assert f is ops.flash_attn_func


# ---------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------

def naive_attention(q, k, v, scale, causal):
    """Loops over everything; float64; bottom-right causal; empty rows -> 0 / -inf."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.zeros(b, sq, hq, dv, dtype=torch.float64)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            for i in range(sq):
                js = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not js:
                    continue
                s = torch.stack([(q[bi, i, h].double() * k[bi, j, hk].double()).sum() * scale for j in js])
                m = s.max()
                p = torch.exp(s - m)
                lse[bi, h, i] = m + torch.log(p.sum())
                out[bi, i, h] = sum(p[n] * v[bi, j, hk].double() for n, j in enumerate(js)) / p.sum()
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 5), (3, 8), (8, 3), (1, 9), (6, 0)])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2), (4, 1)])
def test_reference_matches_naive_loop(causal, sq, sk, hq, hkv):
    torch.manual_seed(sq * 100 + sk * 10 + hq + hkv)
    q = torch.randn(2, sq, hq, 8, dtype=torch.float64)
    k = torch.randn(2, sk, hkv, 8, dtype=torch.float64)
    v = torch.randn(2, sk, hkv, 4, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, 0.37, causal)
    ref_out, ref_lse = naive_attention(q, k, v, 0.37, causal)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_reference_bottom_right_causal_and_empty_rows():
    sq, sk = 6, 3  # rows 0..2 see no key; row i >= 3 sees keys 0..i-3
    mask = causal_mask(sq, sk)
    assert mask.tolist() == [[j <= i - 3 for j in range(3)] for i in range(6)]
    q = torch.randn(1, sq, 1, 8, dtype=torch.float16)
    k = torch.randn(1, sk, 1, 8, dtype=torch.float16)
    v = torch.randn(1, sk, 1, 8, dtype=torch.float16)
    out, lse = attention_reference(q, k, v, None, True)
    assert (out[0, :3] == 0).all() and torch.isneginf(lse[0, 0, :3]).all()
    assert torch.isfinite(lse[0, 0, 3:]).all() and torch.isfinite(out).all()
    # row 3 sees only key 0: out = v[0], lse = q·k0 * scale
    torch.testing.assert_close(out[0, 3, 0], v[0, 0, 0].double())
    s = (q[0, 3, 0].double() @ k[0, 0, 0].double()) / math.sqrt(8)
    torch.testing.assert_close(lse[0, 0, 3], s)
    # sq == sk: same as the usual (top-left == bottom-right) causal mask of SDPA
    q2, k2, v2 = (torch.randn(1, 7, 2, 8, dtype=torch.float64) for _ in range(3))
    out2, _ = attention_reference(q2, k2, v2, 0.5, True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), is_causal=True, scale=0.5)
    torch.testing.assert_close(out2, sdpa.transpose(1, 2))


def test_reference_chunking(monkeypatch):
    import fa3gen.reference as reference

    q, k, v = (torch.randn(2, 37, 2, 8, dtype=torch.float64) for _ in range(3))
    full = attention_reference(q, k, v, 0.3, True)
    monkeypatch.setattr(reference, "_SCORE_BYTES_BUDGET", 8 * 2 * 2 * 37 * 5)  # 5 rows per chunk
    chunked = attention_reference(q, k, v, 0.3, True)
    torch.testing.assert_close(full, chunked, rtol=1e-12, atol=1e-12)


def test_reference_lse_is_natural_log():
    q = torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    _, lse = attention_reference(q, k, k, 1.0, False)
    assert lse.item() == pytest.approx(math.log(4))


# ---------------------------------------------------------------------------------------------
# bench arithmetic
# ---------------------------------------------------------------------------------------------

def test_bench_flops():
    assert attn_fwd_flops(1, 16, 16384, 16384, 128, False) == 4 * 16 * 16384 * 16384 * 128
    assert attn_fwd_flops(8, 16, 2048, 2048, 128, True) == 4 * 8 * 16 * 2048 * 2048 * 128 / 2
    assert attn_fwd_flops(1, 1, 10, 20, 192, False, head_dim_v=128) == 2 * 10 * 20 * (192 + 128)


def test_bench_cases_fa3_setup():
    cases = bench_cases([64, 128, 256], _int_list("512,1k,2k,4k,8k,16k"), (False, True))
    assert len(cases) == 36
    for d, s, b, h, _ in cases:
        assert b * s == 16384 and h * d == 2048
    assert _int_list("512, 16k") == [512, 16384]


def test_bench_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from fa3gen import bench

    assert bench.main(["--hdim", "128", "--seqlens", "512"]) == 2
    assert "CUDA" in capsys.readouterr().err


class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        import time

        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def fake_gpu_for_bench(monkeypatch) -> list:
    """Lets `fa3gen bench` run on CPU: CUDA events and syncs faked, no builds (the specs it would
    build are collected in the returned list), no compile probe."""
    import fa3gen
    from fa3gen import bench

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    built: list = []
    monkeypatch.setattr(fa3gen, "build_many", lambda specs, jobs=None, progress=None: built.extend(specs) or [],
                        raising=False)
    monkeypatch.setattr(bench, "_probe_compile", lambda key, cache_dir: {"spec": str(key), "compile_s": 0.0})
    return built


def test_bench_dry_run_on_cpu(monkeypatch, tmp_path, capsys, cpu_op):
    """The whole bench path on CPU: fa3gen routed to the reference, CUDA events faked."""
    import json

    from fa3gen import bench

    built = fake_gpu_for_bench(monkeypatch)
    monkeypatch.setattr(ops, "_kernel_for", lambda *key: object())
    out_json = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--hdim", "64,128", "--seqlens", "32,64", "--total-tokens", "64",
                     "--hidden", "256", "--reps", "2", "--warmup", "1", "--no-matmul", "--cold-compile",
                     "--json", str(out_json), "--markdown", str(tmp_path / "bench.md")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert len(built) == 4  # (64, 128) x (causal, not)
    assert "| case | fa3gen | cuDNN | FA2 | fa3gen/best-peer | fa3gen/matmul |" in text
    assert "| d128 s64 b1 h2 causal |" in text and "n/a" in text  # no cuDNN on CPU
    res = json.loads(out_json.read_text())
    assert len(res["cases"]) == 8 and "cold_compile" in res["compile"]
    for case in res["cases"]:
        assert case["results"]["fa3gen"]["tflops"] > 0
        assert case["check_max_abs_diff"] < 0.1  # fa3gen (reference here) vs torch's flash on CPU
        flops = attn_fwd_flops(case["batch"], case["nheads"], case["seqlen"], case["seqlen"],
                               case["head_dim"], case["causal"])
        assert case["flops"] == flops


def test_bench_times_the_matmul_beside_each_case(monkeypatch, tmp_path, capsys, cpu_op):
    """fa3gen/matmul divides by the matmul timed in the case's own interleaved rounds (the one
    timed alone before the cases stays as the header's ceiling line)."""
    import json

    from fa3gen import bench

    fake_gpu_for_bench(monkeypatch)
    monkeypatch.setattr(ops, "_kernel_for", lambda *key: object())
    rounds: list[list[str]] = []
    timer = bench.time_cuda_ms_interleaved

    def recording(fns, *a):
        rounds.append(list(fns))
        return timer(fns, *a)

    monkeypatch.setattr(bench, "time_cuda_ms_interleaved", recording)
    out_json = tmp_path / "bench.json"
    rc = bench.main(["--device", "cpu", "--hdim", "64", "--seqlens", "32", "--total-tokens", "64", "--hidden", "256",
                     "--reps", "2", "--warmup", "1", "--matmul-n", "64", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out_json.read_text())
    assert res["matmul_n"] == 64 and res["matmul_bf16_8192_tflops"] > 0
    assert rounds == [["fn"]] + [["fa3gen", "cudnn", "flash", "matmul"]] * 2  # alone, then not causal, causal
    for case in res["cases"]:
        assert "matmul" not in case["results"] and case["matmul_tflops"] > 0
        assert case["fa3gen_over_matmul"] == case["results"]["fa3gen"]["tflops"] / case["matmul_tflops"]
    assert "Ceiling: bf16 matmul 64³ = " in text and "; beside the cases (fa3gen/matmul) median " in text


# --- running one compiled kernel (a custom spec) ---------------------------------------------

class _FakeKernel:
    """Stands in for a CompiledKernel: run_kernel reads only .spec before it launches."""

    def __init__(self, spec):
        self.spec = spec


def test_run_kernel_rejects_inputs_the_spec_was_not_built_for():
    from fa3gen import KernelSpec
    from fa3gen.ops import run_kernel

    kernel = _FakeKernel(KernelSpec(head_dim=128, dtype="fp16", block_n=112))
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"takes fp16 with head_dim 128 .* got fp16 with head_dim 64"):
        run_kernel(kernel, q, q, q)
    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"takes fp16 .* got bf16"):
        run_kernel(kernel, q, q, q)


def test_run_kernel_validates_like_flash_attn_func():
    from fa3gen import KernelSpec
    from fa3gen.ops import run_kernel

    kernel = _FakeKernel(KernelSpec(head_dim=128, causal=True))
    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)  # right spec, but on the CPU
    with pytest.raises(ValueError, match="fa3gen kernels run on CUDA"):
        run_kernel(kernel, q, q, q)
    with pytest.raises(ValueError, match="must have 4 dims"):
        run_kernel(kernel, q[0], q, q)


def test_eager_calls_skip_the_op_dispatch_but_graphs_and_autograd_keep_it():
    """The custom op's dispatch costs as much as a short kernel, so plain eager calls go straight to
    the implementation; anything that must see the op (grad, subclasses, modes) still goes through it."""
    q, k, v = qkv()
    assert ops._eager_fast_path(q, k, v, None)
    assert not ops._eager_fast_path(q.clone().requires_grad_(), k, v, None)
    with torch.no_grad():
        assert ops._eager_fast_path(q.clone().requires_grad_(), k, v, None)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        assert not ops._eager_fast_path(fq, fq, fq, None)


def test_interleaved_timer_rotates_and_reports_failures(monkeypatch):
    """Every round runs each implementation once, starting one later each round, so none always
    runs first (the H200's clocks drift over a run), each timed batch after an untimed call that
    keeps the GPU busy while the host prepares it; one that raises gets its exception."""
    import time

    from fa3gen.bench import time_cuda_ms_interleaved

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls: list[str] = []

    def timed(name: str, seconds: float):
        def run():
            calls.append(name)
            time.sleep(seconds)
        return run

    def broken():
        raise RuntimeError("no kernel")

    ms = time_cuda_ms_interleaved({"a": timed("a", 0.002), "bad": broken, "b": timed("b", 0.004)},
                                  warmup=1, reps=4, min_rep_ms=1.0)
    assert list(ms) == ["a", "bad", "b"] and isinstance(ms["bad"], RuntimeError)
    assert 1.5 < ms["a"] < 3.5 < ms["b"] < 7  # one call each: the untimed one is outside the events
    rounds = calls[4:]  # after the warm-up and calibration calls (two each)
    assert rounds == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b", "b", "b", "a", "a"]
