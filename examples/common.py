"""What the variant examples share: the Hopper check, random inputs, and errors against float64."""

from __future__ import annotations

from collections.abc import Iterable

import torch

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads


def runs_here(*specs: fa3gen.KernelSpec) -> bool:
    """Renders the example's kernels (printing their size), and says whether this machine can run
    them: a Hopper GPU (sm_90). Elsewhere it prints why not and the example stops there."""
    for spec in specs:
        print(f"{spec.name}: {len(fa3gen.render(spec))} characters of CUDA")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return True
    print("running these kernels needs a Hopper GPU (H100/H200); the specs above are valid and render")
    return False


def random_qkv(b: int, s: int, h: int, d: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def report(what: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    print(f"{what}: relative error vs float64 {rel_err(out, ref):.2e}")


def report_grads(what: str, grads: Iterable[torch.Tensor], refs: Iterable[torch.Tensor]) -> None:
    errors = ", ".join(f"{name} {rel_err(g, r):.2e}" for name, g, r in zip(("dq", "dk", "dv"), grads, refs))
    print(f"{what} backward: relative errors vs float64 {errors}")


def autograd_grads(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of fn(q, k, v) for the output gradient dout, through autograd."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    fn(qg, kg, vg).backward(dout)
    return qg.grad, kg.grad, vg.grad


def check_builtin_variant(what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                          **variant) -> None:
    """fa3gen.flash_attn_func with a built-in variant (window_size, softcap, alibi_slopes), forward
    and backward through autograd, against the float64 reference of the same variant."""
    out = fa3gen.flash_attn_func(q, k, v, causal=causal, **variant)
    report(what, out, attention_reference(q, k, v, None, causal, **variant)[0])
    dout = torch.randn_like(out)
    grads = autograd_grads(lambda a, b, c: fa3gen.flash_attn_func(a, b, c, causal=causal, **variant), q, k, v, dout)
    report_grads(what, grads, attention_reference_grads(q, k, v, dout, None, causal, **variant))
