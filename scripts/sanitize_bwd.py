"""A tiny backward workload for compute-sanitizer (device_run.sh's sanitize step): ragged, GQA,
sq != sk, causal and not, deterministic and not, built-in variants, through autograd. Prints one
line per case."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa3gen  # noqa: E402

CASES = [  # b, sq, sk, hq, hkv, d, dtype, causal, deterministic[, variant]
    (1, 77, 200, 4, 2, 128, torch.bfloat16, True, False),
    (2, 150, 70, 2, 1, 64, torch.float16, True, True),
    # hdim 64: K and V in registers, reloaded for each of a persistent CTA's key blocks.
    (2, 300, 400, 4, 2, 64, torch.bfloat16, False, False),
    # hdim 64 and 96 run each step's dQ in one warpgroup, the two taking turns (dq_single_warpgroup):
    # several key blocks per persistent CTA with an odd number of steps each, so the turns and the
    # two dQ buffers fall differently from one key block to the next.
    (3, 130, 4500, 2, 2, 64, torch.bfloat16, False, False),
    # hdim 96: each step's dQ GEMM issued in the next step (dq_deferred); steps across the heads
    # of a GQA group, and a key block with one step.
    (1, 130, 130, 3, 3, 96, torch.bfloat16, False, True),
    (2, 300, 400, 4, 2, 96, torch.float16, True, False),
    (1, 40, 200, 2, 2, 96, torch.bfloat16, False, False),
    (1, 64, 300, 2, 2, 128, torch.float16, False, False),
    # hdim 128, causal and deterministic, with the dQ in one warpgroup at the step's end and the
    # producer at 24 registers: 216 key blocks over the persistent CTAs, GQA.
    (3, 200, 4500, 4, 2, 128, torch.bfloat16, True, True),
    # Head-dim split (P and dS exchanged through shared memory), one stage at 256.
    (1, 100, 190, 2, 1, 256, torch.bfloat16, True, False),
    (2, 70, 130, 2, 2, 192, torch.float16, False, True),
    # A window's key blocks skip the query blocks outside the band (deterministic: its dQ order
    # starts at the band's first key block); softcap's derivative in dS.
    (1, 300, 500, 4, 2, 128, torch.bfloat16, True, True, dict(window_size=(100, 0))),
    (2, 200, 150, 4, 2, 128, torch.bfloat16, False, False, dict(softcap=5.0)),
]

for b, sq, sk, hq, hkv, d, dt, causal, det, *variant in CASES:
    variant = variant[0] if variant else {}
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt, requires_grad=True)
    out = fa3gen.flash_attn_func(q, k, v, causal=causal, deterministic=det, **variant)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    print("ok", (b, sq, sk, hq, hkv, d, dt, causal, det, variant), "finite grads:", finite, flush=True)
