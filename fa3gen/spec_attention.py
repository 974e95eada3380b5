"""Differentiable attention with any forward spec's kernels: ``flash_attn_func``'s path for a
custom variant spec (``variant_spec=`` with ``variant_params=``) and for the built-ins that take a
tensor (``document_ids=``, ``prefix_lengths=``, ``attn_bias=``), whose kernels the registry does
not hold.

The forward runs ``fa3gen.compile(spec)``; the first backward compiles ``spec.backward_spec()``
(its deterministic version with deterministic=True). A ``torch.autograd.Function`` rather than a
registered op: its params are a spec's, any names and types, so ``torch.compile`` sees a graph
break here. ``attn_bias`` gets its gradient when it requires one (the backward spec with
bias_grad=True adds it into a zeroed float32 tensor that broadcasts as the bias does); other param
tensors get none, and one that requires it is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, get_args

import pydantic
import torch

from . import ops
from .spec import KernelSpec
from .variant_args import _TORCH_DTYPES, VariantArgs, bias_rows_aligned, empty_with_aligned_rows


class _SpecAttention(torch.autograd.Function):
    # attn_bias is an input of its own (None without one), so autograd gives it its gradient; the
    # kernels read it from `variant`.
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, kernel, softmax_scale: float, variant: VariantArgs, deterministic: bool):
        out, lse = ops._forward_impl(q, k, v, softmax_scale, kernel.spec.causal, kernel, variant, meta_checked=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.softmax_scale, ctx.variant, ctx.deterministic = kernel, softmax_scale, variant, deterministic
        ctx.bias_shape, ctx.bias_dtype = (None, None) if attn_bias is None else (attn_bias.shape, attn_bias.dtype)
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient (None), not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dlse is not None and ops._is_concrete(dlse) and bool(dlse.ne(0).any()):
            raise NotImplementedError(ops._LSE_GRAD_UNSUPPORTED)
        nones = (None,) * 4  # kernel, softmax_scale, variant, deterministic
        if dout is None:
            if dlse is None:
                return (None, None, None, None, *nones)
            dout = torch.zeros_like(out)
        spec, variant = ctx.kernel.spec, ctx.variant
        bias_grad = None
        if ctx.needs_input_grad[3]:
            # Of the caller's shape; expanded as the bias was, so the kernel adds the entries of a
            # size-1 batch or head dim into one element.
            # Rows padded to 16 bytes (the unmasked kernels add four keys per vector atomic).
            bias_grad = empty_with_aligned_rows(ctx.bias_shape, torch.float32, q.device).zero_()
            variant = dataclasses.replace(variant, params={**variant.params,
                                                           "attn_bias_grad": bias_grad.expand(variant.params["attn_bias"].shape)})
        bwd_spec = _backward_spec(spec, bool(ctx.deterministic), bias_grad is not None)
        dq, dk, dv = ops._backward_impl(ops._in_kernel_layout(dout), q, k, v, out, lse, ctx.softmax_scale,
                                        spec.causal, ctx.deterministic, _kernel(bwd_spec), variant=variant)
        # Added up in float32; returned in the bias's own dtype.
        return (dq, dk, dv, None if bias_grad is None else bias_grad.to(ctx.bias_dtype), *nones)


def _spec_for(q: torch.Tensor, v: torch.Tensor, causal: bool, variant: VariantArgs,
              variant_spec: KernelSpec | None) -> KernelSpec:
    """The forward spec of a call: the caller's variant spec (which decides causal), or the
    default spec of the inputs with the built-in variants and masks the call gives values for."""
    if variant_spec is None:
        prefix_lm = "prefix_lengths" in variant.params  # causal after the prefix by itself
        bias = variant.params.get("attn_bias")
        return _default_spec(q.shape[-1], v.shape[-1], ops._DTYPES[q.dtype], causal and not prefix_lm,
                             window=variant.window, softcap=variant.softcap > 0,
                             alibi=variant.alibi_slopes is not None, documents="document_ids" in variant.params,
                             prefix_lm=prefix_lm, bias=bias is not None, bias_dtype=_bias_dtype(bias),
                             bias_rows_aligned=isinstance(bias, torch.Tensor) and bias_rows_aligned(bias))
    if not isinstance(variant_spec, KernelSpec) or variant_spec.kind != "fwd" or variant_spec.is_fp8:
        raise TypeError("fa3gen: variant_spec must be a 16-bit forward KernelSpec (its backward_spec() gives the "
                        f"gradients), got {getattr(variant_spec, 'name', variant_spec)!r}")
    if causal and not variant_spec.causal:
        raise ValueError(f"fa3gen: causal=True, but variant_spec {variant_spec.name} is not causal: the spec decides "
                         "(KernelSpec(causal=True, ...))")
    want = (ops._DTYPES[q.dtype], q.shape[-1], v.shape[-1])
    if want != (variant_spec.dtype, variant_spec.head_dim, variant_spec.head_dim_v):
        raise ValueError(f"fa3gen: variant_spec {variant_spec.name} takes {variant_spec.dtype} with head_dim "
                         f"{variant_spec.head_dim} and head_dim_v {variant_spec.head_dim_v}; got {want[0]} with "
                         f"head_dim {want[1]} and head_dim_v {want[2]}")
    return variant_spec


# Per call, the spec, its backward spec and their kernels come from memos: built each time (pydantic
# validation, the registry lookup, compile's cache key) they cost ~0.5 ms of host time a call, longer
# than some kernels run. Specs are frozen (hashable); a spec that does not validate raises each time.
@functools.lru_cache(maxsize=256)
def _default_spec(*args: Any, **kwargs: Any) -> KernelSpec:
    from .registry import default_spec

    return default_spec(*args, **kwargs)


@functools.lru_cache(maxsize=256)
def _backward_spec(spec: KernelSpec, deterministic: bool, bias_grad: bool) -> KernelSpec:
    return spec.backward_spec(deterministic=deterministic, bias_grad=bias_grad)


_KERNELS: dict[tuple[Any, KernelSpec], Any] = {}


def _kernel(spec: KernelSpec) -> Any:
    """fa3gen.compile(spec), once per spec (and compile function: tests swap it). Like the registry
    path's kernels, kept for the process: a later change of FA3GEN_CACHE_DIR or the templates does not
    reach a spec already compiled."""
    compile_fn = ops._compile_fn()
    kernel = _KERNELS.get((compile_fn, spec))
    if kernel is None:
        kernel = _KERNELS[(compile_fn, spec)] = compile_fn(spec)  # compile itself builds a spec once
    return kernel


# attn_bias's torch dtypes by the spec's bias_dtype names.
_BIAS_DTYPES = {_TORCH_DTYPES[name]: name for name in get_args(KernelSpec.model_fields["bias_dtype"].annotation)}


def _bias_dtype(bias: Any) -> str:
    """The bias_dtype of a call's attn_bias (float32 where there is none)."""
    if not isinstance(bias, torch.Tensor):
        return "float32"
    if bias.dtype not in _BIAS_DTYPES:
        raise ValueError(f"fa3gen: attn_bias must be float32, bfloat16 or float16, got {bias.dtype}")
    return _BIAS_DTYPES[bias.dtype]


def spec_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool,
                   variant: VariantArgs, variant_spec: KernelSpec | None,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``flash_attn_func`` with a variant spec or a built-in mask's tensors; `variant`
    holds the call's values (built-ins by their arguments, params by name)."""
    ops._check_meta(q, k, v)
    spec = _spec_for(q, v, bool(causal), variant, variant_spec)
    variant.check(spec)
    given_bias = variant.params.get("attn_bias") if spec.bias else None
    bias = None
    if torch.is_grad_enabled():
        wanting = sorted(name for name, t in variant.params.items() if isinstance(t, torch.Tensor) and t.requires_grad)
        if given_bias is not None and "attn_bias" in wanting:
            wanting.remove("attn_bias")
            bias = given_bias
            try:  # the gradient's backward spec, refused now rather than at backward
                _backward_spec(spec, bool(deterministic), True)
            except pydantic.ValidationError as err:
                reason = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
                raise ValueError(f"fa3gen: attn_bias requires grad, but its gradient is not available: {reason}") from None
        if wanting:
            raise NotImplementedError(f"fa3gen: {', '.join(wanting)} require(s) grad, but param tensors other than "
                                      "attn_bias get no gradient (q, k and v do): detach them")
    if isinstance(given_bias, torch.Tensor):  # after the grad check: a padded copy does not require grad
        bias_arg = broadcast_bias(given_bias, q, k, aligned_rows=spec.bias_staging)
        variant = dataclasses.replace(variant, params={**variant.params, "attn_bias": bias_arg})
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    kernel = _kernel(spec)
    return _SpecAttention.apply(q, k, v, bias, kernel, scale, variant, bool(deterministic))


def broadcast_bias(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, aligned_rows: bool = False) -> torch.Tensor:
    """attn_bias of (batch or 1, nheads_q or 1, seqlen_q, seqlen_k) expanded to the full shape
    (stride 0 where it broadcasts), its keys made contiguous where they are not (the kernels
    read a tile's keys at consecutive addresses); any other shape is left for the kernel's check.
    aligned_rows (a bias_staging kernel): copied with rows padded to 16 bytes where they are not."""
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if bias.dim() != 4 or not all(n in (m, 1) if d < 2 else n == m for d, (n, m) in enumerate(zip(bias.shape, full))):
        return bias
    if bias.shape[3] > 1 and bias.stride(3) != 1:
        bias = bias.contiguous()
    if aligned_rows and not bias_rows_aligned(bias):
        with torch.no_grad():  # the kernel's copy; the caller's bias stays the autograd input
            bias = empty_with_aligned_rows(tuple(bias.shape), bias.dtype, bias.device).copy_(bias)
    return bias.expand(full)


def call_params(document_ids: torch.Tensor | None, prefix_lengths: torch.Tensor | None,
                attn_bias: torch.Tensor | None, variant_params: dict[str, Any] | None) -> dict[str, Any]:
    """The call's params by name: the variant spec's, and the built-ins' tensors."""
    params = dict(variant_params or {})
    for name, value in (("document_ids", document_ids), ("prefix_lengths", prefix_lengths), ("attn_bias", attn_bias)):
        if value is None:
            continue
        if name in params:
            raise ValueError(f"fa3gen: {name} is given twice (as an argument and in variant_params)")
        params[name] = value
    return params
