"""ctypes mirror of templates/include/fa3gen/abi.h: the C ABI of a compiled kernel library."""

from __future__ import annotations

import ctypes

ABI_VERSION = 7
MAX_SCALAR_ARGS = 8
MAX_TENSOR_ARGS = 8
MAX_TENSOR_DIMS = 4
KINDS = ("fwd", "bwd", "fp8_prepare")  # the spec's kind: which symbols a library exports


def _stride_fields(*tensors: str) -> list[str]:
    return [f"{t}_{s}_stride" for t in tensors for s in ("batch", "row", "head")]


_SIZE_FIELDS = [(name, ctypes.c_int32) for name in ("batch", "seqlen_q", "seqlen_k", "nheads_q", "nheads_kv")]


class VariantParams(ctypes.Structure):
    """Run-time values of the variants (window, softcap, ALiBi, custom params), forward and backward."""

    _fields_ = [("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32), ("softcap", ctypes.c_float),
                ("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", ctypes.c_int64),
                ("float_args", ctypes.c_float * MAX_SCALAR_ARGS), ("int_args", ctypes.c_int32 * MAX_SCALAR_ARGS),
                ("tensor_args", ctypes.c_void_p * MAX_TENSOR_ARGS),
                ("tensor_strides", (ctypes.c_int64 * MAX_TENSOR_DIMS) * MAX_TENSOR_ARGS)]


class Descale(ctypes.Structure):
    """FP8 descaling factors of one input: scale[b * batch_stride + (row // block_rows) * block_stride
    + h * head_stride] (zero strides broadcast; a NULL scale is 1)."""

    _fields_ = [("scale", ctypes.c_void_p), ("batch_stride", ctypes.c_int64), ("block_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("block_rows", ctypes.c_int32)]


class FwdParams(ctypes.Structure):
    """Forward problem: raw device pointers, element strides, sizes, the softmax scale and scratch."""

    _fields_ = (
        [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
         ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p)]
        + [(name, ctypes.c_int64) for name in _stride_fields("q", "k", "v", "o")]
        + _SIZE_FIELDS
        + [("softmax_scale", ctypes.c_float), ("workspace", ctypes.c_void_p), ("variant", VariantParams)]
        + [(f"{t}_descale", Descale) for t in ("q", "k", "v")]  # e4m3 kernels only
    )


class BwdParams(ctypes.Structure):
    """Backward problem: the forward's q, k, v, o and lse, the output gradient dout, the gradients
    dq, dk, dv to write, their element strides, sizes, the softmax scale, scratch and the forward's
    variant values."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv")]
        + [(name, ctypes.c_int64) for name in _stride_fields("q", "k", "v", "o", "dout", "dq", "dk", "dv")]
        + _SIZE_FIELDS
        + [("softmax_scale", ctypes.c_float), ("workspace", ctypes.c_void_p), ("variant", VariantParams)]
    )


class Fp8PrepareParams(ctypes.Structure):
    """The fused fp8 prepare kernels' arguments (Fa3genFp8PrepareParams of fp8_prepare.cu.j2):
    input, output and scale pointers with element strides, the signs of the Hadamard transform
    (NULL: none), the amax buffer, sizes, rows per scale block, and how the scales are made."""

    _fields_ = (
        [("x", ctypes.c_void_p)] + [(f"x_{s}_stride", ctypes.c_int64) for s in ("batch", "row", "head")]
        + [("out", ctypes.c_void_p)] + [(f"out_{s}_stride", ctypes.c_int64) for s in ("batch", "row", "head")]
        + [("signs", ctypes.c_void_p), ("amax", ctypes.c_void_p), ("scale", ctypes.c_void_p)]
        + [(f"scale_{s}_stride", ctypes.c_int64) for s in ("batch", "block", "head")]
        + [(name, ctypes.c_int32) for name in ("batch", "seqlen", "nheads", "block_rows", "padded_keys",
                                               "granularity", "power_of_two")]
    )


FP8_PREPARE_ENTRY_POINTS = ("fa3gen_fp8_amax", "fa3gen_fp8_scales", "fa3gen_fp8_quantize", "fa3gen_fp8_quantize_v_layout")
FP8_SCALE_GRANULARITY = {"block": 0, "head": 1, "tensor": 2}  # Fp8PrepareParams.granularity


# A block_sparse library's classifier, per kind: (params, int32 ranges out, stream).
BLOCK_RANGES_ENTRY_POINTS = {"fwd": "fa3gen_fwd_block_ranges", "bwd": "fa3gen_bwd_block_ranges"}


def bind(lib: ctypes.CDLL, kind: str = "fwd") -> ctypes.CDLL:
    """Declare the exported symbols' signatures on a loaded kernel library of this kind ("fwd",
    "bwd" or "fp8_prepare"): the two every library exports and the launch symbols of its kind (the
    others are absent)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    lib.fa3gen_abi_version.restype = ctypes.c_int
    lib.fa3gen_abi_version.argtypes = []
    lib.fa3gen_spec_json.restype = ctypes.c_char_p
    lib.fa3gen_spec_json.argtypes = []
    if kind == "fp8_prepare":
        for name in FP8_PREPARE_ENTRY_POINTS:
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.POINTER(Fp8PrepareParams), ctypes.c_void_p]
    elif kind == "fwd":
        lib.fa3gen_fwd_workspace_bytes.restype = ctypes.c_int
        lib.fa3gen_fwd_workspace_bytes.argtypes = []
        lib.fa3gen_fwd.restype = ctypes.c_int
        lib.fa3gen_fwd.argtypes = [ctypes.POINTER(FwdParams), ctypes.c_void_p]
    else:
        lib.fa3gen_bwd_workspace_bytes.restype = ctypes.c_int64
        lib.fa3gen_bwd_workspace_bytes.argtypes = [ctypes.POINTER(BwdParams)]
        lib.fa3gen_bwd.restype = ctypes.c_int
        lib.fa3gen_bwd.argtypes = [ctypes.POINTER(BwdParams), ctypes.c_void_p]
    classifier = BLOCK_RANGES_ENTRY_POINTS.get(kind)
    if classifier is not None and hasattr(lib, classifier):  # block_sparse kernels only
        entry = getattr(lib, classifier)
        entry.restype = ctypes.c_int
        entry.argtypes = [ctypes.POINTER(FwdParams if kind == "fwd" else BwdParams), ctypes.c_void_p, ctypes.c_void_p]
    return lib
