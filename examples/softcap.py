"""Tanh soft-capping (Gemma 2, Grok): score = cap * tanh(score / cap), the cap given per call;
its gradient is built into the backward kernel. Composes with the causal mask and a window.

Run on a Hopper GPU: python examples/softcap.py
Elsewhere it renders the soft-capped kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

from common import check_builtin_variant, random_qkv, runs_here

import fa3gen


def main() -> None:
    if not runs_here(fa3gen.KernelSpec(head_dim=128, softcap=True),
                     fa3gen.KernelSpec(head_dim=128, causal=True, window=True, softcap=True)):
        return
    q, k, v = random_qkv(2, 4096, 8, 128)
    out = fa3gen.flash_attn_func(q, k, v, softcap=30.0)
    print("softcap 30:", tuple(out.shape))
    check_builtin_variant("softcap 30", q, k, v, False, softcap=30.0)
    check_builtin_variant("softcap 30, causal 1k window", q, k, v, True, softcap=30.0, window_size=(1024, 0))


if __name__ == "__main__":
    main()
