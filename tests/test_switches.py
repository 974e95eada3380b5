"""Every combination of the schedule switches that the spec allows renders into the kernel it names.

(A sample of them is compiled for real in test_compile_real.py.)
"""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from fa3gen import KernelSpec, render
from fa3gen.spec import SUPPORTED_HEAD_DIMS

COMBOS = list(itertools.product(SUPPORTED_HEAD_DIMS, (False, True), (False, True), (False, True),
                                ("grid", "static", "lpt")))


@pytest.mark.parametrize("head_dim, causal, pingpong, overlap, scheduler", COMBOS)
def test_switch_combination_renders_its_schedule(head_dim, causal, pingpong, overlap, scheduler):
    fields = dict(head_dim=head_dim, causal=causal, pingpong=pingpong, intra_wg_overlap=overlap,
                  scheduler=scheduler)
    if pingpong and KernelSpec(head_dim=head_dim).num_consumer_warpgroups != 2:
        with pytest.raises(ValidationError, match="pingpong needs num_consumer_warpgroups=2"):
            KernelSpec(**fields)
        return
    spec = KernelSpec(**fields)
    src = render(spec)
    assert spec.canonical_json() in src
    # Each switch shows up as the code it selects, and only then.
    assert ("NamedBarrier::sync(kMmaThreads, kTurnBarrier + warpgroup)" in src) == pingpong
    assert ("warpgroup_wait<1>();" in src) == overlap
    assert ("return tile + int(gridDim.x);" in src) == (scheduler == "static")
    assert ("atomicAdd(p.tile_counter, 1)" in src) == (scheduler == "lpt")
    assert ("handoff.receive()" in src) == (scheduler == "lpt")
    assert ("constexpr int kWorkspaceBytes = 16;" in src) == (scheduler == "lpt")
    assert ("crosses_right_edge" in src) == causal  # the causal diagonal (no window here)
    assert ("tma_store_arrive();" in src) == (spec.epilogue == "tma")


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_epilogue_switch_renders_its_store(head_dim):
    """O goes through a TMA store where its staging tile fits in shared memory, else from registers."""
    direct = render(KernelSpec(head_dim=head_dim, epilogue="direct"))
    assert "tma_store_arrive();" not in direct and "SmemLayoutO" not in direct
    spec = KernelSpec(head_dim=head_dim)
    assert spec.epilogue == ("tma" if head_dim <= 128 else "direct")  # d192/d256: Q, K, V fill the SM
    if spec.epilogue == "direct":
        with pytest.raises(ValidationError, match="use epilogue='direct'"):
            KernelSpec(head_dim=head_dim, epilogue="tma")
    else:
        assert "tma_store_arrive();" in render(spec)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_q_buffers_two_where_they_fit(head_dim):
    """Two Q tiles by default where they fit beside K, V and the O staging tile: the producer then
    loads the next tile's Q first, while this tile still reads its own."""
    spec = KernelSpec(head_dim=head_dim)
    assert spec.q_buffers == (2 if head_dim <= 128 else 1)  # d192/d256: one Q tile already fills the SM
    src = render(spec)
    assert f"constexpr int kQBuffers = {spec.q_buffers};" in src
    assert ("// Q first:" in src) == (spec.q_buffers == 2)
    assert "_q2" in spec.name if spec.q_buffers == 2 else "_q2" not in spec.name
    one = KernelSpec(head_dim=head_dim, q_buffers=1)
    assert one.smem_bytes == spec.smem_bytes - (spec.q_buffers - 1) * spec.block_m * head_dim * 2
    assert "// Q first:" not in render(one)
    if spec.q_buffers == 1:
        with pytest.raises(ValidationError, match="lower block_n, block_m, stages or q_buffers"):
            KernelSpec(head_dim=head_dim, q_buffers=2)


@pytest.mark.parametrize("q_buffers", [0, 3])
def test_q_buffers_out_of_range(q_buffers):
    with pytest.raises(ValidationError, match=f"q_buffers={q_buffers} must be 1 or 2"):
        KernelSpec(head_dim=128, q_buffers=q_buffers)


def test_q_buffers_is_forward_only():
    assert KernelSpec(head_dim=128, kind="bwd").q_buffers == 1
    with pytest.raises(ValidationError, match="q_buffers apply to forward kernels only"):
        KernelSpec(head_dim=128, kind="bwd", q_buffers=2)


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True), (96, False)])
def test_inter_tile_overlap_renders_the_chained_loop(head_dim, causal):
    """The next tile's first Q·Kᵀ is issued beside this tile's last P·V, before the epilogue."""
    spec = KernelSpec(head_dim=head_dim, causal=causal, inter_tile_overlap=True)
    src = render(spec)
    assert "_it" in spec.name
    consumer = src[src.index("void consume("):]
    chained = consumer.index("softmax_next.update(")
    assert consumer.index("mma_pv, p_operand", consumer.index("pipeline_v.consumer_wait(read_v);\n", chained - 2000)) \
        < chained < consumer.index("softmax.finish(")
    assert ("handoff.receive()" in consumer) == causal  # lpt hands tiles over, static strides
    assert "softmax_next" not in render(KernelSpec(head_dim=head_dim, causal=causal, inter_tile_overlap=False))
    if head_dim != 96:  # no e4m3 kernel at hdim 96
        fp8 = render(KernelSpec(head_dim=head_dim, causal=causal, dtype="e4m3", inter_tile_overlap=True))
        assert "TileDescale descale_next(p, t_next);" in fp8 and "descale_next.block(p, t_next, n_block)" in fp8
    if head_dim != 64:  # pingpong needs two consumer warpgroups: the turns run on across the chained tiles
        both = render(KernelSpec(head_dim=head_dim, causal=causal, inter_tile_overlap=True, pingpong=True))
        assert "softmax_next" in both and "NamedBarrier::sync(kMmaThreads, kTurnBarrier + warpgroup)" in both


@pytest.mark.parametrize(("fields", "expected"), [
    ({"intra_wg_overlap": False}, "intra_wg_overlap=True"),
    ({"scheduler": "grid"}, "a persistent scheduler"),
    ({"q_buffers": 1}, "q_buffers=2"),
])
def test_inter_tile_overlap_needs(fields, expected):
    with pytest.raises(ValidationError, match=f"inter_tile_overlap needs .*{expected}"):
        KernelSpec(head_dim=128, inter_tile_overlap=True, **fields)
