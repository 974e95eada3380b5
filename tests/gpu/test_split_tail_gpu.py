"""split_tail on the GPU: the last wave's tiles cut along the keys and merged, against float64.

Causal kernels too: sq <= sk aligns the diagonal bottom-right, so a share past a tile's last
visible key block is an empty piece, which hands its owner an empty partial (or is the owner's).

Each shape leaves a partial wave (or fewer tiles than SMs) with enough key blocks to split, so
tiles run in pieces on several CTAs, whose owner merges them: many pieces per tile (a few tiles
over every SM), shares of one key block or none (fewer key blocks than CTAs), a ragged last key
block inside a piece, GQA, sq != sk, a tile's rows past seqlen_q. Outputs are NaN-poisoned; each
kernel runs twice on fresh inputs (the arrival counters must be back at zero after a launch) and
must match the same tiles without the split within the reference's tolerance.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import fa3gen
from fa3gen import fp8
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_launch
from test_fp8_gpu import check as check_fp8
from test_fp8_gpu import ramped

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]


def _split(spec: fa3gen.KernelSpec) -> fa3gen.KernelSpec:
    return fa3gen.KernelSpec(**{**spec.model_dump(exclude_unset=True), "split_tail": True})


REGISTRY = fa3gen.registry.REGISTRY
# The registry's not-causal kernels with the split: three warpgroups in the serial loop (lazy
# rescale), chained pingpong tiles with Q in registers a tile ahead, chained 192-row tiles, four
# warpgroups, O staged in the V buffer (the producer stores only the tiles this CTA owns), one
# plain launch of pingpong tiles that do not chain.
# (The registry's twins: hdim 128's 192-row ones on the low rule of registry.SPLIT_TWIN_FIELDS.)
SPECS = [REGISTRY[name + "_split"] for name in ("fwd_d128_bf16_long", "fwd_d128_fp16_long", "fwd_d128_bf16_short",
                                                "fwd_d64_fp16", "fwd_d64_bf16_short", "fwd_d256_bf16")]
SPECS += [fa3gen.KernelSpec(head_dim=128, inter_tile_overlap=False, programmatic_launch=False, split_tail=True)]
# Causal twins (static schedule; a share past a tile's last visible block is an empty piece): one Q
# buffer with Q in registers, four warpgroups trimmed per warpgroup, hdim 256 on 80-key blocks.
SPECS += [REGISTRY[name] for name in ("fwd_d128_bf16_causal_split", "fwd_d64_bf16_causal_short_split",
                                      "fwd_d256_fp16_causal_split")]
# Three warpgroups in the serial loop; chained pingpong tiles with lazy rescale (O's V unit moves).
FP8_SPECS = [REGISTRY["fwd_d128_e4m3_long_split"], _split(REGISTRY["fwd_d256_e4m3"]),
             REGISTRY["fwd_d128_e4m3_causal_short_split"], REGISTRY["fwd_d256_e4m3_causal_split"]]
# Every other e4m3 twin: 128 x 192 pingpong (hdim 64 and 128, causal with Q in registers), hdim 64
# 192 x 128 overlapped and 192 x 256 serial (fp16 scores), causal trimmed on three stages and
# untrimmed.
FP8_SPECS += [REGISTRY[f"fwd_d{d}_e4m3{c}_split"] for d in (64, 128) for c in ("", "_causal")]
FP8_SPECS += [REGISTRY[f"fwd_d64_e4m3{b}_split"] for b in ("_short", "_long", "_causal_short", "_causal_long")]
# hdim 128's 256-key fp16-score twins: 128 x 256 pingpong not causal, 192 x 256 trimmed causal.
FP8_SPECS += [REGISTRY[f"fwd_d128_e4m3{b}_split"] for b in ("_short", "_causal_long")]
# hdim 256's 128 x 192 fp16-score twins (O staged in the V buffer, one Q buffer).
FP8_SPECS += [REGISTRY[f"fwd_d256_e4m3{b}_split"] for b in ("_long", "_causal_long")]
# (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv): 44 tiles of 192 rows over 132 CTAs; 5 whole
# waves and 44 split tiles; 16 tiles of 40 key blocks; one tile of 6 key blocks (shares of one
# block or none); sq = 1; a partial wave of 113-row heads.
SHAPES = [(1, 2000, 2000, 4, 2), (2, 4096, 4096, 16, 16), (1, 300, 5000, 8, 1), (1, 100, 700, 1, 1),
          (3, 1, 2049, 2, 1), (8, 113, 3000, 40, 8)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    fa3gen.build_many(SPECS + FP8_SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_split_tail_matches_reference(spec):
    kernel = fa3gen.compile(spec)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(spec.name.encode()))
    for b, sq, sk, hq, hkv in SHAPES:
        for _ in range(2):
            q = torch.randn(b, sq, hq, spec.head_dim, device="cuda", dtype=dtype, generator=gen)
            kv = torch.randn(b, sk, 2, hkv, spec.head_dim, device="cuda", dtype=dtype, generator=gen)
            rel = check_poisoned_launch(q, kv[:, :, 0], kv[:, :, 1], spec.causal, kernel, VariantArgs(),
                                        tol=8e-3 if dtype == torch.bfloat16 else 1e-3, lse_tol=1e-3)
            print(f"{spec.name} {(b, sq, sk, hq, hkv)}: O rel err {rel:.2e}")


@pytest.mark.parametrize("spec", FP8_SPECS, ids=lambda s: s.name)
def test_split_tail_fp8_matches_dequantized_reference(spec):
    """Per-block K and V factors (a ramp along the keys): pieces of one tile run under different
    V units, which the merge must bring to the owner's."""
    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        for rerun in range(2):
            seed = 300 + 10 * i + 5 * rerun
            q, k, v = (ramped(b, s, h, spec.head_dim, seed + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
            check_fp8(fp8.prepare(q, k, v, "block", hadamard=True, seed=i), spec.causal, kernel=kernel)


def test_the_op_takes_the_twin_for_small_problems():
    """flash_attn_func's dispatch: the registry kernel's split twin for problems of a wave or two of
    tiles (fa3gen.split_tail.splits) and, on hdim 128's 192-row twins' low rule, the FA3 grid's 8k
    and 16k; the kernel itself for the rest; either matches float64."""
    from fa3gen import ops
    from gpu_checks import check_poisoned_outputs
    from fa3gen.reference import attention_reference

    gen = torch.Generator(device="cuda").manual_seed(5)
    for b, sq, sk, h, d, split, causal in [(1, 4096, 4096, 8, 128, True, False), (4, 128, 16384, 8, 128, True, False),
                                           (1, 4096, 4096, 2, 256, True, False), (1, 8192, 8192, 4, 64, True, False),
                                           (4, 4096, 4096, 16, 128, False, False), (2, 1024, 1024, 8, 128, False, False),
                                           (2, 8192, 8192, 16, 128, True, False), (1, 1216, 3072, 16, 128, False, False),
                                           (4, 128, 16384, 8, 128, True, True), (4, 4096, 4096, 16, 128, False, True)]:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), device="cuda")
        kernel, _ = ops._launch(q, k, v, out, lse, d ** -0.5, causal)
        torch.cuda.synchronize()
        assert kernel.spec.split_tail is split and kernel.spec.causal is causal, (b, sq, sk, h, d, kernel.spec.name)
        ref, ref_lse = attention_reference(q, k, v, d ** -0.5, causal)
        check_poisoned_outputs(out, lse, ref, ref_lse, 8e-3, 1e-3, f"{kernel.spec.name} {(b, sq, sk, h, d)}")


def test_the_fp8_op_takes_the_twin_for_small_problems():
    """fa3gen.fp8_ops' dispatch: the e4m3 registry kernel's split twin for problems the rule
    splits (hdim 128's FA3-grid 8k on the low rule, hdim 256's 128 x 192 twin only on its 35%
    rule, causal twins only below a wave of tiles), the kernel itself for the rest; either matches
    the dequantized inputs' float64."""
    from fa3gen import fp8_ops

    for i, (b, sq, sk, h, d, split, causal) in enumerate([
            (1, 8192, 8192, 4, 128, True, False), (4, 128, 16384, 8, 128, True, False),
            (1, 4096, 4096, 2, 256, False, False), (4, 128, 16384, 8, 256, True, False), (2, 1024, 1024, 8, 128, False, False),
            (2, 8192, 8192, 16, 128, True, False), (1, 1216, 3072, 16, 128, False, False),
            (4, 128, 16384, 8, 128, True, True), (2, 128, 8192, 8, 256, True, True), (1, 4096, 4096, 6, 256, False, True)]):
        q, k, v = (ramped(b, s, h, d, 400 + 10 * i + j) for j, s in enumerate((sq, sk, sk)))
        inputs = fp8.prepare(q, k, v, "block", hadamard=True, seed=i)
        kernel = fp8_ops._checked_kernel(inputs, "bf16", causal, False)
        assert kernel.spec.split_tail is split, (b, sq, sk, h, d, kernel.spec.name)
        check_fp8(inputs, causal)


def test_split_tail_fp8_v_transposed_in_kernel():
    """The producer warpgroup's V transpose walks the same pieces as the loads (its key ranges)."""
    spec = _split(fa3gen.registry.default_fp8_spec(128, 128, "bf16", False, v_transpose_in_kernel=True))
    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES[:4]):
        q, k, v = (ramped(b, s, h, 128, 500 + 10 * i + j) for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        check_fp8(fp8.prepare(q, k, v, "block", hadamard=True, seed=i, kernel_v_layout=False), False, kernel=kernel)
