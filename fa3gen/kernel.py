"""A compiled kernel library loaded into the process, and fa3gen.compile(spec)."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from . import abi, cache, toolchain
from .build import BuildResult, build
from .render import BuildSpec, spec_from_json, templates_dir


class CompiledKernel:
    """One kernel library: dlopen'ed, ABI-checked, callable with raw FwdParams (a forward spec),
    BwdParams (a backward spec, ``spec.kind == "bwd"``) or Fp8PrepareParams (an Fp8PrepareSpec)."""

    def __init__(self, spec: BuildSpec, result: BuildResult, lib: ctypes.CDLL) -> None:
        self._spec = spec
        self._result = result
        self._lib = lib
        self._is_fwd = spec.kind == "fwd"
        # Forward scratch is a constant, asked once (it is per call hot); backward scratch depends
        # on the problem's sizes and is asked per call (bwd_workspace_bytes).
        self._workspace_bytes = int(lib.fa3gen_fwd_workspace_bytes()) if self._is_fwd else None

    @property
    def spec(self) -> BuildSpec:
        return self._spec

    @property
    def kind(self) -> str:
        """"fwd" or "bwd" (the spec's kind)."""
        return self._spec.kind

    @property
    def entry_dir(self) -> Path:
        return self._result.entry_dir

    @property
    def library_path(self) -> Path:
        return self._result.entry.library

    @property
    def build_result(self) -> BuildResult:
        return self._result

    def _wrong_kind(self, what: str, want: str | None = None) -> TypeError:
        want = want or ("bwd" if self._is_fwd else "fwd")
        model = "Fp8PrepareSpec" if want == "fp8_prepare" else f"KernelSpec(kind={want!r}, ...)"
        return TypeError(f"fa3gen kernel {self._spec.name} is a {self._spec.kind} kernel; {what} needs a "
                         f"{want} kernel ({model})")

    @property
    def workspace_bytes(self) -> int:
        """Device scratch each forward launch needs in ``params.workspace`` (0: none). A backward
        kernel's scratch depends on the problem: ``bwd_workspace_bytes(params)``."""
        if self._workspace_bytes is None:
            raise self._wrong_kind("workspace_bytes (a backward kernel's scratch depends on the problem: "
                                   "bwd_workspace_bytes(params))")
        return self._workspace_bytes

    def fwd(self, params: abi.FwdParams, stream: int) -> None:
        """Launch the forward kernel on `stream` (a cudaStream_t as an int; 0 = default stream)."""
        if not self._is_fwd:
            raise self._wrong_kind("fwd()")
        err = self._lib.fa3gen_fwd(ctypes.byref(params), ctypes.c_void_p(stream or None))
        self._check_launch(err, params, "kernel(q, k, v, ...)")

    def _check_launch(self, err: int, params: abi.FwdParams | abi.BwdParams, call: str) -> None:
        if err != 0 and getattr(self._spec, "block_sparse", False) \
                and not params.variant.tensor_args[self._spec.block_ranges_slot]:
            raise RuntimeError(
                f"fa3gen kernel {self._spec.name} is block_sparse: its launch needs the block ranges in tensor "
                f"param slot {self._spec.block_ranges_slot} (fa3gen.block_sparsity.block_ranges, then attach; "
                f"calling the kernel on tensors, {call}, does both)")
        if err != 0:
            raise RuntimeError(f"fa3gen kernel {self._spec.name} failed: CUDA error {err}")

    def block_ranges(self, params: abi.FwdParams | abi.BwdParams, ranges: int, stream: int) -> None:
        """A block_sparse kernel's classifier: writes the problem's block ranges into `ranges`, a
        device pointer to int32, contiguous: a forward's (batch, nheads_q, ceil(seqlen_q /
        block_m), 4) key block ranges per query block, a backward's (batch, nheads_kv,
        ceil(seqlen_k / block_n), 4) query block ranges per key block; batch and heads 1 where the
        mask_mod does not use b or h (``spec.block_ranges_per``)."""
        if not getattr(self._spec, "block_sparse", False):
            raise TypeError(f"fa3gen kernel {self._spec.name} is not block_sparse: it has no block ranges")
        entry = getattr(self._lib, abi.BLOCK_RANGES_ENTRY_POINTS[self.kind])
        err = entry(ctypes.byref(params), ctypes.c_void_p(ranges), ctypes.c_void_p(stream or None))
        if err != 0:
            raise RuntimeError(f"fa3gen kernel {self._spec.name} (block ranges) failed: CUDA error {err}")

    def bwd_workspace_bytes(self, params: abi.BwdParams) -> int:
        """Device scratch (bytes, 256-byte aligned) the backward launch of this problem needs in
        ``params.workspace``; reads the sizes in params, not the pointers."""
        if self.kind != "bwd":
            raise self._wrong_kind("bwd_workspace_bytes()", "bwd")
        nbytes = int(self._lib.fa3gen_bwd_workspace_bytes(ctypes.byref(params)))
        if nbytes < 0:
            raise RuntimeError(f"fa3gen kernel {self._spec.name} asked for {nbytes} bytes of workspace")
        return nbytes

    def bwd(self, params: abi.BwdParams, stream: int) -> None:
        """Launch the backward kernels on `stream` (a cudaStream_t as an int; 0 = default stream)."""
        if self.kind != "bwd":
            raise self._wrong_kind("bwd()", "bwd")
        err = self._lib.fa3gen_bwd(ctypes.byref(params), ctypes.c_void_p(stream or None))
        self._check_launch(err, params, "kernel.backward(dout, q, k, v, out, lse, ...)")

    def fp8_prepare(self, entry: str, params: abi.Fp8PrepareParams, stream: int) -> None:
        """Launch one fused fp8 prepare kernel (``abi.FP8_PREPARE_ENTRY_POINTS``) on `stream`."""
        if self.kind != "fp8_prepare":
            raise self._wrong_kind("fp8_prepare()", "fp8_prepare")
        if entry not in abi.FP8_PREPARE_ENTRY_POINTS:
            raise ValueError(f"entry must be one of {abi.FP8_PREPARE_ENTRY_POINTS}, got {entry!r}")
        err = getattr(self._lib, entry)(ctypes.byref(params), ctypes.c_void_p(stream or None))
        if err != 0:
            raise RuntimeError(f"fa3gen kernel {self._spec.name} ({entry}) failed: CUDA error {err}")

    def __call__(self, q, k, v, softmax_scale: float | None = None, return_lse: bool = False, **variant):
        """Attention with this kernel on torch tensors: ``fa3gen.ops.run_kernel`` (causal from the
        spec; window_size, softcap, alibi_slopes and the spec's params by keyword)."""
        if not self._is_fwd:
            raise self._wrong_kind("kernel(q, k, v) (for gradients call kernel.backward(dout, q, k, v, out, "
                                   "lse), or differentiate through fa3gen.flash_attn_func)")
        from .ops import run_kernel

        return run_kernel(self, q, k, v, softmax_scale=softmax_scale, return_lse=return_lse, **variant)

    def backward(self, dout, q, k, v, out, lse, softmax_scale: float | None = None, **variant):
        """Gradients (dq, dk, dv) with this backward kernel on torch tensors:
        ``fa3gen.ops.run_bwd_kernel`` (causal and deterministic from the spec; the variants' values
        by keyword, as the forward got them)."""
        if self.kind != "bwd":
            raise self._wrong_kind("backward()", "bwd")
        from .ops import run_bwd_kernel

        return run_bwd_kernel(self, dout, q, k, v, out, lse, softmax_scale=softmax_scale, **variant)

    def __repr__(self) -> str:
        return f"CompiledKernel({self._spec.name}, {self.library_path})"


class _EntryMismatch(RuntimeError):
    """The library is not the one the spec asks for (stale ABI, or the wrong spec)."""


def _load(spec: BuildSpec, result: BuildResult) -> ctypes.CDLL:
    """dlopen the entry's library and check it is the ABI and the spec we asked for."""
    lib = ctypes.CDLL(str(result.entry.library), mode=ctypes.RTLD_LOCAL)
    try:
        abi.bind(lib, spec.kind)
    except AttributeError as exc:  # built from another ABI or kind: a launch symbol is missing
        _dlclose(lib)
        raise _EntryMismatch(f"{result.entry.library} does not export the {spec.kind} ABI of spec {spec.name}: {exc}")
    version = lib.fa3gen_abi_version()
    embedded = (lib.fa3gen_spec_json() or b"").decode()
    if version != abi.ABI_VERSION or embedded != spec.canonical_json():
        # Unload before the entry is rebuilt in place, or dlopen would hand back this stale handle.
        _dlclose(lib)
        raise _EntryMismatch(
            f"{result.entry.library} does not match spec {spec.name}: ABI version {version} (want {abi.ABI_VERSION}), spec {embedded!r} "
            f"(want {spec.canonical_json()!r})"
        )
    return lib


def _dlclose(lib: ctypes.CDLL) -> None:
    try:
        import _ctypes

        _ctypes.dlclose(lib._handle)
    except (ImportError, AttributeError, OSError):
        pass


# Loaded kernels by (cache root, cache key): one binary per key, and its entry in that cache.
_memo: dict[tuple[str, str], CompiledKernel] = {}
_spec_keys: dict[tuple[str, ...], tuple[str, str]] = {}  # what the key derives from -> memo key
_building: dict[tuple[str, ...], threading.Lock] = {}  # one builder per spec; others wait on it
_lock = threading.Lock()  # guards the three dicts, never held while compiling


def _as_spec(spec: BuildSpec | str) -> BuildSpec:
    return spec_from_json(spec) if isinstance(spec, str) else spec


def _nvcc_or_empty() -> str:
    try:
        return str(toolchain.find_nvcc())
    except toolchain.ToolchainError:
        return ""  # prebuilt entries still load without a compiler


def _memoized(env: tuple[str, ...]) -> CompiledKernel | None:
    with _lock:
        key = _spec_keys.get(env)
        return _memo.get(key) if key is not None else None


def compile(spec: BuildSpec | str) -> CompiledKernel:  # noqa: A001 - the public name is fa3gen.compile
    """The loaded kernel for a spec (or its JSON): memoized in-process, else cached on disk, else built."""
    spec = _as_spec(spec)
    # Everything in-process the cache key depends on, so a warm call skips rendering and hashing.
    env = (
        spec.canonical_json(),
        str(templates_dir()),
        str(cache.cache_root(create=False)),
        _nvcc_or_empty(),
    )
    if (kernel := _memoized(env)) is not None:
        return kernel
    with _lock:
        building = _building.setdefault(env, threading.Lock())
    with building:
        if (kernel := _memoized(env)) is not None:
            return kernel
        result = build(spec)
        memo_key = (str(result.entry.path.parent), result.key)
        with _lock:
            kernel = _memo.get(memo_key)
        if kernel is None:
            try:
                lib = _load(spec, result)
            except (_EntryMismatch, OSError):
                # The files match the manifest but not the spec (or do not load): a corrupted entry.
                cache.remove(result.entry)
                result = build(spec)
                lib = _load(spec, result)
            kernel = CompiledKernel(spec, result, lib)
        with _lock:
            _memo[memo_key] = kernel
            _spec_keys[env] = memo_key
        return kernel
