"""The GPU tests' shared pieces: prebuilding their kernels, and the check that launches into
NaN-poisoned outputs and compares with float64."""

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


def check_poisoned_launch(q, k, v, causal, kernel, variant, tol, lse_tol=1e-3, **reference_variant):
    """Runs into NaN-poisoned outputs and compares out and lse with the float64 reference."""
    b, sq, hq, _ = q.shape
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.full((b, sq, hq, v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    _launch(q, k, v, out, lse, scale, causal, kernel, variant)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, scale, causal, **reference_variant)
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten outputs"
    visible = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~visible]).all(), "rows that see no key: lse must be -inf"
    assert (out.permute(0, 2, 1, 3)[~visible] == 0).all(), "rows that see no key: out must be 0"
    rel = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    assert rel < tol, f"q {tuple(q.shape)}, k {tuple(k.shape)}: rel err {rel:.2e} >= {tol:.0e}"
    lse_err = float((lse[visible].double() - ref_lse[visible]).abs().max()) if visible.any() else 0.0
    assert lse_err < lse_tol, f"lse err {lse_err:.2e}"
    return rel
