"""Tanh soft-capping (Gemma 2, Grok): score = cap * tanh(score / cap), the cap given per call;
its gradient is built into the backward kernel. Composes with the causal mask and a window.

Run on a Hopper GPU: python examples/softcap.py
Elsewhere it renders the soft-capped kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import autograd_grads, random_qkv, report, report_grads, runs_here

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads


def main() -> None:
    if not runs_here(fa3gen.KernelSpec(head_dim=128, softcap=True),
                     fa3gen.KernelSpec(head_dim=128, causal=True, window=True, softcap=True)):
        return
    q, k, v = random_qkv(2, 4096, 8, 128)
    for causal, variant in ((False, dict(softcap=30.0)), (True, dict(softcap=30.0, window_size=(1024, 0)))):
        what = f"{variant}{' causal' if causal else ''}"
        out = fa3gen.flash_attn_func(q, k, v, causal=causal, **variant)
        report(what, out, attention_reference(q, k, v, None, causal, **variant)[0])
        dout = torch.randn_like(out)
        grads = autograd_grads(lambda a, b, c: fa3gen.flash_attn_func(a, b, c, causal=causal, **variant), q, k, v, dout)
        report_grads(what, grads, attention_reference_grads(q, k, v, dout, None, causal, **variant))


if __name__ == "__main__":
    main()
