"""The GPU tests' shared pieces: prebuilding their kernels, the check that launches into
NaN-poisoned outputs and compares with float64, and the rule for gradients that are 0."""

from __future__ import annotations

import math

import torch

from fa3gen.ops import _launch
from fa3gen.reference import attention_reference


def prebuild(specs) -> None:
    """Build (or load) a module's kernels once, in parallel, before its tests. A failure is only
    printed: the failing specs' tests report it, the others still run."""
    import fa3gen

    try:
        fa3gen.build_many(specs)
    except Exception as e:
        print(f"warning: prebuilding kernels failed: {e}")


def poison_allocator(*shapes_dtypes):
    """Fill blocks of these sizes with NaN and free them into the caching allocator, so the outputs
    a call allocates next start as NaN."""
    blocks = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in shapes_dtypes]
    ptrs = [t.data_ptr() for t in blocks]
    del blocks
    return ptrs


def check_poisoned_launch(q, k, v, causal, kernel, variant, tol, lse_tol=1e-3, **reference_variant):
    """Runs into NaN-poisoned outputs and compares out and lse with the float64 reference."""
    b, sq, hq, _ = q.shape
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.full((b, sq, hq, v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    _launch(q, k, v, out, lse, scale, causal, kernel, variant)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, scale, causal, **reference_variant)
    rel, _ = check_poisoned_outputs(out, lse, ref, ref_lse, tol, lse_tol, f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    return rel


def check_poisoned_outputs(out, lse, ref, ref_lse, tol, lse_tol, what: str) -> tuple[float, float]:
    """The checks of a launch into NaN-poisoned out and lse against the float64 reference: every
    output written, rows that see no key exactly 0 and -inf, the relative error of out and the
    largest absolute error of the visible rows' lse under their bounds. Returns both errors."""
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten outputs"
    visible = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~visible]).all(), "rows that see no key: lse must be -inf"
    assert (out.permute(0, 2, 1, 3)[~visible] == 0).all(), "rows that see no key: out must be 0"
    rel = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    assert rel < tol, f"{what}: rel err {rel:.2e} >= {tol:.0e}"
    lse_err = float((lse[visible].double() - ref_lse[visible]).abs().max()) if visible.any() else 0.0
    assert lse_err < lse_tol, f"{what}: lse err {lse_err:.2e} >= {lse_tol:.1e}"
    return rel, lse_err


def reference_gradient_is_zero(name: str, g: torch.Tensor, ref: torch.Tensor, eps: float) -> bool:
    """True, after checking that `g` is ~0 too, when the float64 gradient `ref` is 0 up to noise.

    Every visible row sees one key (seqlen_k 1, a window (0, 0)): the softmax is constant and dq, dk
    are 0 up to float64 noise, which no relative error can be taken against. The inputs are
    unit-scale, so an rms of fp32 rounding noise passes, a wrong kernel's O(0.1) does not.
    """
    if not (ref.numel() and float(ref.norm()) <= 1e-10 * math.sqrt(ref.numel())):
        return False
    rms = float(g.double().norm()) / math.sqrt(g.numel())
    assert rms <= eps, f"{name} should be ~0 (one key per row), rms {rms:.3e}"
    return True
