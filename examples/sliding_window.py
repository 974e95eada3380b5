"""Sliding-window (local) attention with fa3gen's built-in window: FlashAttention's
window_size=(left, right), sizes given per call. Key blocks wholly outside the band are never
loaded, so a 1k window at 16k keys costs about a sixteenth of full attention.

Run on a Hopper GPU: python examples/sliding_window.py
Elsewhere it renders the window kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

from common import check_builtin_variant, random_qkv, runs_here

import fa3gen


def main() -> None:
    if not runs_here(fa3gen.KernelSpec(head_dim=128, causal=True, window=True),
                     fa3gen.KernelSpec(head_dim=128, window=True)):
        return
    q, k, v = random_qkv(2, 4096, 8, 128)
    out = fa3gen.flash_attn_func(q, k, v, causal=True, window_size=(1024, 0))  # each query sees its last 1025 keys
    print("causal 1k window:", tuple(out.shape))
    for causal, window in ((True, (1024, 0)), (False, (512, 512))):
        check_builtin_variant(f"window {window}{' causal' if causal else ''}", q, k, v, causal, window_size=window)


if __name__ == "__main__":
    main()
