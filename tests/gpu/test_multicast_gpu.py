"""K/V multicast across clusters of two CTAs (kv_multicast) on the GPU, against float64.

The two CTAs of a cluster take adjacent query blocks of one (batch, head) and each loads half of
every K and V block into both. The shapes give odd query-block counts (a cluster's second tile
lies past seqlen_q and stores nothing), one query, GQA, sq != sk, and ~8 tiles per cluster (the
stages and Q buffers wrap around, tiles chain into each other); outputs are NaN-poisoned.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import fa3gen
from fa3gen import fp8
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_launch, prebuild

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

# The tiles it was written for: hdim 128 on 128 rows (pingpong, chained tiles, O through its TMA
# store), 192 rows on three warpgroups, hdim 64, and hdim 256 with O stored from registers and
# softcap (a variant that keeps every tile's key range).
SPECS = [
    fa3gen.KernelSpec(head_dim=128, kv_multicast=True),
    fa3gen.KernelSpec(head_dim=128, block_m=192, kv_multicast=True),
    fa3gen.KernelSpec(head_dim=64, kv_multicast=True, dtype="fp16"),
    fa3gen.KernelSpec(head_dim=256, epilogue="direct", softcap=True, kv_multicast=True),
]
FP8_SPECS = [fa3gen.KernelSpec(head_dim=d, dtype="e4m3", kv_multicast=True) for d in (128, 256)]
SHAPES = [(2, 1000, 1000, 4, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 4, 4), (3, 1, 2049, 2, 1),
          (1, 385, 700, 2, 2), (8, 1000, 1000, 32, 8)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    prebuild(SPECS + FP8_SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_multicast_matches_reference(spec):
    kernel = fa3gen.compile(spec)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(spec.name.encode()))
    variant = VariantArgs(softcap=30.0) if spec.softcap else VariantArgs()
    for b, sq, sk, hq, hkv in SHAPES:
        q = torch.randn(b, sq, hq, spec.head_dim, device="cuda", dtype=dtype, generator=gen) * 3
        k, v = (torch.randn(b, sk, hkv, spec.head_dim, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        rel = check_poisoned_launch(q, k, v, False, kernel, variant, tol=8e-3 if dtype == torch.bfloat16 else 1e-3,
                                    lse_tol=1e-3, **({"softcap": 30.0} if spec.softcap else {}))
        print(f"{spec.name} q {tuple(q.shape)} k {tuple(k.shape)}: rel err {rel:.2e}")


@pytest.mark.parametrize("spec", FP8_SPECS, ids=lambda s: s.name)
def test_fp8_multicast_matches_dequantized_reference(spec):
    from test_fp8_gpu import check, ramped  # the fp8 tests' reference check and scale-varying inputs

    kernel = fa3gen.compile(spec)
    for i, (b, sq, sk, hq, hkv) in enumerate(SHAPES):
        q, k, v = (ramped(b, s, h, spec.head_dim, 70 + 10 * i + j)
                   for j, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv))))
        check(fp8.prepare(q, k, v, "block", (spec.block_m, spec.block_n), hadamard=True, seed=i), False, kernel=kernel)
