"""A sample of schedule-switch combinations on the GPU, against the float64 reference.

The registry kernels (tests in test_fwd_gpu.py) use the default switches; these run the others
(pingpong, no overlap, one CTA per tile, the static persistent order for causal, lpt when not
causal, O stored from registers at hdim 128, O staged in the V buffer, a plain launch, three Q
buffers, four consumer warpgroups) on ragged, GQA, sq != sk shapes into NaN-poisoned outputs.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import fa3gen
from fa3gen.reference import attention_reference
from fa3gen.variant_args import VariantArgs
from gpu_checks import check_poisoned_launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper (sm_90) GPU"),
]

SPECS = [
    fa3gen.KernelSpec(head_dim=128, pingpong=True),
    fa3gen.KernelSpec(head_dim=128, intra_wg_overlap=False),
    fa3gen.KernelSpec(head_dim=128, intra_wg_overlap=False, pingpong=True),
    fa3gen.KernelSpec(head_dim=128, scheduler="grid"),
    fa3gen.KernelSpec(head_dim=128, causal=True, scheduler="grid"),
    fa3gen.KernelSpec(head_dim=128, causal=True, scheduler="static"),
    fa3gen.KernelSpec(head_dim=128, scheduler="lpt"),
    fa3gen.KernelSpec(head_dim=128, epilogue="direct"),
    fa3gen.KernelSpec(head_dim=128, causal=True, epilogue="direct"),
    fa3gen.KernelSpec(head_dim=128, causal=True, pingpong=True, dtype="fp16"),
    fa3gen.KernelSpec(head_dim=128, q_buffers=1),
    fa3gen.KernelSpec(head_dim=128, causal=True, q_buffers=1),
    fa3gen.KernelSpec(head_dim=128, inter_tile_overlap=True),
    fa3gen.KernelSpec(head_dim=128, causal=True, inter_tile_overlap=True),
    fa3gen.KernelSpec(head_dim=64, causal=True, block_m=128, inter_tile_overlap=True, dtype="fp16"),
    fa3gen.KernelSpec(head_dim=128, causal=True, pingpong=True, inter_tile_overlap=True),
    # O staged in the V buffer and stored by the producer: tiles without keys (sq > sk, causal)
    # stage zeros; each scheduler hands tiles over in its own order.
    fa3gen.KernelSpec(head_dim=256, epilogue="tma_v"),
    fa3gen.KernelSpec(head_dim=256, causal=True, epilogue="tma_v"),
    fa3gen.KernelSpec(head_dim=256, causal=True, epilogue="tma_v", scheduler="grid", dtype="fp16"),
    fa3gen.KernelSpec(head_dim=128, block_n=176, causal=True, epilogue="tma_v", scheduler="static"),
    # A plain launch (no programmatic dependent launch).
    fa3gen.KernelSpec(head_dim=128, causal=True, programmatic_launch=False),
    # Lazy rescale in the serial mainloop (the registry's kernels run it in the overlapped one).
    fa3gen.KernelSpec(head_dim=128, causal=True, intra_wg_overlap=False),
    # Per-warpgroup key trimming: three warpgroups on chained tiles, O in the V buffer (not
    # chained), pingpong on chained tiles (the trimmed blocks' turns), the serial mainloop.
    fa3gen.KernelSpec(head_dim=64, causal=True, block_m=192, block_n=128, num_consumer_warpgroups=3,
                      warpgroup_key_trim=True),
    fa3gen.KernelSpec(head_dim=256, causal=True, block_n=64, warpgroup_key_trim=True),
    fa3gen.KernelSpec(head_dim=128, causal=True, block_n=64, pingpong=True, warpgroup_key_trim=True),
    fa3gen.KernelSpec(head_dim=128, causal=True, block_n=64, intra_wg_overlap=False, warpgroup_key_trim=True),
    # Not causal: only a warpgroup whose rows all lie past seqlen_q (sq = 1, 113; the last tile of
    # 192-row tiles) trims, taking its pingpong turns without GEMMs. Chained into from a tile
    # whose last P·V is pending, it passes more blocks than there are stages (the 256 heads).
    fa3gen.KernelSpec(head_dim=128, pingpong=True, warpgroup_key_trim=True),
    fa3gen.KernelSpec(head_dim=64, warpgroup_key_trim=True),
    # The narrow edge block beside the registry's (hdim 64 and 192 causal, hdim 256 causal on 64
    # keys): three warpgroups without key trimming (a first block may be hidden from all of a
    # warpgroup's rows), Q in registers on one Q buffer, 80-key blocks (a 40-key WGMMA) with O in
    # the V buffer, pingpong on chained tiles in fp16.
    fa3gen.KernelSpec(head_dim=64, causal=True, warpgroup_key_trim=False, narrow_edge_block=True),
    fa3gen.KernelSpec(head_dim=128, causal=True, q_buffers=1, narrow_edge_block=True),
    fa3gen.KernelSpec(head_dim=256, causal=True, narrow_edge_block=True),
    fa3gen.KernelSpec(head_dim=128, causal=True, dtype="fp16", narrow_edge_block=True),
    # Three Q buffers: the next tile's Q a tile ahead with Q in shared memory, on the static and
    # the lpt schedule (the registry's hdim 64 tiles, causal ones trimmed, on three stages).
    fa3gen.KernelSpec(head_dim=64, q_buffers=3),
    fa3gen.KernelSpec(head_dim=64, causal=True, q_buffers=3, stages=3, warpgroup_key_trim=True, narrow_edge_block=True),
    fa3gen.KernelSpec(head_dim=96, causal=True, q_buffers=3, dtype="fp16"),
    # Four consumer warpgroups (256-row tiles, hdim 64 on 64-key blocks; the registry's up to 1k
    # use three stages): three Q buffers, causal untrimmed on the grid schedule, fp16 trimmed.
    fa3gen.KernelSpec(head_dim=64, block_m=256, block_n=64, q_buffers=3),
    fa3gen.KernelSpec(head_dim=64, causal=True, block_m=256, block_n=64, warpgroup_key_trim=False, scheduler="grid"),
    fa3gen.KernelSpec(head_dim=64, causal=True, block_m=256, block_n=64, stages=4, dtype="fp16"),
]
CUSTOM_SPEC = fa3gen.KernelSpec(head_dim=128, causal=True, block_n=112)  # outside the registry
# The last shapes have ~8 and ~16 tiles per CTA: Q buffers wrap around, and tiles chain into each
# other (with 256 heads, causal too: more last tiles than CTAs).
SHAPES = [(2, 1000, 1000, 4, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 4, 4), (3, 1, 2049, 2, 1), (4, 512, 512, 16, 16),
          (8, 1000, 1000, 16, 4), (8, 1000, 1000, 32, 8)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    fa3gen.build_many(SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_switch_combination_matches_reference(spec):
    kernel = fa3gen.compile(spec)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(spec.name.encode()))
    for b, sq, sk, hq, hkv in SHAPES:
        q = torch.randn(b, sq, hq, spec.head_dim, device="cuda", dtype=dtype, generator=gen)
        kv = torch.randn(b, sk, 2, hkv, spec.head_dim, device="cuda", dtype=dtype, generator=gen)
        k, v = kv[:, :, 0], kv[:, :, 1]
        check_poisoned_launch(q, k, v, spec.causal, kernel, VariantArgs(),
                              tol=8e-3 if dtype == torch.bfloat16 else 1e-3, lse_tol=1e-3)


def test_compiled_kernel_call_runs_a_custom_spec():
    """spec -> compile -> call: a spec outside the registry, called on torch tensors."""
    kernel = fa3gen.compile(CUSTOM_SPEC)
    gen = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 517, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out, lse = kernel(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, 1 / math.sqrt(128), True)
    assert float((out.double() - ref).norm() / ref.norm()) < 8e-3
    assert (lse.double() - ref_lse).abs().max() < 1e-3
    with pytest.raises(ValueError, match="takes bf16 with head_dim 128"):
        kernel(q.half(), k.half(), v.half())


@pytest.mark.parametrize("spec", [fa3gen.KernelSpec(head_dim=128), fa3gen.KernelSpec(head_dim=256, causal=True),
                                  fa3gen.KernelSpec(head_dim=128, causal=True, intra_wg_overlap=False)],
                         ids=lambda s: s.name)  # registry kernels, and the serial one of SPECS
def test_lazy_rescale_when_the_row_max_climbs(spec):
    """Lazy rescale keeps a row's stale running max while a key block's max exceeds it by less
    than 2^8 in probability. Keys scaled up toward the start of the row (visited last) raise every
    row's max block after block, by steps below and above that bound; O and LSE must stay exact
    against float64 (into NaN-poisoned outputs)."""
    assert spec.lazy_rescale
    kernel = fa3gen.compile(spec)
    gen = torch.Generator(device="cuda").manual_seed(31)
    d = spec.head_dim
    for b, sq, sk, hq, hkv in [(2, 1000, 3000, 4, 2), (1, 300, 1100, 8, 8)]:
        q = torch.randn(b, sq, hq, d, device="cuda", generator=gen)
        ramp = torch.linspace(6.0, 0.2, sk, device="cuda")[None, :, None, None]
        k = torch.randn(b, sk, hkv, d, device="cuda", generator=gen) * ramp
        v = torch.randn(b, sk, hkv, d, device="cuda", generator=gen)
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        check_poisoned_launch(q, k, v, spec.causal, kernel, VariantArgs(), tol=8e-3, lse_tol=2e-3)
