"""Float64 reference attention: the ground truth for tests and the bench's spot check.

Same conventions as ``fa3gen.flash_attn_func``: (batch, seqlen, nheads, head_dim) layout, GQA
(query head h reads kv head h // (nheads_q // nheads_kv)), causal aligned to the bottom-right
corner (query i sees key j iff j <= i + seqlen_k - seqlen_q), and a query row that sees no key
gets out = 0 and lse = -inf. ``attention_reference_grads`` gives the float64 gradients of the same
attention, variants included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["attention_reference", "attention_reference_grads", "causal_mask"]

# Bytes of float64 scores materialized at once; queries are processed in chunks to stay below.
_SCORE_BYTES_BUDGET = 1 << 30


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k), True where query i may see key j (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def _problem(who: str, *tensors: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    """(b, sq, hq, d, sk, hkv, dv) of q, k, v (and more 4-D tensors), checked for rank and GQA."""
    if any(t.dim() != 4 for t in tensors):
        names = ", ".join(("q", "k", "v", "dout")[: len(tensors)])
        raise ValueError(f"{who}: {names} must be 4-D (batch, seqlen, nheads, head_dim)")
    q, k, v = tensors[:3]
    b, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{who}: nheads_q {hq} is not a multiple of nheads_kv {hkv}")
    return b, sq, hq, d, sk, hkv, v.shape[-1]


@dataclass(frozen=True)
class Variants:
    """The variants of one reference call, as ``flash_attn_func`` and the spec define them."""

    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    score_mod: Callable[..., torch.Tensor] | None = None
    mask_mod: Callable[..., torch.Tensor] | None = None
    attn_bias: torch.Tensor | None = None


def _scores(qc: torch.Tensor, kf: torch.Tensor, start: int, sq: int, scale: float,
            var: Variants) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores of query rows [start, start + len) against every key, float64 (b, hq, rows, sk):
    scaled, modified in the spec's order (softcap, alibi, attn_bias, score_mod), hidden keys at -inf
    (causal, window, mask_mod). Also d(score)/d(q·k · scale) of every element (None when it is 1)."""
    b, hq, rows, _ = qc.shape
    sk = kf.shape[2]
    device = qc.device
    s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
    bi = torch.arange(b, device=device).view(b, 1, 1, 1)
    hi = torch.arange(hq, device=device).view(1, hq, 1, 1)
    i = torch.arange(start, start + rows, device=device).view(1, 1, -1, 1)
    j = torch.arange(sk, device=device).view(1, 1, 1, sk)
    diagonal = i + (sk - sq)  # key aligned with query i (bottom-right)
    grad = None
    if var.softcap > 0:
        t = torch.tanh(s / var.softcap)
        s, grad = var.softcap * t, 1 - t * t
    if var.alibi_slopes is not None:
        slopes = var.alibi_slopes.to(torch.float64).reshape(-1, hq)  # (1 or b, hq)
        s = s - slopes.view(-1, hq, 1, 1) * (diagonal - j).abs()
    if var.attn_bias is not None:
        s = s + var.attn_bias[:, :, start:start + rows].to(torch.float64)
    if var.score_mod is not None:
        # Its derivative by autograd (it is elementwise), on s itself when a caller differentiates
        # through the reference (the graph is kept for that caller), else on a detached copy.
        differentiated = s.requires_grad
        with torch.enable_grad():
            s_in = s if differentiated else s.detach().requires_grad_()
            s_out = var.score_mod(s_in, bi, hi, i, j).to(torch.float64).expand_as(s_in)
            depends = s_out.requires_grad  # False: the score_mod ignores the score
            mod_grad = (torch.autograd.grad(s_out.sum(), s_in, retain_graph=differentiated)[0] if depends
                        else torch.zeros_like(s))
        s = s_out if differentiated else s_out.detach()
        grad = mod_grad if grad is None else grad * mod_grad
    visible = torch.ones_like(s, dtype=torch.bool)
    left, right = var.window_size
    if var.causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    if var.mask_mod is not None:
        visible &= var.mask_mod(bi, hi, i, j)
    return s.masked_fill(~visible, float("-inf")), grad


def _probabilities(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over keys and the rows' LSE (-inf, with P = 0, for a row that sees no key)."""
    row_lse = torch.logsumexp(s, dim=-1)
    visible = torch.isfinite(row_lse)
    p = torch.exp(s - torch.where(visible, row_lse, torch.zeros_like(row_lse)).unsqueeze(-1))
    return torch.where(visible.unsqueeze(-1), p, torch.zeros_like(p)), row_lse


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as float64 (b, heads, seqlen, dim), k and v repeated over each GQA group."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.to(torch.float64).permute(0, 2, 1, 3) for t in (q, k, v))
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    return qf, kf, vf


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    score_mod: Callable[..., torch.Tensor] | None = None,
    mask_mod: Callable[..., torch.Tensor] | None = None,
    attn_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64 on the tensors' device.

    Args: q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv), any dtype and strides.
    Variants, as ``flash_attn_func`` and the spec define them, applied to the scaled score in this
    order: softcap, alibi_slopes, attn_bias (added; (b or 1, hq or 1, sq, sk)), score_mod, then the
    masks (causal, window_size, mask_mod).
    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` get
    broadcastable tensors (float64 scores, int64 indices of shapes (b,1,1,1), (1,h,1,1),
    (1,1,sq,1), (1,1,1,sk)) and return the new scores / a bool mask.
    Returns: out (b, sq, hq, dv) float64 and lse (b, hq, sq) float64 (natural log).
    """
    b, sq, hq, d, sk, hkv, dv = _problem("attention_reference", q, k, v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    var = Variants(causal, tuple(window_size), softcap, alibi_slopes, score_mod, mask_mod, attn_bias)
    out = torch.zeros((b, hq, sq, dv), dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64, device=q.device)
    if b == 0 or hq == 0 or sq == 0 or sk == 0:
        return out.permute(0, 2, 1, 3).contiguous(), lse
    qf, kf, vf = _heads_first(q, k, v)
    chunk = max(1, _SCORE_BYTES_BUDGET // (8 * b * hq * sk))
    for start in range(0, sq, chunk):
        stop = min(sq, start + chunk)
        s, _ = _scores(qf[:, :, start:stop], kf, start, sq, softmax_scale, var)
        p, row_lse = _probabilities(s)
        out[:, :, start:stop] = torch.matmul(p, vf)
        lse[:, :, start:stop] = row_lse
    return out.permute(0, 2, 1, 3).contiguous(), lse


def attention_reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    score_mod: Callable[..., torch.Tensor] | None = None,
    mask_mod: Callable[..., torch.Tensor] | None = None,
    attn_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention in float64 on the tensors' device, variants as ``attention_reference``.

    Args: q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv), dout (b, sq, hq, dv), any dtype
    and strides. Returns (dq, dk, dv) float64, shaped like q, k, v: the gradients of
    ``attention_reference``'s out for the output gradient dout (GQA: a kv head's gradient sums over
    its query heads; a query row that sees no key contributes nothing and gets dq = 0; alibi_slopes,
    attn_bias and the mods' tensors are constants).

    Closed form, query chunk by query chunk (no autograd graph; memory stays near the forward's):
    P = softmax(S), dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)) ∘ S', where S' is the
    derivative of the modified score by the scaled one (softcap: 1 − tanh², score_mod: by
    autograd), dQ = scale · dS·K, dK = scale · dSᵀ·Q.
    """
    b, sq, hq, d, sk, hkv, dv = _problem("attention_reference_grads", q, k, v, dout)
    if tuple(dout.shape) != (b, sq, hq, dv):
        raise ValueError(f"attention_reference_grads: dout must have shape {(b, sq, hq, dv)}, got {tuple(dout.shape)}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    var = Variants(causal, tuple(window_size), softcap, alibi_slopes, score_mod, mask_mod, attn_bias)
    group = hq // hkv
    dq = torch.zeros((b, hq, sq, d), dtype=torch.float64, device=q.device)
    dk = torch.zeros((b, hq, sk, d), dtype=torch.float64, device=q.device)
    dvv = torch.zeros((b, hq, sk, dv), dtype=torch.float64, device=q.device)
    if b and hq and sq and sk:
        qf, kf, vf = _heads_first(q, k, v)
        dof = dout.to(torch.float64).permute(0, 2, 1, 3)  # (b, hq, sq, dv)
        chunk = max(1, _SCORE_BYTES_BUDGET // (5 * 8 * b * hq * sk))  # s, grad, p, dp, ds of a chunk at once
        for start in range(0, sq, chunk):
            stop = min(sq, start + chunk)
            qc, doc = qf[:, :, start:stop], dof[:, :, start:stop]
            s, score_grad = _scores(qc, kf, start, sq, softmax_scale, var)
            p, _ = _probabilities(s)
            dvv += torch.matmul(p.transpose(-1, -2), doc)
            dp = torch.matmul(doc, vf.transpose(-1, -2))
            rowsum = (doc * torch.matmul(p, vf)).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O)
            ds = p * (dp - rowsum)
            if score_grad is not None:
                ds = ds * score_grad.masked_fill(p == 0, 0)  # no 0 · inf from hidden entries
            dq[:, :, start:stop] = torch.matmul(ds, kf) * softmax_scale
            dk += torch.matmul(ds.transpose(-1, -2), qc) * softmax_scale
    dk = dk.view(b, hkv, group, sk, d).sum(dim=2)
    dvv = dvv.view(b, hkv, group, sk, dv).sum(dim=2)
    return (dq.permute(0, 2, 1, 3).contiguous(), dk.permute(0, 2, 1, 3).contiguous(),
            dvv.permute(0, 2, 1, 3).contiguous())
