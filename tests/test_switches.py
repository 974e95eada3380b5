"""Every combination of the schedule switches that the spec allows renders into the kernel it names.

(A sample of them is compiled for real in test_compile_real.py.)
"""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from fa3gen import KernelSpec, registry, render
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
    assert ("tma_store_arrive();" in src) == spec.stores_o_with_tma
    # d192/d256 stage O in the V buffer (their own staging tile does not fit): the producer stores it.
    assert ("store_staged_o" in src) == (spec.epilogue == "tma_v") == (head_dim > 128)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_epilogue_switch_renders_its_store(head_dim):
    """O goes through a TMA store from its own staging tile where that fits in shared memory, else
    (no variants) from the V stages' buffer; "direct" stores from registers."""
    direct = render(KernelSpec(head_dim=head_dim, epilogue="direct"))
    assert "tma_store_arrive();" not in direct and "SmemLayoutO" not in direct
    spec = KernelSpec(head_dim=head_dim)
    assert spec.epilogue == ("tma" if head_dim <= 128 else "tma_v")  # d192/d256: Q, K, V fill the SM
    # With a variant (not measured with "tma_v"), O leaves from registers where its tile does not fit.
    assert KernelSpec(head_dim=head_dim, softcap=True).epilogue == ("tma" if head_dim <= 128 else "direct")
    src = render(spec)
    # "tma": each consumer warpgroup syncs, stages and stores its own 64 rows (no wait for the
    # other warpgroup); "tma_v": the O tile overlaps V, so both warpgroups must be done with V.
    per_warpgroup = "cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + rows_warpgroup);" in src
    both = "cutlass::arch::NamedBarrier::sync(kMmaThreads, kEpilogueBarrier);" in src
    assert (per_warpgroup, both) == ((True, False) if spec.epilogue == "tma" else (False, True))
    if spec.epilogue == "tma":
        assert "make_coord(t.m_block * kConsumerWarpgroups + rows_warpgroup, _0{})" in src
    if spec.epilogue == "tma_v":
        with pytest.raises(ValidationError, match="use epilogue='direct'"):
            KernelSpec(head_dim=head_dim, epilogue="tma")
    else:
        assert "tma_store_arrive();" in src


@pytest.mark.parametrize("scheduler", ["grid", "static", "lpt"])
@pytest.mark.parametrize("head_dim, block_n", [(256, 80), (192, 112), (128, 176)])
def test_epilogue_in_v_buffer_renders_a_producer_store(head_dim, block_n, scheduler):
    """epilogue="tma_v": the consumers stage O in the V stages' buffer and hand it over; the
    producer stores it before the next V load lands there, and for the last tile at the end."""
    spec = KernelSpec(head_dim=head_dim, block_n=block_n, causal=True, scheduler=scheduler, epilogue="tma_v")
    assert "_otmav" in spec.name and spec.epilogue == "tma_v"
    assert not spec.inter_tile_overlap  # the next tile's P·V would wait for the store
    # O needs no shared memory of its own.
    assert spec.smem_bytes == KernelSpec(head_dim=head_dim, block_n=block_n, epilogue="direct").smem_bytes
    src = render(spec)
    consumer = src[src.index("void consume("):src.index("template <class Pipeline>")]
    producer = src[src.index("void store_staged_o("):src.index("void consume(")]
    assert "o_handoff.pipeline.producer_commit(o_handoff.state);" in consumer
    assert "tma_store_arrive();" not in consumer and "tma_store_arrive();" in producer
    assert "return reinterpret_cast<ElementOut*>(smem.v.data());" in src
    # Stored before the next tile's first V load, and once more after the last tile.
    assert producer.index("store_staged_o(p, smem, o_handoff, scheduler.coord(p, staged)); }\n  pipeline_v.producer_acquire") > 0
    assert producer.count("store_staged_o(p, smem, o_handoff,") == (2 if scheduler == "grid" else 3)
    # K runs a block ahead of V, so the second K load does not wait for that store.
    load = src[src.index("void load_tile("):src.index("void produce(")]
    assert load.index("tKgK(_, n_block - 1)") < load.index("store_staged_o(") \
        < load.index("tVgV(_, n_block), tVsV(_, write_v.index())")


def test_epilogue_in_v_buffer_needs_room_and_no_chaining():
    with pytest.raises(ValidationError, match="in the V stages' buffer .2x48x256., which is smaller"):
        KernelSpec(head_dim=256, block_n=48, epilogue="tma_v")
    with pytest.raises(ValidationError, match="epilogue='tma_v' does not chain tiles"):
        KernelSpec(head_dim=128, epilogue="tma_v", inter_tile_overlap=True)
    # Left to its default, chaining turns off for it (and pingpong with it).
    spec = KernelSpec(head_dim=128, epilogue="tma_v")
    assert not spec.inter_tile_overlap and not spec.pingpong and spec.q_buffers == 2


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


def test_q_loads_a_tile_ahead_with_q_in_registers():
    """With two Q buffers and Q in registers (its buffer freed by the previous tile's first Q·Kᵀ)
    on the static schedule, the producer issues the next tile's Q right after this tile's first
    K and V loads (load_q_of_tile), and the first tile's Q before the loop; otherwise each tile's Q
    goes out at the start of its own tile, as before."""
    ahead = KernelSpec(head_dim=128, q_registers=True)
    assert ahead.loads_q_a_tile_ahead and ahead.q_buffers == 2
    src = render(ahead)
    load_tile = src[src.index("void load_tile("):src.index("void produce(")]
    first_v = load_tile.index("pipeline_v.producer_acquire(write);")
    assert first_v < load_tile.index("load_q_of_tile(p, smem, pipeline_q, scheduler, next, write_q);") < load_tile.index("for (--n_block;")
    assert "// Q first:" not in src and "load_q(p, smem, pipeline_q, t, write_q)" not in load_tile
    produce = src[src.index("void produce("):]
    first_q = "load_q_of_tile(p, smem, pipeline_q, scheduler, scheduler.first_tile(), write_q);"
    assert produce.index(first_q) < produce.index("for (int tile = scheduler.first_tile();")
    assert "} else {\n      load_q_of_tile(p, smem, pipeline_q, scheduler, next, write_q);" in produce  # a tile without loads issues it at once
    for spec in (KernelSpec(head_dim=128), KernelSpec(head_dim=64, causal=True), KernelSpec(head_dim=256, causal=True),
                 KernelSpec(head_dim=128, q_registers=True, scheduler="grid"), KernelSpec(head_dim=128, q_registers=True, scheduler="lpt"),
                 KernelSpec(head_dim=128, causal=True, q_registers=True, q_buffers=1), KernelSpec(head_dim=128, dtype="e4m3", causal=True),
                 KernelSpec(head_dim=128, kind="bwd")):
        assert not spec.loads_q_a_tile_ahead, spec.name
        if spec.kind == "fwd":
            assert "load_q_of_tile" not in render(spec)
    assert sorted(n for n, s in registry.REGISTRY.items() if s.loads_q_a_tile_ahead and not s.split_tail) == [
        "fwd_d128_bf16_short", "fwd_d128_fp16_short", "fwd_d64_bf16_mid", "fwd_d64_fp16_mid"]


def test_q_loads_a_tile_ahead_with_three_q_buffers():
    """With three Q buffers, Q may stay in shared memory and still go out a tile ahead: the next
    tile's buffer was freed by the tile before this one, so the producer does not wait for it."""
    spec = KernelSpec(head_dim=64, q_buffers=3)
    assert spec.loads_q_a_tile_ahead and not spec.q_registers and spec.inter_tile_overlap
    assert spec.smem_bytes == KernelSpec(head_dim=64).smem_bytes + spec.block_m * 64 * 2
    assert "_q3" in spec.name
    src = render(spec)
    assert "constexpr int kQBuffers = 3;" in src
    load_tile = src[src.index("void load_tile("):src.index("void produce(")]
    assert load_tile.index("pipeline_v.producer_acquire(write);") \
        < load_tile.index("load_q_of_tile(p, smem, pipeline_q, scheduler, next, write_q);")
    with pytest.raises(ValidationError, match="lower block_n, block_m, stages or q_buffers"):
        KernelSpec(head_dim=128, q_buffers=3)  # 3 x 128 x 128 Q beside two K/V stages and O


@pytest.mark.parametrize("q_buffers", [0, 4])
def test_q_buffers_out_of_range(q_buffers):
    with pytest.raises(ValidationError, match=f"q_buffers={q_buffers} must be 1, 2 or 3"):
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
        assert "TileDescale descale_next(p, t_next, mma_thread);" in fp8 and "descale_next.block(p, t_next, n_block)" in fp8
    if head_dim != 64:  # pingpong needs two consumer warpgroups: the turns run on across the chained tiles
        both = render(KernelSpec(head_dim=head_dim, causal=causal, inter_tile_overlap=True, pingpong=True))
        assert "softmax_next" in both and "NamedBarrier::sync(kMmaThreads, kTurnBarrier + warpgroup)" in both


@pytest.mark.parametrize("inter_tile", [False, True])
@pytest.mark.parametrize("scheduler", ["grid", "static", "lpt"])
@pytest.mark.parametrize("dtype", ["bf16", "e4m3"])
def test_pingpong_turns_run_on_across_tiles(dtype, scheduler, inter_tile):
    """Warpgroup 1 gives warpgroup 0 the first turn once per CTA, and warpgroup 0 consumes the
    last arrival once, after the tile loop. Once per tile would let warpgroup 1's arrival for its
    next tile land before warpgroup 0 synced on its last one of this tile: two arrivals complete
    the 256-thread turn barrier without warpgroup 0, and the turns deadlock."""
    if inter_tile and scheduler == "grid":
        pytest.skip("inter_tile_overlap needs a persistent scheduler")
    spec = KernelSpec(head_dim=128, dtype=dtype, causal=True, pingpong=True,
                      intra_wg_overlap=True, scheduler=scheduler, inter_tile_overlap=inter_tile)
    consumer = render(spec)
    consumer = consumer[consumer.index("void consume("):]
    first_turn = "if (warpgroup == 1) { cutlass::arch::NamedBarrier::arrive(kMmaThreads, kTurnBarrier + 0); }"
    last_turn = "if (warpgroup == 0) { cutlass::arch::NamedBarrier::sync(kMmaThreads, kTurnBarrier + 0); }"
    assert consumer.count(first_turn) == 1 and consumer.count(last_turn) == 1
    loop = {"grid": "int const tile = scheduler.first_tile();", "static": "for (int tile = scheduler.first_tile();",
            "lpt": "for (int tile = handoff.receive();"}[scheduler]
    if inter_tile:
        loop = "while (tile < scheduler.num_tiles) {"
    last_lse = consumer.rindex("lse_head[row] = lse[r];")  # the epilogue, the tile loop's last step
    assert consumer.index(first_turn) < consumer.index(loop) < last_lse < consumer.index(last_turn)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"intra_wg_overlap": False}, "intra_wg_overlap=True"),
    ({"scheduler": "grid"}, "a persistent scheduler"),
    ({"q_buffers": 1}, "q_buffers=2"),
])
def test_inter_tile_overlap_needs(fields, expected):
    with pytest.raises(ValidationError, match=f"inter_tile_overlap needs .*{expected}"):
        KernelSpec(head_dim=128, inter_tile_overlap=True, **fields)


def test_programmatic_launch_waits_before_global_memory():
    """Forward kernels launch as programmatic dependents by default: cudaLaunchKernelEx with the
    stream-serialization attribute, and every thread waits for the previous grid before the
    roles start (no load, store or tile claim before it)."""
    spec = KernelSpec(head_dim=128, causal=True)
    assert spec.programmatic_launch and "_pdl" in spec.name
    src = render(spec)
    kernel = src[src.index("fwd_kernel(CUTE_GRID_CONSTANT"):]
    wait = kernel.index("cutlass::arch::wait_on_dependent_grids();")
    assert kernel.index("__syncthreads();") < wait < kernel.index("TileScheduler const scheduler(p);")
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src and "<<<" not in src
    off = render(KernelSpec(head_dim=128, causal=True, programmatic_launch=False))
    assert "wait_on_dependent_grids" not in off and "fwd_kernel<<<grid" in off
    assert not KernelSpec(head_dim=128, kind="bwd").programmatic_launch
    with pytest.raises(ValidationError, match="programmatic_launch apply to forward kernels only"):
        KernelSpec(head_dim=128, kind="bwd", programmatic_launch=True)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_lazy_rescale_defaults_and_render(head_dim):
    """Lazy rescale is on by default for 16-bit kernels where O has 64+ registers a thread
    (head_dim_v >= 128), for e4m3 from head_dim_v 192, off for backward;
    the skipped multiply is the O rescale, under a warp-uniform flag, and the softmax is
    instantiated with the threshold."""
    spec = KernelSpec(head_dim=head_dim)
    assert spec.lazy_rescale == (head_dim >= 128) and ("_lr" in spec.name) == spec.lazy_rescale
    src = render(KernelSpec(head_dim=head_dim, lazy_rescale=True))
    assert "/*kLazyRescaleLog2=*/8," in src and "if (rescale_o) { softmax.rescale_rows(o_rows, rescale); }" in src
    off = render(KernelSpec(head_dim=head_dim, lazy_rescale=False))
    assert "/*kLazyRescaleLog2=*/-1," in off
    assert not KernelSpec(head_dim=head_dim, kind="bwd").lazy_rescale
    if head_dim != 96:
        # e4m3: P's factor drops from 2^8 to 2^6 so that a stale max's P (up to 2^2 more) stays in
        # e4m3; O's V unit changes inside the fp8 softmax's update, not beside it.
        # Default from head_dim_v 192, where it is faster (the launcher keeps it to power-of-two V scales).
        assert KernelSpec(head_dim=head_dim, dtype="e4m3").lazy_rescale == (head_dim >= 192)
        lazy = render(KernelSpec(head_dim=head_dim, dtype="e4m3", lazy_rescale=True))
        assert "Fp8LazySoftmax<kRows, /*kProbLog2Scale=*/6, /*kLazyRescaleLog2=*/2," in lazy
        assert "update(s_rows, rescale, descale, block_descale)" in lazy and ".change_v_unit(" not in lazy
        eager = render(KernelSpec(head_dim=head_dim, dtype="e4m3", lazy_rescale=False))
        assert "OnlineSoftmax<kRows, /*kProbLog2Scale=*/8, /*kLazyRescaleLog2=*/-1," in eager
        assert "Fp8LazySoftmax" not in eager and "descale.change_v_unit(block_descale, rescale);" in eager
    with pytest.raises(ValidationError, match="lazy_rescale apply to forward kernels only"):
        KernelSpec(head_dim=head_dim, kind="bwd", lazy_rescale=True)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_row_reduce_chains_defaults_and_render(head_dim):
    """Two reduction chains per row by default where head_dim_v >= 128 (16-bit forward); one for
    hdim 64 and 96, fp8 and the backward. The softmax is instantiated with the count."""
    spec = KernelSpec(head_dim=head_dim)
    assert spec.row_reduce_chains == (2 if head_dim >= 128 else 1)
    assert ("_ch2" in spec.name) == (head_dim >= 128)
    assert f"/*kChains=*/{spec.row_reduce_chains}> softmax(" in render(spec)
    four = KernelSpec(head_dim=head_dim, row_reduce_chains=4)
    assert "_ch4" in four.name and "/*kChains=*/4> softmax(" in render(four)
    with pytest.raises(ValidationError, match="row_reduce_chains"):
        KernelSpec(head_dim=head_dim, row_reduce_chains=0)
    assert KernelSpec(head_dim=head_dim, kind="bwd").row_reduce_chains == 1
    with pytest.raises(ValidationError, match="row_reduce_chains apply to forward kernels only"):
        KernelSpec(head_dim=head_dim, kind="bwd", row_reduce_chains=2)
    if head_dim != 96:
        fp8 = KernelSpec(head_dim=head_dim, dtype="e4m3")
        chains = "/*kChains=*/1, /*kThreadSums=*/false> softmax(" if fp8.row_sums_mma else "/*kChains=*/1> softmax("
        assert fp8.row_reduce_chains == 1 and chains in render(fp8)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_row_sums_mma_defaults_render_and_refusals(head_dim):
    """Row sums on the tensor cores: on by default for e4m3 up to head_dim_v 128 (eager rescale
    there), off for 16-bit kernels and from hdim 192, written to the canonical JSON only where it
    differs from that default. Rendered as a P·1 WGMMA in every P·V batch over a tile of ones
    written once before the first barrier, its block sums added into the softmax's fp32 row sums
    after each P·V completes and rescaled with O; the softmax sums no scores itself. Refused with
    e4m3 lazy rescale, pin_pv_wait and for the backward; the tile of ones counts in shared memory."""
    fp8 = KernelSpec(head_dim=head_dim, dtype="e4m3")
    assert fp8.row_sums_mma == (head_dim <= 128) and fp8.lazy_rescale == (head_dim > 128)
    assert ("_rsm" in fp8.name) == fp8.row_sums_mma and "row_sums_mma" not in fp8.canonical_json()
    assert KernelSpec(head_dim=head_dim, dtype="e4m3", lazy_rescale=False).row_sums_mma == (head_dim <= 128)
    assert not KernelSpec(head_dim=head_dim).row_sums_mma and not KernelSpec(head_dim=head_dim, causal=True).row_sums_mma
    on = KernelSpec(head_dim=head_dim, dtype="e4m3", lazy_rescale=False, row_sums_mma=True)
    off = KernelSpec(head_dim=head_dim, dtype="e4m3", lazy_rescale=False, row_sums_mma=False)
    assert on.smem_bytes - off.smem_bytes == -(-8 * on.block_n // 1024) * 1024
    code, plain = render(on), render(off)
    assert "/*kThreadSums=*/false> softmax(" in code and "smem.ones[i] = Element(1.f);" in code
    assert "fence_view_async_shared();" in code and "TiledMmaRowSums" in code
    # the loop's P·V, the tile's last one, and (chained tiles) the previous tile's beside the next's first Q·Kᵀ
    assert code.count("fa3gen::wgmma_gemm_with_row_sums(mma_pv, mma_sums, p_operand,") == 2 + on.inter_tile_overlap
    assert code.count(".add_row_sums(sum_rows);") == 2 + on.inter_tile_overlap
    assert "if (rescale_o) { softmax.rescale_row_sums(rescale); }" in code
    assert "wgmma_gemm_with_row_sums" not in plain and "smem.ones" not in plain and "kThreadSums" not in plain
    serial = render(KernelSpec(head_dim=128, dtype="e4m3", block_m=192, block_n=128, row_sums_mma=True))
    assert serial.count("wgmma_gemm_with_row_sums(") == 1 and serial.count(".add_row_sums(sum_rows);") == 1
    assert ('"row_sums_mma":false' in off.canonical_json()) == (head_dim <= 128)
    bf16 = KernelSpec(head_dim=head_dim, row_sums_mma=True, pin_pv_wait=0)
    assert '"row_sums_mma":true' in bf16.canonical_json() and "_rsm" in bf16.name
    with pytest.raises(ValidationError, match="row_sums_mma needs an e4m3 kernel without lazy_rescale"):
        KernelSpec(head_dim=head_dim, dtype="e4m3", lazy_rescale=True, row_sums_mma=True)
    with pytest.raises(ValidationError, match="row_sums_mma needs pin_pv_wait=0"):
        KernelSpec(head_dim=head_dim, pin_pv_wait=2, row_sums_mma=True)
    with pytest.raises(ValidationError, match="row_sums_mma applies to forward kernels"):
        KernelSpec(kind="bwd", head_dim=head_dim, row_sums_mma=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kv_factors_in_smem_render_and_refusals(head_dim):
    """K's and V's per-block factors through shared memory: off by default (absent from the
    canonical JSON), opt-in for e4m3 kernels. Rendered as the producer's asynchronous store of
    each K stage's factors, counted in the stage's transaction bytes, and the loop's read of them
    from the stage it waited for (the overlapped loop's first key block of a tile and every later
    one; the serial loop's each block), in place of the loads from global memory; 16-bit kernels
    and the backward are refused."""
    default = KernelSpec(head_dim=head_dim, dtype="e4m3")
    assert not default.kv_factors_in_smem and "kv_factors_in_smem" not in default.canonical_json()
    on = KernelSpec(head_dim=head_dim, dtype="e4m3", kv_factors_in_smem=True)
    assert on.name == default.name + "_kvfs" and '"kv_factors_in_smem":true' in on.canonical_json()
    code, plain = render(on), render(default)
    assert "float kv_factors[kStages][2];" in code
    assert "smem.kv_factors[state.index()][1] = f.v;\n  pipeline_k.producer_acquire(state, free);" in code
    # every K load stores its block's factors: the first key block of a tile and the loop's
    assert code.count("acquire_k_stage_with_factors(smem, pipeline_k, write, factors);") == 2
    # the first block (twice with chained tiles: this tile's and the next's) and the loop, each from the stage read
    reads = code.count(".block(smem, read.index());")
    assert reads == 2 * (1 + on.inter_tile_overlap) and ".block(p, " not in code
    assert "kv_factors" not in plain and plain.count(".block(p, ") == reads
    with pytest.raises(ValidationError, match="kv_factors_in_smem needs dtype='e4m3'"):
        KernelSpec(head_dim=head_dim, kv_factors_in_smem=True)
    # the serial loop (three warpgroups) reads them from the stage too, in place of its lanes' loads a block ahead
    serial = render(KernelSpec(head_dim=min(head_dim, 128), dtype="e4m3", block_m=192, block_n=128,
                               intra_wg_overlap=False, kv_factors_in_smem=True))
    assert serial.count(".block(smem, read.index());") == 1 and "descale.step(" not in serial and "lane_factor" not in serial
    with pytest.raises(ValidationError, match="kv_factors_in_smem applies to forward kernels"):
        KernelSpec(kind="bwd", head_dim=head_dim, kv_factors_in_smem=True)


@pytest.mark.parametrize("fields", [dict(head_dim=128), dict(head_dim=128, block_m=192), dict(head_dim=64, dtype="fp16"),
                                    dict(head_dim=256, dtype="e4m3"), dict(head_dim=256, epilogue="direct", softcap=True)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_kv_multicast_render_and_refusals(fields):
    """K/V multicast across clusters of two CTAs: off by default (absent from the canonical JSON, the
    kernel's source unchanged), opt-in where every tile of a head visits the same key blocks.
    Rendered as multicast TMA loads of K and V (each CTA's half of a block, into both CTAs), the K/V
    pipelines over the cluster, a cluster-wide barrier after their init, the producer's tail (no
    CTA leaves while the other may still release its stages), query blocks in pairs, and a
    cluster launch sized by the clusters that fit."""
    default = KernelSpec(**fields)
    assert not default.kv_multicast and "kv_multicast" not in default.canonical_json()
    on = KernelSpec(**fields, kv_multicast=True)
    assert on.name == default.name + "_mc2" and '"kv_multicast":true' in on.canonical_json()
    code, plain = render(on), render(default)
    # the K and V copy types (traits) and the descriptors the launcher builds
    assert code.count("make_tma_copy(SM90_TMA_LOAD_MULTICAST{}") == 4 and code.count("SM90_TMA_LOAD_MULTICAST{}, GmemTensor{}") == 2
    assert code.count("uint16_t(kClusterMask)), tKgK") + code.count("uint16_t(kClusterMask)), tVgV") >= 2
    assert code.count("tma_partition(p.tma_k, cta_rank, Layout<Int<kClusterM>>{}") == 1
    assert code.count("tma_pipeline_params<PipelineKV>(warpgroup, kBytesK), ClusterShape{});") == 1
    assert "cute::cluster_arrive();\n  cute::cluster_wait();" in code
    assert "pipeline_q.producer_tail(write_q);\n  pipeline_k.producer_tail(write);\n  pipeline_v.producer_tail(write);" in code
    # every pipeline over the cluster (in a cluster launch, one of a single CTA releases rank 0's)
    assert code.count("ClusterShape{});") == 3 and "Shape<_1, _1, _1>" not in code
    assert "cute::ceil_div(p.seqlen_q, int(kBlockM) * kClusterM) * kClusterM" in code
    assert "cudaLaunchAttributeClusterDimension" in code and "fa3gen::max_active_clusters_once<fwd_kernel>" in code
    for text in ("MULTICAST", "kCluster", "cluster_", "producer_tail"):
        assert text not in plain, text


@pytest.mark.parametrize("fields, why", [
    (dict(causal=True), "the same key blocks for every tile of a head \\(not causal"),
    (dict(window=True), "not window"),
    (dict(mask_mod={"expr": "kv_idx <= q_idx"}), "not mask_mod"),
    (dict(scheduler="lpt"), "scheduler='static'"),
    (dict(scheduler="grid"), "scheduler='static'"),
    (dict(bias=True), "no attn_bias"),
    (dict(warpgroup_key_trim=True), "not warpgroup_key_trim"),
    (dict(head_dim=256, epilogue="tma_v"), "an epilogue other than 'tma_v'"),
    (dict(dtype="e4m3", v_transpose_in_kernel=True), "not v_transpose_in_kernel"),
    (dict(dtype="e4m3", kv_factors_in_smem=True), "not kv_factors_in_smem"),
    (dict(kind="bwd"), "kv_multicast apply to forward kernels only"),
])
def test_kv_multicast_refusals(fields, why):
    with pytest.raises(ValidationError, match=why):
        KernelSpec(**{"head_dim": 128, **fields, "kv_multicast": True})


@pytest.mark.parametrize("fields", [dict(head_dim=128, block_m=192, intra_wg_overlap=False), dict(head_dim=128),
                                    dict(head_dim=128, causal=True, scheduler="static"),
                                    dict(head_dim=256, epilogue="tma_v"), dict(head_dim=128, dtype="e4m3"),
                                    dict(head_dim=64, block_m=256, block_n=64, v_transpose_in_kernel=False)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_split_tail_render(fields):
    """split_tail: off by default (absent from the canonical JSON, the kernel's source unchanged),
    opt-in for not-causal kernels on the static schedule, chained or not. Rendered as the
    scheduler's shares of the last wave's key blocks (pieces before whole tiles), every role's key
    ranges from them, the workspace (counters, then one partial per CTA) as the kernel's scratch,
    a grid of every SM, and one merge per tile before its epilogue, which only whole tiles and
    owners reach; with O in the V buffer the producer stores only the tiles its CTA owns."""
    default = KernelSpec(**fields)
    assert not default.split_tail and "split_tail" not in default.canonical_json()
    on = KernelSpec(**fields, split_tail=True)
    assert on.name == default.name + "_st"
    assert '"split_tail":true' in on.canonical_json()
    code, plain = render(on), render(default)
    assert "whole_tiles = split ? num_tiles - rest : num_tiles;" in code
    assert "return first_unit(tile) > units_begin ? tile - 1 : first_whole_tile();" in code
    assert "constexpr int kWorkspaceBytes = kSplitTailWorkspaceBytes;" in code and "a->workspace,\n" in code
    assert "dim3 grid(static_cast<unsigned>(sm_count <= kSplitTailMaxCtas ? sm_count" in code
    # the producer's loads (and its Q a tile ahead) and the consumers' loop (chained: this tile's and the next's) take the piece
    assert code.count("tile_key_blocks(p, scheduler, ") == 1 + on.loads_q_a_tile_ahead + 1 + on.inter_tile_overlap
    assert "key_block_range(p, t.m_block)" not in code.split("__device__ __forceinline__ void produce(")[1].split("#if")[0]
    assert code.count("if (merge_split_tile(p, scheduler, tile, softmax, o_rows, ") == 1
    assert ("descale.v_unit, mma_thread)" in code) == on.is_fp8
    assert ("staged = scheduler.stores_tile(tile) ? tile : -1;" in code) == (on.epilogue == "tma_v")
    for text in ("split_", "tile_key_blocks", "stores_tile", "kSplitTail"):
        assert text not in plain, text


def test_bias_staging_refuses_four_warpgroups():
    """Four warpgroups' staged-bias barriers would take named-barrier ids 6-9, past CUTLASS's 0-7."""
    with pytest.raises(ValidationError, match="bias_staging needs at most three consumer warpgroups"):
        KernelSpec(head_dim=64, block_m=256, block_n=64, bias=True, bias_staging=True)
    assert KernelSpec(head_dim=64, block_m=192, bias=True, bias_staging=True).bias_staging


@pytest.mark.parametrize("fields, why", [
    (dict(causal=True), 'scheduler="static"'),
    (dict(window=True, scheduler="static"), "no window or block_sparse"),
    (dict(scheduler="lpt"), 'scheduler="static"'),
    (dict(scheduler="grid"), 'scheduler="static"'),
    (dict(kv_multicast=True), "kv_multicast=False"),
    (dict(kind="bwd"), "split_tail apply to forward kernels only"),
])
def test_split_tail_refusals(fields, why):
    with pytest.raises(ValidationError, match=why):
        KernelSpec(**{"head_dim": 128, **fields, "split_tail": True})


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_q_registers_defaults_and_render(head_dim):
    """Q in registers for Q·Kᵀ: on by default for the causal kernels of hdim 128 (16-bit and e4m3,
    and the 16-bit built-in variants: where it measured faster), off elsewhere; written to the canonical JSON only where it
    differs from that default; rendered as a register-sourced Q·Kᵀ whose Q is loaded with ldmatrix
    after each wait for a tile's Q, its buffer released once the tile's first Q·Kᵀ has completed
    (not at the tile's end); refused for the backward."""
    for causal in (False, True):
        spec = KernelSpec(head_dim=head_dim, causal=causal)
        assert spec.q_registers == (causal and head_dim == 128) and ("_qr" in spec.name) == spec.q_registers
        assert "q_registers" not in spec.canonical_json() and KernelSpec.from_json(spec.canonical_json()) == spec
        flipped = KernelSpec(head_dim=head_dim, causal=causal, q_registers=not spec.q_registers)
        assert f'"q_registers":{str(flipped.q_registers).lower()}' in flipped.canonical_json()
        assert KernelSpec.from_json(flipped.canonical_json()) == flipped
    # the built-in variants' 16-bit kernels (causal or not), each alone, measured faster with it too; composed
    # (window + softcap + ALiBi spilled 236 B), custom mods and fp8 variants keep Q in shared memory
    assert all(KernelSpec(head_dim=128, causal=True, **{v: True}).q_registers for v in ("window", "softcap", "alibi"))
    assert not KernelSpec(head_dim=128, causal=True, window=True, softcap=True, alibi=True).q_registers
    assert not KernelSpec(head_dim=128, causal=True, window=True, softcap=True).q_registers
    assert all(KernelSpec(head_dim=128, **{v: True}).q_registers for v in ("window", "softcap", "alibi"))  # not causal too
    assert not KernelSpec(head_dim=128, causal=True, score_mod={"expr": "score", "grad": "1.f"}).q_registers
    assert not KernelSpec(head_dim=128, dtype="e4m3", causal=True, window=True).q_registers
    # key blocks wider than 128: S and P leave no registers for Q (128 x 176 spilled 288 B)
    assert not KernelSpec(head_dim=128, causal=True, block_n=176, epilogue="tma_v", scheduler="static").q_registers
    on, off = (render(KernelSpec(head_dim=head_dim, q_registers=v)) for v in (True, False))
    assert "GMMA::rs_op_selector<Element, Element, float, TileQK>" in on and "SM75_U32x4_LDSM_N" in on
    assert "load_a_operand(mma_qk, mma_thread, sQ(_, _, read_q.index()), tSrQ);" in on and "tSrQ_buffers" not in on
    assert "GMMA::ss_op_selector<Element, Element, float, TileQK>" in off and "load_a_operand" not in off
    assert "a whole tile ahead" in on and "a whole tile ahead" not in off
    if head_dim != 96:  # e4m3: on for causal hdim 128 (128 x 192 tiles)
        for causal in (False, True):
            fp8 = KernelSpec(head_dim=head_dim, dtype="e4m3", causal=causal)
            assert fp8.q_registers == (causal and head_dim == 128) and "q_registers" not in fp8.canonical_json()
        fp8 = KernelSpec(head_dim=head_dim, dtype="e4m3", q_registers=True)
        assert "GMMA::rs_op_selector<Element, Element, float, TileQK>" in render(fp8)
    with pytest.raises(ValidationError, match="q_registers applies to forward kernels"):
        KernelSpec(head_dim=head_dim, kind="bwd", q_registers=True)


def test_pin_pv_wait_defaults_and_render():
    """pin_pv_wait: 2 (the previous P·V's wait after both softmax rows) by default for the 16-bit
    hdim 256 kernels on 80-key blocks without a variant, where it measured faster; 0 elsewhere.
    Left out of the canonical JSON at its default; rendered as a store of the row sums into the
    warp's shared-memory word before each key block's wait for the P·V; refused for the backward,
    without intra-warpgroup overlap, and past the thread's two rows."""
    for causal in (False, True):
        for dtype in ("bf16", "fp16"):
            spec = KernelSpec(head_dim=256, dtype=dtype, causal=causal)
            assert spec.block_n == 80 and spec.pin_pv_wait == 2 and spec.name.removesuffix("_wgt").endswith("_pin2")
            assert "pin_pv_wait" not in spec.canonical_json() and KernelSpec.from_json(spec.canonical_json()) == spec
    assert all(KernelSpec(head_dim=d, causal=c).pin_pv_wait == 0 for d in (64, 96, 128, 192) for c in (False, True))
    assert KernelSpec(head_dim=256, block_n=64).pin_pv_wait == 0
    assert KernelSpec(head_dim=256, dtype="e4m3").pin_pv_wait == 0
    assert KernelSpec(head_dim=256, softcap=True).pin_pv_wait == 0
    assert KernelSpec(head_dim=256, intra_wg_overlap=False).pin_pv_wait == 0
    off = KernelSpec(head_dim=256, pin_pv_wait=0)
    assert '"pin_pv_wait":0' in off.canonical_json() and "_pin" not in off.name
    one = KernelSpec(head_dim=128, pin_pv_wait=1)
    assert '"pin_pv_wait":1' in one.canonical_json() and one.name.endswith("_pin1")
    code = render(KernelSpec(head_dim=256))
    assert code.count("pin_before_wait<2>(smem, softmax.row_sum);") == 1  # the key-block loop
    assert "float pin_slots[kThreads / 32];" in code and "st.shared.f32" in code
    chained = render(KernelSpec(head_dim=128, pin_pv_wait=1))  # the chained tiles' first block waits too
    assert chained.count("pin_before_wait<1>(smem, softmax") == 2
    assert "pin_before_wait" not in render(off) and "pin_slots" not in render(off)
    with pytest.raises(ValidationError, match="pin_pv_wait applies to forward kernels"):
        KernelSpec(kind="bwd", head_dim=128, pin_pv_wait=2)
    with pytest.raises(ValidationError, match="needs intra_wg_overlap=True"):
        KernelSpec(head_dim=256, intra_wg_overlap=False, pin_pv_wait=2)
    with pytest.raises(ValidationError, match="pin_pv_wait"):
        KernelSpec(head_dim=256, pin_pv_wait=3)


def test_warpgroup_key_trim_render_and_refusals():
    """warpgroup_key_trim: each consumer warpgroup trims the tile's key blocks to its own rows'
    right edge (trim_to_warpgroup), passes the cut ones without GEMMs (pass_hidden_key_blocks,
    taking its pingpong turn), and masks by its own rows; a warpgroup whose rows all lie past
    seqlen_q keeps one block, causal or not. On by default for the 16-bit causal kernels of hdim
    64, 192 and 256 without pingpong or a variant (where it measured faster); rendered only into
    trimmed kernels; left out of the canonical JSON at its default; refused for the backward."""
    for d, dtype in ((64, "bf16"), (64, "fp16"), (192, "bf16"), (192, "fp16"), (256, "bf16"), (256, "fp16")):
        spec = KernelSpec(head_dim=d, dtype=dtype, causal=True)
        assert spec.warpgroup_key_trim and "_wgt" in spec.name and "warpgroup_key_trim" not in spec.canonical_json()
        assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert KernelSpec(head_dim=256, causal=True, block_n=64).warpgroup_key_trim  # the registry's short tiles
    untrimmed = [KernelSpec(head_dim=d, causal=c) for d in (96, 128) for c in (False, True)]
    untrimmed += [KernelSpec(head_dim=192), KernelSpec(head_dim=192, head_dim_v=128, causal=True)]
    untrimmed += [KernelSpec(head_dim=64), KernelSpec(head_dim=256), KernelSpec(head_dim=64, causal=True, block_m=128),
                  KernelSpec(head_dim=256, dtype="e4m3", causal=True), KernelSpec(head_dim=256, causal=True, softcap=True),
                  KernelSpec(head_dim=64, causal=True, block_m=128, block_n=128), KernelSpec(head_dim=256, window=True)]
    for spec in untrimmed:
        assert not spec.warpgroup_key_trim and "_wgt" not in spec.name, spec.name
        assert "trim_to_warpgroup" not in render(spec) and "pass_hidden_key_blocks" not in render(spec)
    off = KernelSpec(head_dim=64, causal=True, warpgroup_key_trim=False)
    assert '"warpgroup_key_trim":false' in off.canonical_json() and "trim_to_warpgroup" not in render(off)
    code = render(KernelSpec(head_dim=64, causal=True))  # 192 x 128, three warpgroups, chained tiles
    assert "int trim_to_warpgroup(" in code and "int const hidden_next = trim_to_warpgroup(" in code
    assert code.count("pass_hidden_key_blocks(pipeline_k, pipeline_v, read, hidden") == 4  # first tile, three chained
    assert "last_visible_key(p, m_block * kBlockM + warpgroup * 64)" in code  # the warpgroup's own mask test
    assert code.count("key_block_needs_mask(p, t") == code.count("n_block, warpgroup))")
    assert "NamedBarrier" not in code.split("void pass_hidden_key_blocks")[1].split("\n}\n")[0]
    turns = render(KernelSpec(head_dim=128, causal=True, block_n=64, pingpong=True, warpgroup_key_trim=True))
    hidden_turn = turns.split("void pass_hidden_key_blocks")[1].split("\n}\n")[0]
    assert "sync(kMmaThreads, kTurnBarrier + warpgroup)" in hidden_turn and "1 - warpgroup" in hidden_turn
    serial = render(KernelSpec(head_dim=128, causal=True, block_n=64, intra_wg_overlap=False, warpgroup_key_trim=True))
    assert "int const hidden = trim_to_warpgroup(p, t.m_block, warpgroup, blocks);" in serial
    assert "int const warpgroup = __shfl_sync(0xffffffff, mma_thread / 128, 0);" in serial  # warp-uniform
    window = KernelSpec(head_dim=128, window=True, block_n=64, warpgroup_key_trim=True)  # the window's right side
    assert "first_visible_key(p, m_block * kBlockM + warpgroup * 64 + 63)" in render(window)
    # Chained into while the previous tile's last P·V holds a V stage, a warpgroup that passes
    # kStages blocks or more finishes that P·V first (else the producer waits for the stage).
    chained = code.split("int const hidden_next = trim_to_warpgroup(")[1]
    assert chained.index("if (hidden_next >= kStages) {") < chained.index("pass_hidden_key_blocks(")
    assert "if (hidden_next >= kStages)" not in serial
    # Rows past seqlen_q see nothing, causal or not: such a warpgroup keeps one block.
    assert "int const end = past_queries ? 0 : cute::ceil_div(max(last_visible_key(p, last_row) + 1, 0)" in code
    every_key = render(KernelSpec(head_dim=128, warpgroup_key_trim=True))
    assert "int const end = past_queries ? 0 : blocks.end;" in every_key and "last_visible_key" not in every_key
    with pytest.raises(ValidationError, match="warpgroup_key_trim applies to forward kernels"):
        KernelSpec(kind="bwd", head_dim=128, causal=True, warpgroup_key_trim=True)


def test_narrow_edge_block_render_and_refusals():
    """narrow_edge_block: where no row of a warpgroup sees the second half of the tile's first key
    block (sees_first_half_only), that block's Q·Kᵀ runs on a WGMMA half as wide over the first
    half of K's stage, its softmax on those scores, and P's second half is zeroed for the P·V.
    Both versions of the peeled first step are rendered (a warp-uniform branch); the loop is
    unchanged. On by default for the 16-bit causal kernels of hdim 64 and 192 and of hdim 256 on
    64 keys without a variant (where it measured faster); left out of the canonical JSON at its
    default; refused without a right key bound, for e4m3, without intra_wg_overlap and for the
    backward."""
    for fields in ({"head_dim": 64}, {"head_dim": 64, "block_m": 128, "block_n": 128, "stages": 3},
                   {"head_dim": 192}, {"head_dim": 256, "block_n": 64}):
        for dtype in ("bf16", "fp16"):
            on = KernelSpec(**fields, dtype=dtype, causal=True)
            assert on.narrow_edge_block and on.name.endswith("_neb") and "narrow_edge_block" not in on.canonical_json()
            assert KernelSpec.from_json(on.canonical_json()) == on
    spec = KernelSpec(head_dim=64, causal=True, block_m=128, block_n=128, stages=3)  # pingpong, chained tiles
    assert spec.pingpong and spec.inter_tile_overlap
    code = render(spec)
    assert "using TileQKNarrow = Shape<Int<kBlockM>, Int<kBlockN / 2>, Int<kHeadDim>>;" in code
    assert "GMMA::ss_op_selector<Element, Element, float, TileQKNarrow>" in code
    # Chained tiles: the first tile's first block and the two chained ones, each in both versions.
    assert code.count("if (sees_first_half_only(p, t") == 3
    assert code.count("wgmma_gemm</*kZeroInit=*/true>(mma_qk_narrow, ") == 3
    assert code.count("convert_fragment<Element>(tSrS, tOrP_narrow);\n") == 3 == code.count("zero_second_half(tOrP);")
    assert code.count("mask_scores(p, s_rows, s_coord_narrow, ") == 3
    assert "int const warpgroup = __shfl_sync(0xffffffff, mma_thread / 128, 0);" in code  # warp-uniform branch
    loop = code.split("for (int n_block = ")[1].split("int const next = ")[0]
    assert "narrow" not in loop  # the key-block loop runs whole blocks only
    assert "return last_visible_key(p, last_row) < n_block * kBlockN + kBlockN / 2;" in code
    q_registers = render(KernelSpec(head_dim=128, causal=True, q_buffers=1, narrow_edge_block=True))
    assert "GMMA::rs_op_selector<Element, Element, float, TileQKNarrow>" in q_registers
    assert q_registers.count("(mma_qk_narrow, tSrQ, tSrK_narrow(_, _, _, read.index()), tSrS);") == 1  # one tile per loop
    window = render(KernelSpec(head_dim=128, window=True, narrow_edge_block=True))
    assert "sees_first_half_only" in window
    wide = [KernelSpec(head_dim=d, causal=c) for d in (96, 128) for c in (False, True)]
    wide += [KernelSpec(head_dim=64), KernelSpec(head_dim=256, causal=True), KernelSpec(head_dim=192, head_dim_v=128, causal=True),
             KernelSpec(head_dim=64, dtype="e4m3", causal=True), KernelSpec(head_dim=64, causal=True, softcap=True),
             KernelSpec(head_dim=64, causal=True, intra_wg_overlap=False), KernelSpec(head_dim=128, window=True)]
    for plain in wide:
        assert not plain.narrow_edge_block and "narrow_edge_block" not in plain.canonical_json()
        assert "_neb" not in plain.name and "Narrow" not in render(plain) and "sees_first_half_only" not in render(plain)
    off = KernelSpec(head_dim=64, causal=True, narrow_edge_block=False)
    assert '"narrow_edge_block":false' in off.canonical_json() and "TileQKNarrow" not in render(off)
    with pytest.raises(ValidationError, match="narrow_edge_block needs causal=True or window=True"):
        KernelSpec(head_dim=128, narrow_edge_block=True)
    with pytest.raises(ValidationError, match="narrow_edge_block needs 16-bit inputs"):
        KernelSpec(head_dim=128, dtype="e4m3", causal=True, narrow_edge_block=True)
    with pytest.raises(ValidationError, match="intra_wg_overlap=True"):
        KernelSpec(head_dim=128, causal=True, intra_wg_overlap=False, narrow_edge_block=True)
    with pytest.raises(ValidationError, match="narrow_edge_block applies to forward kernels"):
        KernelSpec(kind="bwd", head_dim=128, causal=True, narrow_edge_block=True)


def test_three_warpgroups_from_hdim_128_default_to_no_overlap():
    """Three consumer warpgroups get 160 registers each: from head_dim_v 128 the defaults leave out
    intra-warpgroup overlap and Q in registers (S of a second block, or Q, beside S and O would
    spill); hdim 64 keeps overlap, two warpgroups keep both; an explicit value holds and
    survives the canonical JSON."""
    for dtype in ("bf16", "fp16", "e4m3"):
        for causal in (False, True):
            spec = KernelSpec(head_dim=128, dtype=dtype, causal=causal, block_m=192, block_n=128)
            assert spec.num_consumer_warpgroups == 3 and not spec.intra_wg_overlap and not spec.q_registers
            assert not spec.pingpong and not spec.inter_tile_overlap and "_ov" not in spec.name
            assert KernelSpec.from_json(spec.canonical_json()) == spec
    assert KernelSpec(head_dim=64).num_consumer_warpgroups == 3 and KernelSpec(head_dim=64).intra_wg_overlap
    assert KernelSpec(head_dim=128).intra_wg_overlap and KernelSpec(head_dim=128, causal=True).q_registers
    forced = KernelSpec(head_dim=128, block_m=192, block_n=96, intra_wg_overlap=True)
    assert forced.intra_wg_overlap and KernelSpec.from_json(forced.canonical_json()).intra_wg_overlap
    long = registry.default_spec(128, 128, "bf16", False, seqlen_q=1025)
    assert (long.block_m, long.num_consumer_warpgroups, long.intra_wg_overlap) == (192, 3, False)
    short = registry.default_spec(128, 128, "bf16", False, seqlen_q=1024)
    assert (short.block_m, short.intra_wg_overlap, short.q_registers) == (128, True, True)


def test_four_consumer_warpgroups_split_the_launch_registers():
    """256-row tiles (hdim 64, 64-key blocks) launch 640 threads at 96 registers: setmaxnreg gives
    the four consumer warpgroups 112 each and the producer 32 (REGISTER_SPLIT), or 24 when the
    spec asks (producer_registers); either fits the launch's pool, and the kernel says so."""
    default = KernelSpec(head_dim=64, block_m=256, block_n=64, stages=3)
    low = KernelSpec(head_dim=64, block_m=256, block_n=64, stages=3, producer_registers=24)
    assert default.num_consumer_warpgroups == 4 and default.num_threads == 640 and default.register_pool == 96 * 640
    for spec, producer in ((default, 32), (low, 24)):
        assert spec.register_split == (producer, 112)
        assert producer * 128 + 4 * 112 * 128 <= spec.register_pool
        src = render(spec)
        assert f"constexpr int kProducerRegisters = {producer};" in src and "constexpr int kConsumerRegisters = 112;" in src
    assert low.name == default.name + "_p24" and default.producer_registers is None
