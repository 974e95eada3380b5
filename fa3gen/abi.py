"""ctypes mirror of templates/include/fa3gen/abi.h: the C ABI of a compiled kernel library."""

from __future__ import annotations

import ctypes

ABI_VERSION = 3
MAX_SCALAR_ARGS = 8
MAX_TENSOR_ARGS = 8
MAX_TENSOR_DIMS = 4

_STRIDE_FIELDS = [
    f"{t}_{s}_stride" for t in ("q", "k", "v", "o") for s in ("batch", "row", "head")
]


class FwdParams(ctypes.Structure):
    """Forward problem: raw device pointers, element strides, sizes, the softmax scale and scratch."""

    _fields_ = (
        [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
         ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p)]
        + [(name, ctypes.c_int64) for name in _STRIDE_FIELDS]
        + [(name, ctypes.c_int32) for name in ("batch", "seqlen_q", "seqlen_k", "nheads_q", "nheads_kv")]
        + [("softmax_scale", ctypes.c_float), ("workspace", ctypes.c_void_p)]
        + [("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32), ("softcap", ctypes.c_float),
           ("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", ctypes.c_int64),
           ("float_args", ctypes.c_float * MAX_SCALAR_ARGS), ("int_args", ctypes.c_int32 * MAX_SCALAR_ARGS),
           ("tensor_args", ctypes.c_void_p * MAX_TENSOR_ARGS),
           ("tensor_strides", (ctypes.c_int64 * MAX_TENSOR_DIMS) * MAX_TENSOR_ARGS)]
    )


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the exported symbols' signatures on a loaded kernel library."""
    lib.fa3gen_abi_version.restype = ctypes.c_int
    lib.fa3gen_abi_version.argtypes = []
    lib.fa3gen_spec_json.restype = ctypes.c_char_p
    lib.fa3gen_spec_json.argtypes = []
    lib.fa3gen_fwd_workspace_bytes.restype = ctypes.c_int
    lib.fa3gen_fwd_workspace_bytes.argtypes = []
    lib.fa3gen_fwd.restype = ctypes.c_int
    lib.fa3gen_fwd.argtypes = [ctypes.POINTER(FwdParams), ctypes.c_void_p]
    return lib
