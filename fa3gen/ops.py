"""The torch face of fa3gen: ``flash_attn_func`` and the ``fa3gen::fwd`` / ``fa3gen::bwd`` custom ops.

Layout and conventions (FlashAttention's):

* q ``(batch, seqlen_q, nheads_q, head_dim)``, k ``(batch, seqlen_k, nheads_kv, head_dim)``,
  v ``(batch, seqlen_k, nheads_kv, head_dim_v)``; out ``(batch, seqlen_q, nheads_q, head_dim_v)``
  in q's dtype; lse ``(batch, nheads_q, seqlen_q)`` float32, natural log.
* GQA/MQA: ``nheads_q`` must be a multiple of ``nheads_kv``; query head ``h`` reads kv head
  ``h // (nheads_q // nheads_kv)``.
* Causal masking is aligned to the bottom-right corner: query ``i`` sees key ``j`` iff
  ``j <= i + seqlen_k - seqlen_q``. (torch SDPA's ``is_causal`` is top-left; the two agree only
  when ``seqlen_q == seqlen_k``.) A query row that sees no key gets ``out = 0`` and ``lse = -inf``.
* Inputs are not copied: the last dim must be contiguous, every batch/row/head stride a multiple
  of 8 elements (16 bytes, a TMA requirement) and every base pointer 16-byte aligned. Anything
  else is rejected with a ValueError that says what to do (usually ``.contiguous()``); fa3gen
  never makes a hidden copy.
* Empty problems launch nothing: batch, nheads or seqlen_q of 0 give empty outputs; seqlen_k of 0
  gives ``out = 0`` and ``lse = -inf``. Their gradients are zeros, also without a launch.
* Differentiable: ``fa3gen::fwd`` has an autograd formula that calls ``fa3gen::bwd`` (the backward
  kernels: dq, dk, dv; every head dim with head_dim_v == head_dim, plain, causal and the
  built-in variants window_size, softcap and alibi_slopes; the slopes get no gradient).
  ``deterministic=True`` picks the backward kernel that adds dQ contributions in a fixed order
  (bit-identical gradients run to run, somewhat slower). The output gradient autograd hands over
  is often not in a layout the kernel takes (the expanded gradient of ``out.sum()``, say); the
  backward then copies it to a contiguous tensor, the one copy fa3gen makes (of autograd's
  tensor, not the caller's). Not differentiable yet: lse (a nonzero gradient flowing into lse
  raises NotImplementedError in eager mode; traced and captured graphs cannot check it and ignore it).

The ops allocate their outputs (and the backward's scratch) with torch's caching allocator and
launch on the current CUDA stream without any host synchronization, so they can be captured in a
CUDA graph once their kernels are compiled (call them once before capturing).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fa3gen import block_sparsity, launch, registry
from fa3gen.abi import BwdParams, FwdParams
from fa3gen.registry import seqlen_bucket
from fa3gen.spec import KernelSpec
from fa3gen.variant_args import VariantArgs

NO_VARIANT = VariantArgs()

__all__ = ["flash_attn_func", "fwd", "bwd", "run_kernel", "run_bwd_kernel", "UnsupportedGPUError",
           "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_ALIGN_ELEMS = 8  # 16 bytes of a 2-byte dtype: TMA wants 16-byte strides
_ALIGN_BYTES = 16
_WORKSPACE_ALIGN_BYTES = 256  # the backward's scratch (abi.h); torch's caching allocator gives 512
_INT32_MAX = 2**31 - 1
_REQUIRED_CAPABILITY = (9, 0)


class UnsupportedGPUError(RuntimeError):
    """The tensors live on a GPU the compiled kernels cannot run on (they need sm_90: H100/H200)."""


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

Named = tuple[tuple[str, Any], ...]  # (name in error messages, tensor)


def _check_types(named: Named) -> None:
    """Each is a 4-dim fp16 or bf16 torch.Tensor."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fa3gen: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in named:
        if t.dim() != 4:
            raise ValueError(
                f"fa3gen: {name} must have 4 dims (batch, seqlen, nheads, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    for name, t in named:
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"fa3gen: {name} has dtype {t.dtype}; only torch.float16 and torch.bfloat16 are supported"
            )


def _layout_problem(name: str, t: torch.Tensor) -> str | None:
    """Why t's strides do not suit the kernel (TMA), as the error message; None when they do.
    The last dim must be contiguous and every other stride (of a dim longer than 1) a nonzero
    multiple of 8 elements."""
    if t.numel() == 0:
        return None
    if t.stride(-1) != 1:
        return (f"fa3gen: {name} must be contiguous in its last dim (stride 1), got strides "
                f"{tuple(t.stride())}; call {name}.contiguous()")
    for dim, what in ((0, "batch"), (1, "seqlen"), (2, "head")):
        if t.shape[dim] <= 1:
            continue  # the stride of a size-1 dim is never used
        st = t.stride(dim)
        if st == 0:
            return (f"fa3gen: {name} has a broadcast (stride 0) {what} dim, strides {tuple(t.stride())}; "
                    f"pass fewer kv heads for GQA/MQA or call {name}.contiguous()")
        if st % _ALIGN_ELEMS != 0:
            return (f"fa3gen: {name}'s {what} stride {st} is not a multiple of {_ALIGN_ELEMS} elements "
                    f"(16 bytes, required by TMA); strides {tuple(t.stride())}; call {name}.contiguous()")
    return None


def _check_layout(named: Named) -> None:
    for name, t in named:
        problem = _layout_problem(name, t)
        if problem is not None:
            raise ValueError(problem)


def _check_meta(q: Any, k: Any, v: Any) -> None:
    """Checks that need only types, dtypes, shapes and strides (fine on fake and meta tensors)."""
    named = (("q", q), ("k", k), ("v", v))
    _check_types(named)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"fa3gen: q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    bv, skv, hkvv, dv = v.shape
    if not (b == bk == bv):
        raise ValueError(f"fa3gen: batch sizes differ: q {b}, k {bk}, v {bv}")
    if sk != skv:
        raise ValueError(f"fa3gen: k and v must have the same seqlen, got k {sk}, v {skv}")
    if hkv != hkvv:
        raise ValueError(f"fa3gen: k and v must have the same number of heads, got k {hkv}, v {hkvv}")
    if dk != d:
        raise ValueError(f"fa3gen: q and k must have the same head_dim, got q {d}, k {dk}")
    if hkv == 0 and hq != 0:
        raise ValueError(f"fa3gen: k and v have 0 heads but q has {hq}")
    if hkv != 0 and hq % hkv != 0:
        raise ValueError(
            f"fa3gen: nheads_q ({hq}) must be a multiple of nheads_kv ({hkv}) (GQA/MQA)"
        )
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"fa3gen: head_dim {d} is not supported; choose one of {SUPPORTED_HEAD_DIMS}")
    if dv not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"fa3gen: head_dim_v {dv} (v's last dim) is not supported; choose one of {SUPPORTED_HEAD_DIMS}"
        )
    for name, n in (("batch", b), ("seqlen_q", sq), ("seqlen_k", sk), ("nheads_q", hq), ("nheads_kv", hkv)):
        if n > _INT32_MAX:
            raise ValueError(f"fa3gen: {name} = {n} does not fit in int32")
    _check_layout(named)


def _check_bwd_meta(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> None:
    """The backward's checks that need only types, dtypes, shapes and strides: q, k, v as in the
    forward; out and dout (b, sq, hq, dv) in q's dtype under the same stride rules; lse
    (b, hq, sq) float32 contiguous; head_dim_v == head_dim."""
    _check_meta(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    if dv != d:
        raise ValueError(f"fa3gen: backward supports head_dim_v == head_dim only so far, got head_dim {d}, "
                         f"head_dim_v {dv}")
    named = (("out", out), ("dout", dout))
    _check_types(named)
    want = (b, sq, hq, dv)
    for name, t in named:
        if t.dtype != q.dtype:
            raise TypeError(f"fa3gen: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        if tuple(t.shape) != want:
            raise ValueError(f"fa3gen: {name} must have shape (batch, seqlen_q, nheads_q, head_dim_v) = {want}, "
                             f"got {tuple(t.shape)}")
    _check_layout(named)
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"fa3gen: lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"fa3gen: lse must be float32 (as the forward returns it), got {lse.dtype}")
    if tuple(lse.shape) != (b, hq, sq):
        raise ValueError(f"fa3gen: lse must have shape (batch, nheads_q, seqlen_q) = {(b, hq, sq)}, "
                         f"got {tuple(lse.shape)}")
    if not lse.is_contiguous():
        raise ValueError(f"fa3gen: lse must be contiguous, got strides {tuple(lse.stride())}; call lse.contiguous()")


def _check_devices(named: Named) -> None:
    """The tensors must be on one CUDA device."""
    for name, t in named:
        if t.device.type != "cuda":
            raise ValueError(
                f"fa3gen: {name} is on {t.device}; fa3gen kernels run on CUDA (Hopper) tensors only"
            )
    device = named[0][1].device
    if any(t.device != device for _, t in named):
        raise ValueError(
            f"fa3gen: {', '.join(n for n, _ in named)} must be on the same device, got "
            + ", ".join(f"{n} {t.device}" for n, t in named)
        )


def _check_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v must be on one CUDA device."""
    _check_devices((("q", q), ("k", k), ("v", v)))


def _check_aligned(named: Named) -> None:
    """Base pointers must be 16-byte aligned (TMA). Real tensors only (reads data_ptr)."""
    for name, t in named:
        if t.numel() == 0:
            continue
        ptr = t.data_ptr()
        if ptr % _ALIGN_BYTES != 0:
            raise ValueError(
                f"fa3gen: {name}'s data pointer 0x{ptr:x} is not {_ALIGN_BYTES}-byte aligned "
                f"(storage offset {t.storage_offset()} elements; TMA needs 16-byte alignment); "
                f"call {name}.contiguous() or slice at a multiple of {_ALIGN_ELEMS} elements"
            )


def _check_alignment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v's base pointers must be 16-byte aligned (TMA)."""
    _check_aligned((("q", q), ("k", k), ("v", v)))


_GPU_OK: dict[int, bool] = {}


def _check_gpu(device: torch.device) -> None:
    """The GPU must be a Hopper (sm_90); the answer is cached per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _GPU_OK.get(index):
        return
    cap = tuple(torch.cuda.get_device_capability(index))
    if cap != _REQUIRED_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        raise UnsupportedGPUError(
            f"fa3gen: {name} (cuda:{index}) has compute capability {cap[0]}.{cap[1]}; fa3gen's kernels "
            f"are built for sm_90a and need a Hopper GPU (H100/H200, capability 9.0)"
        )
    _GPU_OK[index] = True


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

# fwd: (d, dv, dtype, causal, window, softcap, alibi); bwd: ("bwd", d, dv, dtype, causal, deterministic, window,
# softcap, alibi)
KernelKey = tuple[Any, ...]
_KERNELS: dict[KernelKey, Any] = {}
_KEY_LOCKS: dict[KernelKey, threading.Lock] = {}
_KERNELS_LOCK = threading.Lock()


def _compile_fn():
    """fa3gen.compile, looked up at call time so tests can swap it."""
    import fa3gen

    return fa3gen.compile


def _compile_memoized(key: KernelKey, spec_fn: str, args: tuple[Any, ...]):
    """The kernel of ``fa3gen.registry.<spec_fn>(*args)``, compiled once per key. Thread-safe;
    different keys compile concurrently (one lock per key), so a thread pool can prepare many
    kernels at once."""
    with _KERNELS_LOCK:
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:
        kern = _KERNELS.get(key)
        if kern is None:
            from fa3gen import registry

            spec = getattr(registry, spec_fn)(*args)
            kern = _compile_fn()(spec)
            _KERNELS[key] = kern
    return kern


def _kernel_for(head_dim: int, head_dim_v: int, dtype: str, causal: bool, window: bool = False,
                softcap: bool = False, alibi: bool = False, seqlen_q: int | str | None = None):
    """The compiled forward kernel of the registry's default spec for these inputs and built-in
    variants (memoized, thread-safe); seqlen_q, a query length or the name of its bucket (the
    bench's kernel keys carry the name), picks the registry's tiles for that query length."""
    key = (int(head_dim), int(head_dim_v), dtype, bool(causal), bool(window), bool(softcap), bool(alibi),
           seqlen_bucket(int(head_dim), bool(causal), seqlen_q))
    kern = _KERNELS.get(key)
    return kern if kern is not None else _compile_memoized(key, "default_spec", key)


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _split_twin_for(kernel: Any, batch: int, seqlen_q: int, nheads: int, seqlen_k: int, device: torch.device) -> Any:
    """The registry kernel's split_tail twin where the dispatch rule takes it for this problem on
    this device (registry.split_twin_for), else the kernel. The twin's grid is every SM."""
    spec = getattr(kernel, "spec", None)
    if device.type != "cuda" or not isinstance(spec, KernelSpec):
        return kernel
    twin_spec = registry.split_twin_for(spec, batch, seqlen_q, nheads, seqlen_k, _sm_count(device))
    if twin_spec is None:
        return kernel
    key = ("split", spec)
    twin = _KERNELS.get(key)
    return twin if twin is not None else _compile_memoized(key, "split_twin", (spec,))


def _bwd_kernel_for(head_dim: int, head_dim_v: int, dtype: str, causal: bool, deterministic: bool = False,
                    window: bool = False, softcap: bool = False, alibi: bool = False):
    """The compiled backward kernel of the registry's default backward spec (memoized, thread-safe)."""
    args = (int(head_dim), int(head_dim_v), dtype, bool(causal), bool(deterministic), bool(window), bool(softcap),
            bool(alibi))
    key = ("bwd", *args)
    kern = _KERNELS.get(key)
    return kern if kern is not None else _compile_memoized(key, "default_bwd_spec", args)


def _clear_kernel_memo() -> None:
    """Forget memoized kernels (tests that swap fa3gen.compile use this)."""
    with _KERNELS_LOCK:
        _KERNELS.clear()
    launch.forget_plans()


def _kernel_stride(t: torch.Tensor, dim: int) -> int:
    """Stride of dim (0 batch, 1 row, 2 head) as the kernel gets it.

    The stride of a size-1 dim is never used (its only index is 0), and torch leaves it arbitrary
    (e.g. after unsqueeze or slicing), so the kernel gets a legal packed value instead: the extent
    of the next inner dim, a multiple of 8 elements whenever the inner strides are.
    """
    if t.shape[dim] != 1:
        return int(t.stride(dim))
    if dim == t.dim() - 2:
        return int(t.shape[-1])
    return _kernel_stride(t, dim + 1) * int(t.shape[dim + 1])


def _kernel_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides as the kernel gets them; the common no-size-1 case is one call."""
    shape = t.shape
    if shape[0] != 1 and shape[1] != 1 and shape[2] != 1:
        stride = t.stride()
        return stride[0], stride[1], stride[2]
    return _kernel_stride(t, 0), _kernel_stride(t, 1), _kernel_stride(t, 2)


def _set_problem(p: FwdParams | BwdParams, q: torch.Tensor, k: torch.Tensor, softmax_scale: float) -> None:
    """The sizes and the softmax scale, fields both ABI structs share."""
    p.batch, p.seqlen_q, p.nheads_q = q.shape[0], q.shape[1], q.shape[2]
    p.seqlen_k, p.nheads_kv = k.shape[1], k.shape[2]
    p.softmax_scale = float(softmax_scale)


def _make_params(q, k, v, out, lse, softmax_scale: float) -> FwdParams:
    p = FwdParams()
    p.q, p.k, p.v, p.o, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = _kernel_strides(q)
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = _kernel_strides(k)
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = _kernel_strides(v)
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = _kernel_strides(out)
    _set_problem(p, q, k, softmax_scale)
    return p


def _alloc_workspace(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """The scratch a backward launch asked for (None for 0 bytes; the library zeroes what it needs
    itself), which the caller keeps alive until the launch is queued: the caching allocator then
    keeps it from being reused on this stream before the kernels are done with it."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > 0 else None


def _on_device(device: torch.device, run: Callable[[], None]) -> None:
    """Calls `run` with `device` current (the libraries size and launch on the current device),
    without the switch (~10 us) in the common case that it already is."""
    if device.index == torch.cuda.current_device():
        run()
        return
    with torch.cuda.device(device):
        run()


def _launch_params(workspace_bytes: int, q, k, v, out, lse, softmax_scale: float) -> tuple[FwdParams, torch.Tensor | None]:
    """FwdParams plus the scratch the kernel asked for, for launches on the current stream
    (``launch.fwd_workspace``)."""
    params = _make_params(q, k, v, out, lse, softmax_scale)
    stream = launch.current_stream(q.device)
    return params, launch.attach_workspace(params, workspace_bytes, q.device, stream)


def _run_fwd(kernel: Any, params: FwdParams, variant: VariantArgs, q: torch.Tensor, k: torch.Tensor,
             causal: bool) -> None:
    """What every forward launch ends with: its scratch, the call's variant values, and the launch
    on q's device and current stream."""
    stream = launch.current_stream(q.device)
    _workspace_alive = launch.attach_workspace(params, kernel.workspace_bytes, q.device, stream)
    _fill_variant(params, kernel, variant, q, k, causal)

    def run() -> None:
        _attach_block_ranges(kernel, params, variant, q.device, stream)
        kernel.fwd(params, stream)

    _on_device(q.device, run)


def _attach_block_ranges(kernel: Any, params: FwdParams | BwdParams, variant: VariantArgs, device: torch.device,
                         stream: int) -> None:
    """A block_sparse kernel's mask_mod block ranges (cached per problem) into its launch params."""
    spec = getattr(kernel, "spec", None)
    if spec is None or not spec.block_sparse:
        return
    tensors = tuple(t for t in variant.params.values() if isinstance(t, torch.Tensor))
    block_sparsity.attach(params, spec.block_ranges_slot,
                          block_sparsity.block_ranges(kernel, params, tensors, device, stream))


def _launch(q, k, v, out, lse, softmax_scale: float, causal: bool, kernel: Any = None,
            variant: VariantArgs = NO_VARIANT) -> tuple[Any, FwdParams]:
    """Run the forward kernel writing into out (b, sq, hq, dv) and lse (b, hq, sq) fp32; returns
    the kernel and the parameters it was launched with.

    Internal: callers have validated q, k, v; out must satisfy the same stride rules and lse
    must be contiguous. Used by the op and by the GPU tests (to write into NaN-poisoned buffers).
    """
    if kernel is None:  # the registry kernel for these inputs
        kernel = _kernel_for(q.shape[-1], v.shape[-1], _DTYPES[q.dtype], bool(causal), variant.window,
                             variant.softcap > 0, variant.alibi_slopes is not None, q.shape[1])
        kernel = _split_twin_for(kernel, q.shape[0], q.shape[1], q.shape[2], k.shape[1], q.device)
    params = _make_params(q, k, v, out, lse, softmax_scale)
    _run_fwd(kernel, params, variant, q, k, causal)
    return kernel, params


def _fill_variant(params: FwdParams | BwdParams, kernel: Any, variant: VariantArgs, q: torch.Tensor,
                  k: torch.Tensor, causal: bool) -> None:
    """The call's variant values, checked against the kernel's spec, into the launch's params."""
    spec = getattr(kernel, "spec", None)
    if spec is not None:
        variant.check(spec)
        variant.check_tensors(spec, q, k)
        variant.fill(params.variant, spec, causal, q.shape[1], k.shape[1])


def _forward_impl(q, k, v, softmax_scale: float, causal: bool, kernel: Any = None,
                  variant: VariantArgs = NO_VARIANT, meta_checked: bool = False,
                  plan_key: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, allocate, launch (the registry kernel, or `kernel`). Separate from the op so CPU
    tests can route it. With a plan_key (an eager flash_attn_func or run_kernel call), the launch
    is kept as that signature's plan (``fa3gen.launch``)."""
    if not meta_checked:
        _check_meta(q, k, v)
    _check_device(q, k, v)
    b, sq, hq, _ = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    if b == 0 or sq == 0 or hq == 0:
        out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        return out, lse
    if sk == 0:
        out = torch.zeros((b, sq, hq, dv), dtype=q.dtype, device=q.device)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse
    _check_alignment(q, k, v)
    _check_gpu(q.device)
    out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    launched, params = _launch(q, k, v, out, lse, softmax_scale, causal, kernel, variant)
    launch.remember(plan_key, launched, params, out, lse)
    return out, lse


def _custom_call_args(spec: KernelSpec, q: torch.Tensor, v: torch.Tensor, softmax_scale: float | None,
                      window_size: tuple[int, int], softcap: float, alibi_slopes: torch.Tensor | None,
                      params: dict[str, Any]) -> tuple[VariantArgs, float]:
    """A custom kernel's call (run_kernel, run_bwd_kernel) checked against its spec: the inputs'
    dtype and head dims, then the variant values; returns them and the softmax scale
    (1/sqrt(head_dim) unless given)."""
    want = _DTYPES[q.dtype]
    if (want, q.shape[-1], v.shape[-1]) != (spec.dtype, spec.head_dim, spec.head_dim_v):
        raise ValueError(
            f"fa3gen: kernel {spec.name} takes {spec.dtype} with head_dim {spec.head_dim} and head_dim_v "
            f"{spec.head_dim_v}; got {want} with head_dim {q.shape[-1]} and head_dim_v {v.shape[-1]}"
        )
    variant = VariantArgs(tuple(window_size), softcap, alibi_slopes, dict(params))
    variant.check(spec)
    return variant, 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def run_kernel(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               softmax_scale: float | None = None, return_lse: bool = False, *,
               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               alibi_slopes: torch.Tensor | None = None, **params: Any):
    """Runs one compiled kernel (``fa3gen.compile(spec)``) on q, k, v: the path for a custom spec.

    Same layout, validation and conventions as ``flash_attn_func``; causal comes from the spec.
    The spec's built-in variants take their values here (``window_size``, ``softcap``,
    ``alibi_slopes``), and its declared params by name (``kernel(q, k, v, bias=t, alpha=0.5)``).
    As in ``flash_attn_func``, an eager call of a signature launched before (scalar params only)
    reuses that call's launch plan (``fa3gen.launch``). Not a registered custom op
    (``torch.compile`` sees a graph break); use ``flash_attn_func`` for the registry kernels
    inside compiled graphs.
    """
    spec = kernel.spec
    # (a block-sparse launch is not planned: its ranges live in block_sparsity's cache, not the plan)
    planned = _eager_fast_path(q, k, v, alibi_slopes) and not spec.block_sparse
    plan_key = launch.plan_key(q, k, v, softmax_scale, spec.causal, window_size, softcap, alibi_slopes, kernel,
                               params) if planned else None
    if (result := launch.run_planned(plan_key, q, k, v)) is not None:  # as in flash_attn_func
        out, lse = result
        return (out, lse) if return_lse else out
    _check_meta(q, k, v)
    variant, scale = _custom_call_args(spec, q, v, softmax_scale, window_size, softcap, alibi_slopes, params)
    out, lse = _forward_impl(q, k, v, scale, spec.causal, kernel, variant, meta_checked=True, plan_key=plan_key)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------

def _make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float) -> BwdParams:
    p = BwdParams()
    p.q, p.k, p.v, p.o, p.dout = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr()
    p.lse, p.dq, p.dk, p.dv = lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = _kernel_strides(q)
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = _kernel_strides(k)
    p.v_batch_stride, p.v_row_stride, p.v_head_stride = _kernel_strides(v)
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = _kernel_strides(out)
    p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride = _kernel_strides(dout)
    p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride = _kernel_strides(dq)
    p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride = _kernel_strides(dk)
    p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride = _kernel_strides(dv)
    _set_problem(p, q, k, softmax_scale)
    return p


def _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, causal: bool,
                deterministic: bool = False, kernel: Any = None, variant: VariantArgs = NO_VARIANT) -> None:
    """Run the backward kernels writing dq (like q), dk (like k) and dv (like v).

    Internal: callers have validated the inputs (``_check_bwd_meta``); dq, dk, dv must satisfy the
    same stride rules. Used by the op and by the GPU tests (to write into NaN-poisoned buffers).
    """
    if kernel is None:  # the registry kernel for these inputs
        kernel = _bwd_kernel_for(q.shape[-1], v.shape[-1], _DTYPES[q.dtype], bool(causal), bool(deterministic),
                                 variant.window, variant.softcap > 0, variant.alibi_slopes is not None)
    params = _make_bwd_params(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale)
    _fill_variant(params, kernel, variant, q, k, causal)
    # The scratch depends on the problem's sizes (the library says how much).
    workspace = _alloc_workspace(kernel.bwd_workspace_bytes(params), q.device)
    params.workspace = workspace.data_ptr() if workspace is not None else None
    if params.workspace is not None and params.workspace % _WORKSPACE_ALIGN_BYTES != 0:  # not an assert: -O
        raise RuntimeError(f"fa3gen: the backward workspace at 0x{params.workspace:x} is not "
                           f"{_WORKSPACE_ALIGN_BYTES}-byte aligned (torch's caching allocator gives 512)")
    stream = launch.current_stream(q.device)

    def run() -> None:
        _attach_block_ranges(kernel, params, variant, q.device, stream)
        kernel.bwd(params, stream)

    _on_device(q.device, run)


def _backward_impl(dout, q, k, v, out, lse, softmax_scale: float, causal: bool, deterministic: bool = False,
                   kernel: Any = None, meta_checked: bool = False,
                   variant: VariantArgs = NO_VARIANT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, allocate dq, dk, dv (contiguous, like q, k, v), launch (the registry backward
    kernel, or `kernel`). Separate from the op so CPU tests can route it."""
    if not meta_checked:
        _check_bwd_meta(dout, q, k, v, out, lse)
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))
    _check_devices(named)
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if b == 0 or sq == 0 or hq == 0 or sk == 0:  # no query sees a key: every gradient is 0
        return (torch.zeros((b, sq, hq, d), dtype=q.dtype, device=q.device),
                torch.zeros((b, sk, hkv, d), dtype=k.dtype, device=k.device),
                torch.zeros((b, sk, hkv, dv), dtype=v.dtype, device=v.device))
    _check_aligned(named)
    _check_gpu(q.device)
    dq = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, sk, hkv, d), dtype=k.dtype, device=k.device)
    dv_ = torch.empty((b, sk, hkv, dv), dtype=v.dtype, device=v.device)
    _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv_, softmax_scale, causal, deterministic, kernel, variant)
    return dq, dk, dv_


def run_bwd_kernel(kernel: Any, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, softmax_scale: float | None = None, *,
                   window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   alibi_slopes: torch.Tensor | None = None, **params: Any):
    """Runs one compiled backward kernel (``fa3gen.compile(KernelSpec(kind="bwd", ...))``):
    returns (dq, dk, dv) for the forward that produced out and lse from q, k, v.

    Same layout and validation as the autograd path; causal and deterministic come from the spec.
    The variants take the values the forward ran with (``window_size``, ``softcap``,
    ``alibi_slopes``, the spec's params by name), as in ``run_kernel``.
    Not a registered custom op (``torch.compile`` sees a graph break).
    """
    spec = kernel.spec
    if spec.kind != "bwd":
        raise TypeError(f"fa3gen: kernel {spec.name} is a {spec.kind} kernel; run_bwd_kernel needs kind='bwd'")
    _check_bwd_meta(dout, q, k, v, out, lse)
    variant, scale = _custom_call_args(spec, q, v, softmax_scale, window_size, softcap, alibi_slopes, params)
    return _backward_impl(dout, q, k, v, out, lse, scale, spec.causal, spec.deterministic, kernel, meta_checked=True,
                          variant=variant)


# ---------------------------------------------------------------------------------------------
# the custom ops and autograd
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("fa3gen::fwd", mutates_args=())
def fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: returns (out (b, sq, hq, dv) in q's dtype, lse (b, hq, sq) fp32).
    `deterministic` does not change the forward (which is deterministic): it picks the kernel of
    its backward."""
    variant = VariantArgs((window_left, window_right), softcap, alibi_slopes)
    return _forward_impl(q, k, v, softmax_scale, causal, None, variant)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
              deterministic=False):
    _check_meta(q, k, v)
    b, sq, hq, _ = q.shape
    dv = v.shape[-1]
    out = q.new_empty((b, sq, hq, dv))
    lse = q.new_empty((b, hq, sq), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("fa3gen::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, softmax_scale: float, causal: bool, deterministic: bool,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: (dq, dk, dv), contiguous, shaped like q, k, v, in q's dtype. out and lse
    are the forward's; dout is the gradient of out (same shape, dtype and stride rules); the
    variant values are the forward's."""
    variant = VariantArgs((window_left, window_right), softcap, alibi_slopes)
    return _backward_impl(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, variant=variant)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1, window_right=-1,
              softcap=0.0, alibi_slopes=None):
    _check_bwd_meta(dout, q, k, v, out, lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_LSE_GRAD_UNSUPPORTED = ("fa3gen: gradients flowing into lse are not supported yet (the backward kernel "
                         "differentiates out only); detach lse, or use it outside the differentiated loss")


def _fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window, ctx.softcap, ctx.alibi_slopes = (window_left, window_right), softcap, alibi_slopes
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient (None), not a tensor of zeros


def _is_concrete(t: torch.Tensor) -> bool:
    """A plain eager tensor whose values may be read now (not traced, fake, or under capture)."""
    if type(t) is not torch.Tensor or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _in_kernel_layout(dout: torch.Tensor) -> torch.Tensor:
    """Autograd's output gradient as is when the kernel takes its layout, else a contiguous copy.
    (The gradient of out.sum() is an expanded scalar with all strides 0, and a gradient arriving
    through a view may be strided or offset.)"""
    if _layout_problem("dout", dout) is None and (dout.storage_offset() * dout.element_size()) % _ALIGN_BYTES == 0:
        return dout
    return dout.clone(memory_format=torch.contiguous_format)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dlse is not None and _is_concrete(dlse) and bool(dlse.ne(0).any()):
        raise NotImplementedError(_LSE_GRAD_UNSUPPORTED)
    nones = (None,) * 7  # softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic
    if dout is None:
        if dlse is None:
            return (None, None, None, *nones)
        dout = torch.zeros_like(out)
    dout = _in_kernel_layout(dout)
    if _is_concrete(dout) and _eager_call(dout, q, k, v, out, lse, ctx.alibi_slopes):
        # As the bwd op does, without its dispatch (the eager forward above, or the op's own).
        variant = VariantArgs(ctx.window, ctx.softcap, ctx.alibi_slopes)
        dq, dk, dv = _backward_impl(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic,
                                    variant=variant)
    else:
        dq, dk, dv = torch.ops.fa3gen.bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic,
                                          *ctx.window, ctx.softcap, ctx.alibi_slopes)
    return (dq, dk, dv, *nones)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _eager_call(*tensors: torch.Tensor | None) -> bool:
    """True for an eager call: no compilation, tracing or dispatch/function modes (which must see
    the op), plain tensors only (anything else goes to the checks' errors), none on the meta device
    (the op's fake implementation gives their shapes)."""
    if not all(t is None or (type(t) is torch.Tensor and not t.is_meta) for t in tensors):
        return False
    return not (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
                or torch._C._is_torch_function_mode_enabled())


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _eager_fast_path(*tensors: torch.Tensor | None) -> bool:
    """True for a plain eager call without autograd (see _eager_call)."""
    return _eager_call(*tensors) and not _needs_grad(*tensors)


class _EagerAttention(torch.autograd.Function):
    """An eager call that needs gradients: the op's forward and backward (the same setup_context
    and backward) without torch.library's dispatch and autograd wrapper. Through the op such a call
    took 347 us of host time on the H100 machine (the attn_bias path's autograd.Function 270 us);
    on the CPU machine, launch excluded, 217 us through the op and 72 us through this. torch.compile,
    fake and meta tensors and subclasses keep the op."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                softcap: float, alibi_slopes, deterministic: bool, plan_key):
        out_lse = launch.run_planned(plan_key, q, k, v)
        if out_lse is None:
            variant = VariantArgs((window_left, window_right), softcap, alibi_slopes)
            out_lse = _forward_impl(q, k, v, softmax_scale, causal, None, variant, meta_checked=True, plan_key=plan_key)
        _fwd_setup_context(ctx, (q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                                 deterministic), out_lse)
        return out_lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_fwd_backward(ctx, dout, dlse), None)  # plan_key


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    *,
    document_ids: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    variant_spec: Any = None,
    variant_params: dict[str, Any] | None = None,
):
    """FlashAttention-3-style attention on Hopper, differentiable.

    Args:
        q: (batch, seqlen_q, nheads_q, head_dim), fp16 or bf16, on a Hopper GPU.
        k: (batch, seqlen_k, nheads_kv, head_dim); nheads_q must be a multiple of nheads_kv.
        v: (batch, seqlen_k, nheads_kv, head_dim_v).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        causal: bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q).
        return_lse: also return the log-sum-exp (natural log) of each query row.
        window_size: (left, right) local attention: query i sees keys j with
            i + sk - sq - left <= j <= i + sk - sq + right; -1 leaves a side unbounded. With
            causal the right side is capped at the diagonal. (-1, -1): no window.
        softcap: > 0 soft-caps the scaled scores: score = softcap * tanh(score / softcap).
        alibi_slopes: float32 (nheads_q,) or (batch, nheads_q): adds -slope * |i + sk - sq - j|
            to the scaled score of query i and key j.
        deterministic: the backward adds the dQ contributions of the key blocks in a fixed order,
            so gradients are bit-identical run to run (somewhat slower). The forward is always
            deterministic.
        document_ids: int32 (batch, seqlen), packed sequences (seqlen_q == seqlen_k): query i
            sees key j only where document_ids[b, i] == document_ids[b, j] (with causal, the
            window and the others); key blocks of other documents are skipped.
        prefix_lengths: int32 (batch,), prefix-LM: query i sees key j iff j < prefix_lengths[b]
            or j <= i + sk - sq (causal after the prefix, whatever `causal` says).
        attn_bias: float32, bfloat16 or float16 (batch or 1, nheads_q or 1, seqlen_q, seqlen_k),
            read in its own dtype (a 16-bit one is half the bytes) and added in fp32 to the scaled
            score of query i and key j (after softcap and ALiBi); copied where its keys are not
            contiguous. One that requires grad gets its gradient, of its own shape (a size-1
            batch or head dim sums over them).
        variant_spec: a forward ``KernelSpec`` with custom variants (score_mod, mask_mod, ...),
            whose kernel runs this call; it decides causal (causal=True needs a causal spec) and
            must match q's dtype and head dims. Its built-ins take their values from the
            arguments above, its params from ``variant_params`` (a dict by name).

    Returns:
        out (batch, seqlen_q, nheads_q, head_dim_v) in q's dtype, or (out, lse) with lse
        (batch, nheads_q, seqlen_q) float32. Rows that see no key: out 0, lse -inf.

    Head dims 64, 96, 128, 192, 256. The first call for a (head_dim, head_dim_v, dtype, causal,
    variants) compiles (or loads from the cache) its kernel; so does the first backward.

    Gradients: ``out.backward(...)`` / ``torch.autograd.grad`` give dq, dk, dv through the
    backward kernels (head_dim_v == head_dim), with the same causal mask and variants as the
    forward (window_size, softcap, alibi_slopes; no gradient for the slopes). A nonzero gradient
    flowing into lse raises NotImplementedError (eager mode). With ``document_ids``,
    ``prefix_lengths``, ``attn_bias`` or ``variant_spec`` the call runs a spec's kernels through a
    torch.autograd.Function (fa3gen.spec_attention: a graph break under torch.compile), the
    backward's kernel from ``spec.backward_spec()``; their param tensors other than attn_bias
    get no gradient (attn_bias's: not with deterministic=True, whose order atomics do not keep).
    """
    if variant_spec is not None or variant_params or any(t is not None for t in (document_ids, prefix_lengths, attn_bias)):
        from .spec_attention import call_params, spec_attention

        variant = VariantArgs(tuple(window_size), softcap, alibi_slopes,
                              call_params(document_ids, prefix_lengths, attn_bias, variant_params))
        variant.check()
        out, lse = spec_attention(q, k, v, softmax_scale, causal, variant, variant_spec, deterministic)
        return (out, lse) if return_lse else out
    # An eager call without autograd runs the implementation directly; one that needs gradients
    # goes through _EagerAttention. Both keep the signature's launch plan.
    eager_call = _eager_call(q, k, v, alibi_slopes)
    eager_grad = eager_call and _needs_grad(q, k, v, alibi_slopes)
    eager = eager_call and not eager_grad
    plan_key = launch.plan_key(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes) if eager_call else None
    if eager and (result := launch.run_planned(plan_key, q, k, v)) is not None:
        # An eager call of a signature validated before: its plan (fa3gen.launch) repeats the
        # launch with this call's pointers, without the checks and packing (~30 us of Python).
        out, lse = result
        return (out, lse) if return_lse else out
    _check_meta(q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    variant = VariantArgs(tuple(window_size), softcap, alibi_slopes)
    variant.check()
    left, right = (int(w) for w in window_size)
    if eager:
        # Plain eager call: the implementation directly. The custom op's dispatch costs 15-30 us a
        # call, as much as a short kernel runs; graphs and tensor subclasses keep the op.
        out, lse = _forward_impl(q, k, v, float(softmax_scale), bool(causal), None, variant, meta_checked=True,
                                 plan_key=plan_key)
    elif eager_grad:
        out, lse = _EagerAttention.apply(q, k, v, float(softmax_scale), bool(causal), left, right, float(softcap),
                                         alibi_slopes, bool(deterministic), plan_key)
    else:
        out, lse = torch.ops.fa3gen.fwd(q, k, v, float(softmax_scale), bool(causal), left, right,
                                        float(softcap), alibi_slopes, bool(deterministic))
    return (out, lse) if return_lse else out
