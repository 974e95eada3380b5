"""Sliding-window (local) attention with fa3gen's built-in window: FlashAttention's
window_size=(left, right), sizes given per call. Key blocks wholly outside the band are never
loaded, so a 1k window at 16k keys costs about a sixteenth of full attention.

Run on a Hopper GPU: python examples/sliding_window.py
Elsewhere it renders the window kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import autograd_grads, random_qkv, report, report_grads, runs_here

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads


def main() -> None:
    if not runs_here(fa3gen.KernelSpec(head_dim=128, causal=True, window=True),
                     fa3gen.KernelSpec(head_dim=128, window=True)):
        return
    q, k, v = random_qkv(2, 4096, 8, 128)
    for causal, window in ((True, (1024, 0)), (False, (512, 512))):
        what = f"window {window}{' causal' if causal else ''}"
        out = fa3gen.flash_attn_func(q, k, v, causal=causal, window_size=window)
        report(what, out, attention_reference(q, k, v, None, causal, window_size=window)[0])
        dout = torch.randn_like(out)
        grads = autograd_grads(lambda a, b, c: fa3gen.flash_attn_func(a, b, c, causal=causal, window_size=window),
                               q, k, v, dout)
        report_grads(what, grads, attention_reference_grads(q, k, v, dout, None, causal, window_size=window))


if __name__ == "__main__":
    main()
