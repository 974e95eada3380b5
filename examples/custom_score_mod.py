"""A custom score_mod from the spec, FlexAttention-style: a C++ expression over score, b, h,
q_idx, kv_idx, seqlen_q, seqlen_k and declared params (runtime scalars, GPU tensors), compiled
into the kernel. Here a learned relative-position bias, one value per head and distance, times a
runtime gain. Its backward needs d(score_mod)/d(score) as `grad` (1 for an additive bias).

Run on a Hopper GPU: python examples/custom_score_mod.py
Elsewhere it renders the forward and backward kernels and says that running them needs a Hopper GPU.
"""

from __future__ import annotations

import torch
from common import random_qkv, report, report_grads, runs_here

import fa3gen
from fa3gen.reference import attention_reference, attention_reference_grads

RELATIVE_BIAS = fa3gen.KernelSpec(
    head_dim=128,
    score_mod={"expr": "score + gain * bias(h, q_idx - kv_idx + seqlen_k - 1)", "grad": "1.f"},
    params=[{"kind": "scalar", "name": "gain"}, {"kind": "tensor", "name": "bias", "ndim": 2}],
)


def main() -> None:
    if not runs_here(RELATIVE_BIAS, RELATIVE_BIAS.backward_spec()):
        return
    b, s, h = 2, 4096, 8
    q, k, v = random_qkv(b, s, h, 128)
    bias = torch.randn(h, 2 * s - 1, device="cuda")  # (heads, distances)
    fwd, bwd = fa3gen.compile(RELATIVE_BIAS), fa3gen.compile(RELATIVE_BIAS.backward_spec())

    def score_mod(score, bb, hh, i, j):  # the same variant for the float64 reference
        return score + 0.5 * bias.double()[hh, i - j + s - 1]

    out, lse = fwd(q, k, v, return_lse=True, gain=0.5, bias=bias)
    report("relative bias", out, attention_reference(q, k, v, score_mod=score_mod)[0])
    dout = torch.randn_like(out)
    grads = bwd.backward(dout, q, k, v, out, lse, gain=0.5, bias=bias)
    report_grads("relative bias", grads, attention_reference_grads(q, k, v, dout, score_mod=score_mod))


if __name__ == "__main__":
    main()
