"""FP8 (e4m3) attention forward on Hopper: ``flash_attn_fp8_func`` and ``fp8_attention``.

``fp8_attention(q, k, v)`` takes 16/32-bit inputs and does everything: the random-sign Hadamard
transform of Q and K, block quantization to e4m3 (``fa3gen.fp8.prepare``) and the fp8 kernel.
``flash_attn_fp8_func(inputs)`` runs the kernel on already prepared ``fa3gen.fp8.Fp8Inputs``
(quantize once, attend many times). Layouts and masks follow ``flash_attn_func`` (bottom-right
causal, GQA, window_size); O comes out in bf16 (or fp16) and the LSE in float32. Forward only.

The descaling factors are folded into the kernel: Q's (and K's, when one per (batch, head)) into
the softmax scale, K's per-block factors into each key block's scores, V's into O's running
rescale; per-block factors must cover whole warpgroups' rows (Q) and key blocks (K, V), which
``fa3gen.fp8.prepare``'s default blocks do for every registry kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fa3gen import ops, registry
from fa3gen.abi import Descale, FwdParams
from fa3gen.fp8 import Fp8Inputs, Granularity, Quantized, padded_keys, prepare
from fa3gen.spec import FP16_MAX, WGMMA_M, _lazy_rescale_default, e4m3_round_up, scores_f16_qk_max
from fa3gen.variant_args import VariantArgs

__all__ = ["flash_attn_fp8_func", "fp8_attention"]

_OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP8 = torch.float8_e4m3fn


def _kernel_for(head_dim: int, head_dim_v: int, out_dtype: str, causal: bool, window: bool,
                power_of_two_v_scales: bool = True, v_transpose_in_kernel: bool = False,
                seqlen_bucket: str | None = None, scores_f16_inputs: bool = True):
    """The default e4m3 kernel (registry.default_fp8_spec), memoized; power_of_two_v_scales=False
    (V's block ratios inexact) takes the eager rescale where the default is lazy; seqlen_bucket
    (registry.fp8_seqlen_bucket) the tiles for that query length; scores_f16_inputs=False (Q and K
    not within the fp16 scores' bound): fp32 scores where the default has fp16 ones."""
    # The flag picks another kernel only where the default rescales lazily: elsewhere one entry.
    # (Asked only for inexact scales, so the common call does not build the defaults' dict.)
    exact = bool(power_of_two_v_scales) or not _lazy_rescale_default(
        {"dtype": "e4m3", "head_dim_v": int(head_dim_v), "window": bool(window)})
    key = ("e4m3", int(head_dim), int(head_dim_v), out_dtype, bool(causal), bool(window), exact,
           bool(v_transpose_in_kernel), seqlen_bucket, bool(scores_f16_inputs))
    kern = ops._KERNELS.get(key)
    return kern if kern is not None else ops._compile_memoized(key, "default_fp8_spec", key[1:])


def _seqlen_bucket(inputs: Fp8Inputs, causal: bool, window: bool,
                   scores_f16_inputs: bool | None = None) -> str | None:
    """The registry's bucket of tiles for these inputs' query length, where their K/V scale blocks
    are whole key blocks of the kernel it takes for them (fa3gen.fp8.prepare's default blocks
    are); else None. scores_f16_inputs: scores_fit_f16(inputs), where the caller has it."""
    q = inputs.q.data
    d = q.shape[-1]
    bucket = registry.fp8_seqlen_bucket(d, inputs.head_dim_v, causal, window, not inputs.v.kernel_v_layout,
                                        q.shape[1])
    if bucket is None:
        return None
    if scores_f16_inputs is None:
        scores_f16_inputs = scores_fit_f16(inputs)
    block_n = registry.fp8_bucket_block_n(d, causal, bucket, scores_f16_inputs)
    blocked = [x for x in (inputs.k, inputs.v) if x.granularity == "block"]
    return bucket if all((x.block_size or 0) % block_n == 0 for x in blocked) else None


def scores_fit_f16(inputs: Fp8Inputs) -> bool:
    """Whether every score of these inputs is finite in fp16 (a scores_f16 kernel may take them):
    |q·k| <= head_dim * max|q| * max|k| <= 65504, by the bounds the quantization states, each
    rounded up to an e4m3 value (what the cast may round a value at the bound to)."""
    q_max, k_max = (e4m3_round_up(x.max_abs) for x in (inputs.q, inputs.k))
    return inputs.q.data.shape[-1] * q_max * k_max <= FP16_MAX


def _check_inputs(x: Fp8Inputs) -> None:
    q, k, vt = x.q.data, x.k.data, x.v.data
    for name, t in (("q", q), ("k", k), ("v", vt)):
        if t.dtype != _FP8:
            raise TypeError(f"fa3gen: fp8 {name} must be torch.float8_e4m3fn, got {t.dtype} "
                            "(make the inputs with fa3gen.fp8.prepare)")
        if t.dim() != 4:
            raise ValueError(f"fa3gen: fp8 {name} must be 4-d, got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"fa3gen: fp8 {name}'s last dim must be contiguous, got strides {t.stride()}")
        if any(s % 16 for s in t.stride()[:-1]):
            raise ValueError(f"fa3gen: fp8 {name}'s strides {t.stride()} must be multiples of 16 elements "
                             f"(TMA needs 16-byte strides); call .contiguous()")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"fa3gen: k {tuple(k.shape)} does not match q {tuple(q.shape)} (batch, head_dim)")
    sk, hk = k.shape[1], k.shape[2]
    if sk != x.seqlen_k:
        raise ValueError(f"fa3gen: k has {sk} keys but the inputs say seqlen_k={x.seqlen_k}")
    if hq % hk != 0:
        raise ValueError(f"fa3gen: nheads_q={hq} must be a multiple of nheads_kv={hk}")
    dv = x.head_dim_v
    if x.v.kernel_v_layout and (vt.shape[0] != b or vt.shape[1] != hk or vt.shape[3] != padded_keys(sk)):
        raise ValueError(f"fa3gen: fp8 v must be in the kernel's layout (batch, nheads_kv, head_dim_v, "
                         f"{padded_keys(sk)}) = {(b, hk, dv, padded_keys(sk))}, got {tuple(vt.shape)} "
                         "(fa3gen.fp8.v_kernel_layout makes it)")
    if not x.v.kernel_v_layout and tuple(vt.shape[:3]) != (b, sk, hk):
        raise ValueError(f"fa3gen: fp8 v (batch, seqlen_k, nheads_kv, head_dim_v) must be {(b, sk, hk, dv)}, "
                         f"got {tuple(vt.shape)}")
    if d not in ops.SUPPORTED_HEAD_DIMS or dv not in ops.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"fa3gen: head dims ({d}, {dv}) not supported; choose from {ops.SUPPORTED_HEAD_DIMS}")
    ops._check_devices((("q", q), ("k", k), ("v", vt)))
    for name, quant in (("q", x.q), ("k", x.k), ("v", x.v)):
        s = quant.scale
        if s.dtype != torch.float32 or s.device != q.device:
            raise ValueError(f"fa3gen: {name}'s scale must be float32 on {q.device}, got {s.dtype} on {s.device}")


def _descale(quant: Quantized, seqlen: int, nheads: int, batch: int, tile_rows: int, name: str) -> Descale:
    """The ABI struct of one input's scales (see Quantized.scale's shapes)."""
    s, d = quant.scale, Descale()
    if quant.granularity == "tensor":
        if s.numel() != 1:
            raise ValueError(f"fa3gen: {name}'s per-tensor scale must have one element, got shape {tuple(s.shape)}")
        d.block_rows = 1
    elif quant.granularity == "head":
        if tuple(s.shape) != (batch, nheads):
            raise ValueError(f"fa3gen: {name}'s per-head scale must be (batch, nheads) = {(batch, nheads)}, "
                             f"got {tuple(s.shape)}")
        d.batch_stride, d.head_stride, d.block_rows = s.stride(0), s.stride(1), 1
    else:
        bs = quant.block_size or 0
        if bs <= 0 or bs % tile_rows != 0:
            unit = "a consumer warpgroup's" if name == "q" else "the kernel's key blocks of"
            raise ValueError(f"fa3gen: {name}'s scale blocks of {bs} rows must be a multiple of {unit} "
                             f"{tile_rows} rows (fa3gen.fp8.prepare's default block_size=None sizes them "
                             "for every registry kernel)")
        want = (batch, math.ceil(seqlen / bs), nheads)
        if tuple(s.shape) != want:
            raise ValueError(f"fa3gen: {name}'s per-block scale must be (batch, blocks, nheads) = {want}, "
                             f"got {tuple(s.shape)}")
        d.batch_stride, d.block_stride, d.head_stride, d.block_rows = s.stride(0), s.stride(1), s.stride(2), bs
    d.scale = s.data_ptr()
    return d


def _params(x: Fp8Inputs, out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, spec: Any) -> FwdParams:
    q, k, vt = x.q.data, x.k.data, x.v.data
    p = FwdParams()
    p.q, p.k, p.v, p.o, p.lse = q.data_ptr(), k.data_ptr(), vt.data_ptr(), out.data_ptr(), lse.data_ptr()
    p.q_batch_stride, p.q_row_stride, p.q_head_stride = ops._kernel_strides(q)
    p.k_batch_stride, p.k_row_stride, p.k_head_stride = ops._kernel_strides(k)
    if x.v.kernel_v_layout:  # Vᵀ (batch, nheads_kv, head_dim_v, keys): its "rows" are head-dim rows.
        p.v_batch_stride, p.v_head_stride, p.v_row_stride = vt.stride(0), vt.stride(1), vt.stride(2)
    else:  # V as the model holds it, for a kernel that transposes it (v_transpose_in_kernel)
        p.v_batch_stride, p.v_row_stride, p.v_head_stride = ops._kernel_strides(vt)
    p.o_batch_stride, p.o_row_stride, p.o_head_stride = ops._kernel_strides(out)
    ops._set_problem(p, q, k, softmax_scale)
    b, sq, hq, _ = q.shape
    # Q's blocks may span a tile: each consumer warpgroup (WGMMA_M rows) folds its rows' factor.
    p.q_descale = _descale(x.q, sq, hq, b, WGMMA_M, "q")
    p.k_descale = _descale(x.k, x.seqlen_k, k.shape[2], b, spec.block_n, "k")
    p.v_descale = _descale(x.v, x.seqlen_k, k.shape[2], b, spec.block_n, "v")
    return p


def _checked_kernel(inputs: Fp8Inputs, out_dtype: str, causal: bool, window: bool, kernel: Any = None):
    """The kernel to run on these inputs: the default one (eager where V's block ratios are
    inexact), or the caller's, checked against them."""
    d, dv = inputs.q.data.shape[-1], inputs.head_dim_v
    exact_v_ratios = inputs.v.exact_ratios_along_sequence
    transposes_v = not inputs.v.kernel_v_layout
    fits_f16 = scores_fit_f16(inputs)
    if kernel is None:
        kernel = _kernel_for(d, dv, out_dtype, causal, window, exact_v_ratios, transposes_v,
                             _seqlen_bucket(inputs, causal, window, fits_f16), fits_f16)
        b, sq, h, _ = inputs.q.data.shape
        kernel = ops._split_twin_for(kernel, b, sq, h, inputs.seqlen_k, inputs.q.data.device)
    spec = kernel.spec
    if spec.scores_f16 and not fits_f16:
        raise ValueError(
            f"fa3gen: kernel {spec.name} accumulates the scores in fp16 (scores_f16), which needs q and k quantized "
            f"to |x| <= {scores_f16_qk_max(spec.head_dim):.5g} (fa3gen.fp8.prepare's qk_max_abs); these say |q| <= "
            f"{inputs.q.max_abs:g}, |k| <= {inputs.k.max_abs:g}: pass a spec with scores_f16=False")
    if spec.v_transpose_in_kernel != transposes_v:
        raise ValueError(f"fa3gen: kernel {spec.name} takes V " + (
            "as (batch, seqlen_k, nheads_kv, head_dim_v) and transposes it itself, but v is in the kernel layout "
            "(fa3gen.fp8.prepare(..., kernel_v_layout=False) keeps it)" if spec.v_transpose_in_kernel else
            "in the kernel layout (fa3gen.fp8.v_kernel_layout), but v is (batch, seqlen_k, nheads_kv, head_dim_v): "
            "pass a spec with v_transpose_in_kernel=True"))
    if spec.causal != causal:
        raise ValueError(f"fa3gen: kernel {spec.name} is {'' if spec.causal else 'not '}causal but causal={causal}")
    if (spec.dtype, spec.head_dim, spec.head_dim_v, spec.out_dtype) != ("e4m3", d, dv, out_dtype):
        raise ValueError(f"fa3gen: kernel {spec.name} does not take e4m3 head dims ({d}, {dv}) to {out_dtype}")
    if spec.lazy_rescale and not exact_v_ratios:
        raise ValueError(f"fa3gen: kernel {spec.name} rescales O lazily, as accurate as the eager rescale only "
                         "when V's block scales are powers of two, and these are not marked so (power_of_two: "
                         "fa3gen.fp8.prepare's default); pass a spec with lazy_rescale=False")
    return kernel


def flash_attn_fp8_func(inputs: Fp8Inputs, softmax_scale: float | None = None, causal: bool = False,
                        return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
                        out_dtype: torch.dtype = torch.bfloat16, kernel: Any = None):
    """Attention of prepared e4m3 inputs (``fa3gen.fp8.prepare``) with the fp8 kernel.

    Returns out (batch, seqlen_q, nheads_q, head_dim_v) in out_dtype, or (out, lse). The softmax
    scale defaults to 1/sqrt(head_dim); the Hadamard transform does not change it. `kernel`: a
    ``fa3gen.compile`` of an e4m3 spec, instead of the default one.
    """
    _check_inputs(inputs)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"fa3gen: out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    q = inputs.q.data
    b, sq, hq, d = q.shape
    dv = inputs.head_dim_v
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    variant = VariantArgs(tuple(window_size))
    variant.check()
    kernel = _checked_kernel(inputs, _OUT_DTYPES[out_dtype], bool(causal), variant.window, kernel)
    out = torch.empty((b, sq, hq, dv), dtype=out_dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return (out, lse) if return_lse else out
    if inputs.seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    _launch(inputs, out, lse, scale, kernel, variant)
    return (out, lse) if return_lse else out


def _launch(inputs: Fp8Inputs, out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, kernel: Any,
            variant: VariantArgs) -> None:
    """Runs the fp8 kernel into out (b, sq, hq, dv) and lse (b, hq, sq) float32. Internal: the
    inputs are checked; the GPU tests use it to write into NaN-poisoned buffers."""
    q, vt = inputs.q.data, inputs.v.data
    ops._check_aligned((("q", q), ("k", inputs.k.data), ("v", vt)))
    ops._check_gpu(q.device)
    params = _params(inputs, out, lse, softmax_scale, kernel.spec)
    ops._run_fwd(kernel, params, variant, q, inputs.k.data, kernel.spec.causal)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                  causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                  granularity: Granularity = "block", block_size: int | tuple[int, int] | None = None,
                  hadamard: bool = True,
                  seed: int = 0, return_lse: bool = False):
    """FP8 attention of 16/32-bit q, k, v (flash_attn_func's layout): Hadamard (optional), block
    quantization to e4m3 (``fa3gen.fp8.prepare``: fused kernels on Hopper), the fp8 kernel; O in
    q's dtype when it is bf16/fp16, else bf16. To attend to the same inputs many times, prepare
    once and call ``flash_attn_fp8_func``."""
    out_dtype = q.dtype if q.dtype in _OUT_DTYPES else torch.bfloat16
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    inputs = prepare(q, k, v, granularity, block_size, hadamard, seed)
    return flash_attn_fp8_func(inputs, softmax_scale, causal, return_lse, window_size, out_dtype)
