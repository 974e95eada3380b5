"""KernelSpec: the declarative description of one attention kernel, and its type checker.

A spec is frozen, serializes to one canonical JSON form and hashes stably, so it can name a
cache entry. Every constraint the hardware or the templates impose is checked here, so a bad
spec fails with a pydantic error naming the field and the limit instead of failing in nvcc.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .abi import MAX_TENSOR_ARGS
from .split_tail import MIN_SAVING_PERCENT as SPLIT_TAIL_MIN_SAVING_PERCENT
from .split_tail import PIECE_BLOCKS as SPLIT_TAIL_PIECE_BLOCKS
from .variant import MaskMod, Param, ScalarParam, ScoreMod, TensorParam, check_expression, check_params, names_used

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SMEM_BUDGET_BYTES = 227 * 1024  # per thread block on H100/H200
BARRIER_SMEM_BYTES = 1024  # mbarriers and pipeline state, rounded up
WGMMA_M = 64  # rows of one warpgroup MMA
WGMMA_K = 16  # K of one 16-bit WGMMA: block_n is the K of the P·V GEMM
REGISTERS_PER_SM = 65536
THREADS_PER_WARPGROUP = 128
# setmaxnreg splits: (producer, consumer) registers per thread, by number of consumer warpgroups.
# The producer spilled at 24 (barrier-retry path, d256 causal) and, with the lpt scheduler's
# tile claims and hand-off, at 32 for head dims 96/192/256 (several TMA boxes per load): it gets
# 40 with two consumer warpgroups (128*40 + 256*232 = the 64512 the launch allocates). Three
# consumer warpgroups leave no room above 32 (128*32 + 384*160 = 65536). Four (256-row tiles, for
# hdim 64 on 64-key blocks) launch at 96 a thread: 128*32 + 512*112 = 640*96 (24 spilled in the lpt
# producer). One consumer warpgroup is not offered: its launch-time register count is not capped
# low enough for the split to be sure to be an increase for the consumers, and it was never run on
# the GPU.
REGISTER_SPLIT = {2: (40, 232), 3: (32, 160), 4: (32, 112)}
# The query rows a forward tile may have: 64 (one WGMMA M) per consumer warpgroup.
_BLOCK_M_CHOICES = tuple(WGMMA_M * n for n in REGISTER_SPLIT)
# Forward producer registers a spec may ask for (producer_registers) in place of REGISTER_SPLIT's,
# by consumer warpgroups: with three or four, 24 leaves the consumers their 160 or 112 as well.
# H100 (2026-12-06, one process each, TFLOP/s, 32 -> 24): hdim 64 not causal on four warpgroups
# s512 406.2 -> 415.8, s1k 435.3 -> 447.5 (1.9-3.1% in all 12 pairs, bf16 and fp16: the
# registry's); causal on four -1.4% at s512, +0.3% at s1k (the lpt producer spills 100 B at 24);
# three warpgroups within 0.5% (hdim 64 192 x 128, hdim 128 192 x 128 bf16) and e4m3 hdim 128
# 192 x 128 -1% to -2.5%. Two warpgroups (not offered): 24 (consumers 240) or 32 (232) against 40
# within 0.6% on hdim 128 128 x 128 pingpong s512-2k and hdim 256 128 x 64 s512; the causal lpt
# kernel spilled 68 B at 24 and lost 2-4%.
FWD_PRODUCER_REGISTERS = {3: (24, 32), 4: (24, 32)}
# The backward's producer warpgroup runs the loads and the dQ writer warp; its two consumer
# warpgroups hold dK and dV accumulators for the whole CTA and get the rest of what the launch
# allocates (168 per thread x 384 = 64512): setmaxnreg only moves registers inside that pool, and
# a request beyond it blocks forever (32/240 hung). So the producer's count (producer_registers)
# sets the split: 40 -> 232 for the consumers, 24 -> 240 (24 spills 4-12 B in the writer's loop).
BWD_PRODUCER_REGISTERS = (24, 40)
BWD_PRODUCER_REGISTERS_DEFAULT = 40
# Head dims up to this one may give each backward consumer warpgroup 64 keys of its own (block_n 128):
# its fp32 dK and dV then span the whole head dim, 2 * 64 * d / 128 = d registers per thread, which
# leaves room for Sᵀ, dPᵀ and dQ only up to 128. Wider heads split the head dim instead (block_n 64).
BWD_MAX_KEYS_SPLIT_HEAD_DIM = 128
BWD_BLOCK_M = 64  # query rows per backward step: the M of the dQ WGMMA, one per warpgroup
# The backward's scheduler when unset: persistent CTAs ("lpt") where each consumer warpgroup owns
# 64 keys (head dims up to 128), one CTA per key block ("grid") where they split the head dim
# (except hdim 192, below).
# Measured on the H200 (2026-12-01, bf16, 16k tokens, same process, TFLOP/s grid -> lpt): hdim 64
# s1k 270 -> 284, s4k 338 -> 346, s16k 373 -> 376, causal +2-5%; hdim 128 s1k 354 -> 364, s4k
# 484 -> 497, s16k 539 -> 543, causal +1-4%; hdim 256 s16k 411 -> 302 (ncu: twice the
# long-scoreboard stalls, L2 throughput 76% -> 55%), so the head-dim split keeps the grid, except
# at hdim 192 (BWD_PERSISTENT_SPLIT_HEAD_DIMS), where the persistent CTAs won or tied (same H200,
# 2026-12-01, same process, bf16, grid -> lpt): s1k 290 -> 311, s4k 389 -> 392, s16k 437 -> 436;
# causal s1k 235 -> 241, s4k 350 -> 365, s16k 408 -> 408.
BWD_PERSISTENT_DEFAULT = True
BWD_PERSISTENT_SPLIT_HEAD_DIMS = (192,)
# Causal backward: key blocks run longest first within groups of this many (batch, kv head) pairs
# (causal_group), so the launch ends on short ones while the running CTAs stream the Q, dO and dQ
# of a few heads. Measured on the H200 (2026-11-30): every head's first key block before any
# second one (one group of all 16 heads at s16k) was 2-3% faster at s2k-8k and 2% slower at s16k;
# (2026-12-01, same process, hdim 64 and 128 causal, s2k-16k) groups of 1 or 2 were up to 4% slower
# at s4k-8k and groups of 8 within -0% / +3% of 4, so 4 stays.
BWD_CAUSAL_GROUP_DEFAULT = 4
# Registers a consumer thread needs beyond its accumulators (addresses, softmax state, indices).
CONSUMER_REGISTER_OVERHEAD = 32

# Tile defaults per head dim, in the spirit of FA3's forward tiles (bf16/fp16, kBlockM x kBlockN).
_DEFAULT_TILES: dict[tuple[int, bool], tuple[int, int]] = {
    (64, False): (192, 128),
    (64, True): (192, 128),
    (96, False): (128, 128),
    (96, True): (128, 128),
    (128, False): (128, 128),
    (128, True): (128, 128),
    (192, False): (128, 112),
    (192, True): (128, 112),
    (256, False): (128, 80),
    (256, True): (128, 80),
}


def _bytes_per_element(dtype: str) -> int:
    return {"fp16": 2, "bf16": 2, "e4m3": 1}.get(dtype, 2)  # an unknown dtype is reported by its own field


# FP8 kernels give the producer warpgroup 24 registers and two consumer warpgroups 240 each (the
# whole launch allocation, 384 x 168): hdim 256 then runs 128 x 128 tiles without spilling, 882 ->
# 994 TFLOP/s against 128 x 96 (H200, s16k, same process). The lpt scheduler's producer spills at
# 24 (136-216 B in the causal kernels); measured faster all the same at hdim 256 (823 -> 897).
FP8_REGISTER_SPLIT = {2: (24, 240)}
# With v_transpose_in_kernel the producer warpgroup's transposing warps hold four 16-byte rows of
# V and their transpose, more than 24 registers: the 16-bit kernels' split (setmaxnreg moves
# registers within the launch's 168 a thread, so 24 + 2 * 240 leaves no room to grow the producer).
FP8_TRANSPOSE_REGISTER_SPLIT = {2: (40, 232)}
# FP8 (e4m3) forward tiles (block_m, block_n) by head dim, with pingpong on. Measured on the H200
# (2026-11-30, s16k, same process) against 128 x 128 without pingpong: hdim 64 345 -> 436 TFLOP/s
# (128 x 192, pingpong), hdim 128 623 -> 739 (128 x 192, pingpong); hdim 256 keeps 128 x 128,
# with pingpong, given the registers above. The fp8 GEMMs are twice as fast as 16-bit ones, so
# the softmax's exp2 (MUFU) takes as long as they do: pingpong runs one warpgroup's softmax under
# the other's GEMMs. fa3gen.fp8.prepare's per-block scales default to these tiles' rows.
# Head dims with an fp8 kernel: those run on the H200 against float64 (96 is not).
FP8_TILES = {64: (128, 192), 128: (128, 192), 192: (128, 128), 256: (128, 128)}
# The P·V GEMM of an fp8 kernel takes K = 32 keys per WGMMA: block_n must be a multiple of it.
WGMMA_K_FP8 = 32


# FP8 forward kernels without a mask chain their tiles (two Q buffers, O stored from registers)
# where two Q buffers and the O staging tile do not both fit (hdim 256): measured on the H200
# against O through its staging tile with one Q buffer, same process, TFLOP/s: 2026-12-01 s16k
# 1077 -> 1092, later that day s4k 987 -> 1007, s16k 1057 -> 1106. Causal kernels keep the O tile
# (s4k 805 -> 792, s16k 946 -> 966: mixed).
FP8_CHAINED_OVER_O_TILE = True
# Inter-tile overlap by default wherever a spec allows it (two Q buffers, intra-warpgroup
# overlap, a persistent scheduler): measured on the H200 (2026-11-30, bf16, 16k tokens,
# interleaved timing, same process) against the same tiles without it: hdim 128 s512 438 -> 456
# TFLOP/s, s1k 506 -> 539, causal s2k 452 -> 472, s4k 514 -> 544; hdim 64 s512 302 -> 324, s1k
# 337 -> 368; hdim 96 causal s512 189 -> 211; 16k within +-3%. fp8 hdim 128 (with pingpong, scale
# blocks of 768 rows): s4k 674 -> 744, s16k 725 -> 784, causal +3%.
INTER_TILE_OVERLAP_DEFAULT = True
# With the tiles chained, pingpong pays for 16-bit kernels too (it did not on its own): measured
# as above, chained tiles with vs without pingpong: hdim 128 s512 456 -> 475, s4k 588 -> 615,
# causal s512 292 -> 304; hdim 64 (128-row tiles) causal s512 191 -> 208, s1k 270 -> 296; 16k
# within +-1%. The built-in variants take it too: measured on the H200 (2026-12-01, bf16 hdim 128,
# same process, TFLOP/s of the full or causal problem, s4k / s16k): ALiBi (slopes in [0, 1))
# 504 -> 523 / 523 -> 533, softcap 456 -> 464 / 464 -> 474; window (1024, 1024) 1313 -> 1324 /
# 4647 -> 4675; causal window (1024, 0) 1108 -> 1115 / 3912 -> 3987; causal softcap 419 -> 422 /
# 439 -> 434. Specs with a custom score_mod or mask_mod keep it off (not measured with it).
PINGPONG_DEFAULT = True
# Where O's own staging tile does not fit (hdim 192 and 256, beside one Q tile and two K/V
# stages), stage it in the V stages' buffer (epilogue "tma_v") rather than store it from
# registers: measured on the H200 (2026-11-30, bf16, 16k tokens, interleaved, same process),
# hdim 256 128 x 80: s512 397 -> 466 TFLOP/s, s2k 609 -> 656, s16k 728 -> 745; causal s512 241 ->
# 297, s2k 446 -> 482, s16k 620 -> 624. Specs with variants keep "direct" (not measured with it).
O_IN_V_DEFAULT = True
# Forward kernels launch as programmatic dependents (PDL): a call's CTAs start on the SMs the
# previous kernel's CTAs leave, and set up there while its last CTAs finish.
PROGRAMMATIC_LAUNCH_DEFAULT = True
# 16-bit forward kernels with head_dim_v >= 128 rescale O lazily (lazy_rescale): measured on the
# H200 (2026-11-30, bf16, 16k tokens, same process, eager) against the same kernels without it:
# hdim 256 s2k 655 -> 698 TFLOP/s, s16k 734 -> 777, causal s2k 495 -> 520, s16k 632 -> 665; hdim
# 128 (128 x 128, pingpong, chained) s2k 566 -> 592, s16k 620 -> 647, causal s4k 531 -> 550; the
# hdim 128 176-key kernels without pingpong within +-1%. At hdim 64 (32 O registers a thread, little
# to save) it costs more than it saves: s16k 539 -> 450, causal s2k 373 -> 342.
LAZY_RESCALE_DEFAULT = True
LAZY_RESCALE_MIN_HEAD_DIM_V = 128
# How far a row's max may grow before a lazy rescale raises it: 2^8 in probability.
LAZY_RESCALE_LOG2 = 8
# e4m3: the fp8 P is scaled by 2^FP8_PROB_LOG2_SCALE before its cast (small probabilities keep
# e4m3's normal range); with lazy_rescale by 2^(FP8_PROB_LOG2_SCALE - FP8_LAZY_RESCALE_LOG2), so
# that a stale max's probabilities, up to 2^FP8_LAZY_RESCALE_LOG2, stay within e4m3 (max 448).
# Emulated on the CPU (BENCHMARKS.md, P's scale), a factor of 32 instead of 256 costs < 0.04% RMSE.
FP8_PROB_LOG2_SCALE = 8
FP8_LAZY_RESCALE_LOG2 = 2
# ... and O keeps its V unit while the key blocks' V scales stay within a factor 2^this below it,
# each block's ratio going into its P: P's effective factor stays within (2^(8 - 2 - 2), 2^(8 - 2)]
# = (16, 64]; with power-of-two scales (the lazy kernels' inputs) a block at half the unit keeps
# it at a factor 32, where a range of 1 let only equal scales keep it, so V scales alternating
# between two powers of two rescaled O every block. (The bound alone did not recover the accuracy
# the first lazy kernels lost, 9.80e-3 -> 9.64e-3 on the FA3 paper experiment against the eager
# 8.99e-3; power-of-two scales did, see below.)
FP8_UNIT_LOG2_RANGE = 2
# scores_f16 kernels take Q and K quantized to |x| <= this (a power of two): then every score
# |q·k| <= head_dim * 16^2 (32768 at hdim 128) is finite in fp16. Values below 2^-10 of it are
# e4m3 subnormals, each off by at most 2^-14 of it: under the rounding of the values that matter.
SCORES_F16_QK_MAX = 16.0
FP16_MAX = 65504.0


def _e4m3_step(x: float) -> float:
    """The spacing of float8_e4m3fn values around x > 0 (three mantissa bits; subnormal below 2^-6)."""
    return 2.0 ** (max(math.floor(math.log2(x)), -6) - 3)


def e4m3_round_down(x: float) -> float:
    """The largest float8_e4m3fn value <= x (x in (0, 448])."""
    step = _e4m3_step(x)
    return math.floor(x / step) * step


def e4m3_round_up(x: float) -> float:
    """The smallest float8_e4m3fn value >= x (x in (0, 448]): the largest a value quantized
    within x can become, e4m3's cast rounding to nearest."""
    step = _e4m3_step(x)
    return math.ceil(x / step) * step


def scores_f16_qk_max(head_dim: int) -> float:
    """The |q|, |k| bound under which every score of a head dim is finite in fp16: an e4m3 value
    (so the cast rounds nothing past it), SCORES_F16_QK_MAX or the largest under sqrt(65504 /
    head_dim) where that is less (hdim 256: 15, under 15.996; quantized to 15.996, a value could
    round to 16 and a score reach 256 * 16^2 = 65536)."""
    return min(SCORES_F16_QK_MAX, e4m3_round_down((FP16_MAX / head_dim) ** 0.5))


# e4m3 forward kernels rescale O lazily by default from head_dim_v 192, where it is faster; it was
# opt-in while it was less accurate. Measured on the H200 (2026-12-02, scripts/bench_fp8.py, interleaved with the
# eager kernel in one process, 16k tokens, TFLOP/s eager -> lazy): hdim 256 s4k 986.6 -> 1042.3,
# s16k 1084.0 -> 1161.1, causal 780.1 -> 817.7 and 913.6 -> 970.2; hdim 192 s4k 882.1 -> 925.5,
# s16k 931.3 -> 977.8, causal +2-4%; hdim 128 -3 to -4% and hdim 64 -1.5 to -7% (the first
# version). But the FA3 paper experiment's RMSE (outlier inputs, against float64) rose from
# 8.99e-3 to 9.64e-3 at hdim 128 s2k and from 7.68e-3 to 9.34e-3 at hdim 256 s8k, and more with
# the sequence. The cause (found by a float64 emulation that reproduced it): a V ratio that is not
# a power of two makes the row max's P (exactly 2^k otherwise) inexact in e4m3, and with peaked
# attention that key dominates. fp8.prepare now rounds scales to powers of two: then lazy and eager
# agree (hdim 128 s2k 8.97e-3 / 8.99e-3, hdim 256 s8k 7.65e-3 / 7.70e-3) and lazy still gains
# (hdim 256 s16k 1104.0 -> 1152.8, causal 944.5 -> 967.9). So the default from head_dim_v 192;
# V scales per block that are not all powers of two (quantize_e4m3 without power_of_two, the
# caller's own) would lose the accuracy again, and get the eager kernel instead
# (fa3gen.fp8_ops picks it; registry.default_fp8_spec(power_of_two_v_scales=False)).
FP8_LAZY_RESCALE_DEFAULT = True
FP8_LAZY_RESCALE_MIN_HEAD_DIM_V = 192
# With a window too. The lazy causal window kernel at hdim 256 hung twice in about 150
# back-to-back launches on the H200 (2026-12-02), and window kernels were kept eager. The likely
# cause was the pingpong turns restarted per tile (both rescales had them; fixed 2026-12-03: a
# delay in warpgroup 0 at a tile's end hung the old scheme at once, not the new one); since the
# fix, 0 hangs in 1000+ launches of the lazy window kernel (BENCHMARKS.md, 2026-12-03).
FP8_LAZY_RESCALE_WITH_WINDOW = True
# 16-bit forward kernels with head_dim_v >= 128 reduce each row's max and sum in two chains
# (row_reduce_chains): measured on the H200 (2026-11-30, bf16, 16k tokens, same process, eager)
# against one chain: hdim 128 (128 x 128, pingpong, chained) s512 477 -> 491 TFLOP/s, s2k 578 ->
# 601, s16k 629 -> 642; causal (one Q buffer) s2k 489 -> 506; hdim 256 s16k 771 -> 786; the hdim
# 128 one-Q-buffer kernel not causal +0-1%. hdim 64 loses (s2k 488 -> 448, causal s4k 404 -> 384).
ROW_REDUCE_CHAINS_DEFAULT = 2
ROW_REDUCE_CHAINS_MIN_HEAD_DIM_V = 128

# Causal forward kernels of these head dims, and those with one built-in variant, keep Q in
# registers (q_registers). Measured on the H200 (2026-12-01, bf16, 16k tokens, same process,
# TFLOP/s without -> with): hdim 128 causal,
# one Q buffer s2k 509 -> 523, s16k 606 -> 622; chained with pingpong s2k 507 -> 517, s16k 599 ->
# 616. Not causal it lost with one Q buffer (s2k 609 -> 572, s16k 669 -> 644) and tied chained (612
# -> 619, 660 -> 667); hdim 64's three consumer warpgroups (160 registers) spilled 288 B. Only on
# key blocks up to 128 wide: at 128 x 176 the wider S and P left no room for Q (spilled 288 B).
# e4m3 (128 x 192, its own key-block limit), with the buffer released after each tile's first
# Q·Kᵀ (2026-12-01, another H200, one process): causal s4k 623.7 -> 629.7, s16k 697.2 -> 711.5
# (and its lpt producer's spills 132 -> 72 B); not causal it lost (729.8 -> 713.6, 793.1 ->
# 754.8); hdim 256 e4m3 spilled 392-656 B. The built-in variants' causal 16-bit kernels too
# (same day and GPU, s4k / s16k): softcap 428.8 -> 452.5 / 432.0 -> 466.2, window (1024, 0)
# 1115 -> 1139 / 4078 -> 4167 (of the causal problem's FLOPs), ALiBi 497.6 -> 502.6 / 521.0 ->
# 529.6, each variant alone; composed (window + softcap + ALiBi) it spilled 236 B. Not causal
# too (chained, pingpong; s4k / s16k): softcap 454.5 -> 468.5 / 467.1 -> 481.1, ALiBi 505.2 ->
# 521.0 / 517.1 -> 535.0, window (1024, 1024) 1288 -> 1304 / 4605 -> 4665 (ALiBi and the window
# spill 32 and 16 B with it, and still gain). Custom score_mod / mask_mod kernels, compositions and
# e4m3 variants keep Q in shared memory.
Q_REGISTERS_CAUSAL_HEAD_DIMS = (128,)
Q_REGISTERS_MAX_BLOCK_N = {"bf16": 128, "fp16": 128, "e4m3": 192}


# Three consumer warpgroups (160 registers each) from head_dim_v 128 hold S and O for one key block
# but not S of the next beside them: with intra-warpgroup overlap 192 x 128 spills (bf16 412 B,
# e4m3 304 B), without it none, and the three warpgroups' GEMMs and softmax interleave on their
# own. Measured on the H200 (2026-12-03, 16k tokens, interleaved, same process, TFLOP/s), hdim 128
# not causal, 192 x 128 without overlap against the registry's 128 x 128 (one Q buffer, two
# warpgroups): bf16 s4k 638.0 -> 648.5, 627.2 -> 631.1, 630.6 -> 639.8; s16k 673.7 -> 681.5,
# 656.0 -> 664.7, 656.2 -> 662.7 (three processes); fp16 s4k 618.2 -> 629.6, s16k 634.1 -> 643.5.
# With overlap it spilled and lost 20-25% (192 x 96: bf16 s16k 519; e4m3 s16k 648 vs 862).
INTRA_WG_OVERLAP_MAX_HEAD_DIM_V_3WG = 96


def _intra_wg_overlap_default(fields: dict[str, Any]) -> bool:
    """intra_wg_overlap when unset, from a forward spec's raw fields."""
    dv = fields.get("head_dim_v") or fields.get("head_dim")
    three = isinstance(fields.get("num_consumer_warpgroups"), int) and fields["num_consumer_warpgroups"] >= 3
    return not (three and isinstance(dv, int) and dv > INTRA_WG_OVERLAP_MAX_HEAD_DIM_V_3WG)


def _q_registers_default(fields: dict[str, Any]) -> bool:
    """q_registers when unset, from a forward spec's raw fields."""
    d = fields.get("head_dim")
    dtype = str(fields.get("dtype", "bf16"))
    custom = _has_unmeasured_code(fields)
    built_in = sum(bool(fields.get(name)) for name in ("window", "softcap", "alibi"))
    measured = not custom and built_in <= (0 if dtype == "e4m3" else 1)
    max_block_n = Q_REGISTERS_MAX_BLOCK_N.get(dtype)
    # Not with three consumer warpgroups: Q's 64 registers beside S and O spill (hdim 128 192 x 128:
    # bf16 364 B, e4m3 144 B).
    two_or_fewer = fields.get("num_consumer_warpgroups") in (None, 1, 2)
    return (max_block_n is not None and (fields.get("causal") is True or built_in == 1) and measured and two_or_fewer
            and d in Q_REGISTERS_CAUSAL_HEAD_DIMS and fields.get("head_dim_v") in (None, d)
            and isinstance(fields.get("block_n"), int) and fields["block_n"] <= max_block_n)


# Where the wait for the previous key block's P·V goes (pin_pv_wait). Without a pin, ptxas hoists
# that wait to the top of its basic block: in the e4m3 and hdim 64 kernels above every exp2 of the
# block, in the lazy-rescale kernels above about half of them (the rescale's branch ends a block).
# Pinned after both rows (2), measured on the H200 (2026-12-01, bf16, 16k tokens, two processes,
# TFLOP/s without -> with, s512 / s2k / s16k): hdim 256 (128 x 80) 486.0 -> 505.4, 681.2 -> 695.6,
# 770.0 -> 778.4 (the other process: +1.9%, +1.4%, +1.0%); causal +0.1% / +0.8% / +1.6% (+1.2%,
# +1.5%, +0.3%). It lost elsewhere: e4m3 hdim 128 s16k 790.9 -> 737.6, hdim 256 1107.9 -> 998.2;
# bf16 hdim 64 s512 388.1 -> 345.0, causal (128 x 128) 242.7 -> 224.0; hdim 128 -1 to -3% (chained
# or one Q buffer, causal with Q in registers too). With the wait at the block's top, the O
# rescale and P's conversion (both after the wait) interleave with the exp2 on the MUFU; pinned,
# they follow the softmax. After one row (1), ptxas still moved the other row's exp2 above the
# store in the e4m3 and hdim 64 kernels, and hdim 128 and 256 lost 1-3%.
PIN_PV_WAIT_HEAD_DIMS = (256,)
# Row sums on the tensor cores (row_sums_mma): P·1 beside P·V, N = 8 columns of ones. On by
# default for e4m3, whose softmax issue slots bound the key-block loop (an FADD a score is a seventh
# of them); 16-bit kernels lost with it (H200, 2026-12-03, bf16, against HEAD's templates, one
# process, TFLOP/s): hdim 64 (192 x 128) s2k 475.8 -> 412.2, s16k 525.3 -> 458.5; hdim 128
# (192 x 128) s4k 628.0 -> 601.1, s16k 653.8 -> 627.5; causal s16k 608.7 -> 573.8: the N = 8
# WGMMAs (one per 16 keys there, per 32 in e4m3) cost the tensor pipe more than the FADDs cost.
# e4m3, one process against the thread sums (2026-12-04, TFLOP/s, s512 / 2k / 16k): hdim 64
# 314.0 -> 324.4 / 412.9 -> 426.9 / 500.3 -> 515.5; hdim 128 past 1k queries (192 x 128, serial
# loop) 590.3 -> 627.2 / 771.7 -> 838.4 / 844.2 -> 919.3; causal 335.5 -> 336.6 / 598.4 -> 620.5 /
# 755.8 -> 820.5. The sums are of P as rounded to e4m3: O's error is unchanged (6.6-6.9e-3 vs the
# dequantized inputs' float64 attention), the LSE's grows from 1.0-2.1e-2 to 2.2-3.0e-2. From
# hdim 192 (lazy rescale, each block's V factor out of its sums) it tied at hdim 256 (1163.1 ->
# 1156.8 at s16k, causal 1039.0 -> 1035.3) and moved the LSE more (4.3e-2): not taken there.
ROW_SUMS_MMA_N = 8
ROW_SUMS_MMA_DTYPES = ("e4m3",)
ROW_SUMS_MMA_MAX_HEAD_DIM_V = 128
PIN_PV_WAIT_BLOCK_N = 80
# K's and V's per-block factors through shared memory (kv_factors_in_smem): off. Measured against
# the loads from L2 (H200, 2026-12-05, BENCHMARKS.md): hdim 256 within noise (+0.2 to +1.6%, causal
# s16k -1.5%), hdim 128 causal -2 to -3%.
KV_FACTORS_IN_SMEM_DEFAULT = False
# The tensor param slot (Fa3genVariantParams.tensor_args) that carries a block-sparse kernel's
# block ranges (block_sparse): the last one.
BLOCK_RANGES_SLOT = MAX_TENSOR_ARGS - 1
# Built-in masks whose values come per call in a tensor: each compiles in as a mask expression over
# its tensor param (all masks must show an element: the built-ins', the custom mask_mod's, causal,
# the window). documents: packed sequences, a query sees the keys of its own document only
# (document_ids (batch, seqlen) int32; seqlen_q == seqlen_k). prefix_lm: every query sees the
# prefix_lengths[b] first keys, and causally after them (bottom-right aligned, like causal).
BUILT_IN_MASKS: dict[str, tuple[TensorParam, str]] = {
    "documents": (TensorParam(name="document_ids", ndim=2, dtype="int32"),
                  "document_ids(b, q_idx) == document_ids(b, kv_idx)"),
    "prefix_lm": (TensorParam(name="prefix_lengths", ndim=1, dtype="int32"),
                  "kv_idx <= q_idx + seqlen_k - seqlen_q || kv_idx < prefix_lengths(b)"),
}


# The built-in additive bias (bias=True): score += attn_bias[b, h, q_idx, kv_idx], a float32 (or
# bias_dtype's 16-bit) tensor given per call (batch, nheads_q, seqlen_q, seqlen_k), keys contiguous (0 strides broadcast), after ALiBi and
# before a score_mod. Its derivative d(score)/d(score) is 1. A backward kernel with bias_grad=True
# adds d(loss)/d(attn_bias) into attn_bias_grad, a float32 tensor of the same shape that the caller
# zeroes (stride 0 where the bias broadcasts: the entries it shares add into one element).
BUILT_IN_BIAS = TensorParam(name="attn_bias", ndim=4, dtype="float32")
_BIAS_DTYPE_TAGS = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}
_BIAS_ELEMENTS = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
BIAS_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BUILT_IN_BIAS_GRAD = TensorParam(name="attn_bias_grad", ndim=4, dtype="float32")
# Each built-in that takes a tensor: its field and the tensor param it passes it as (after the
# declared params, in this order).
BUILT_IN_TENSORS: dict[str, TensorParam] = {**{name: param for name, (param, _) in BUILT_IN_MASKS.items()},
                                            "bias": BUILT_IN_BIAS, "bias_grad": BUILT_IN_BIAS_GRAD}


def _has_mask(fields: dict[str, Any]) -> bool:
    """A spec's raw fields compile in a per-element mask expression (a mask_mod or a built-in one)."""
    return fields.get("mask_mod") is not None or any(fields.get(name) for name in BUILT_IN_MASKS)


def _has_unmeasured_code(fields: dict[str, Any]) -> bool:
    """A spec's raw fields compile in per-element code the measured defaults were not timed with:
    a custom score_mod, a mask expression, or the tensor bias."""
    return fields.get("score_mod") is not None or _has_mask(fields) or bool(fields.get("bias"))


def _block_sparse_default(fields: dict[str, Any]) -> bool:
    """block_sparse when unset: with the built-in masks, whose blocks depend on their tensors (a
    custom mask_mod opts in: a mask that hides no whole block gains nothing from it, and each new
    problem costs a classification)."""
    return any(fields.get(name) for name in BUILT_IN_MASKS)


def _plain_16bit_of(fields: dict[str, Any], head_dims: tuple[int, ...]) -> bool:
    """A forward spec's raw fields: 16-bit inputs, one of head_dims (head_dim_v equal to it) and no
    variant: the kernels a measured default was measured on."""
    d = fields.get("head_dim")
    return (d in head_dims and fields.get("head_dim_v") in (None, d) and fields.get("dtype", "bf16") != "e4m3"
            and not _has_variant(fields))


def _pin_pv_wait_default(fields: dict[str, Any]) -> int:
    """pin_pv_wait when unset, from a forward spec's raw fields: 2 (after both rows) for the
    16-bit hdim 256 kernels on 80-key blocks without a variant, where it was measured faster; else 0."""
    measured = _plain_16bit_of(fields, PIN_PV_WAIT_HEAD_DIMS) and fields.get("block_n") == PIN_PV_WAIT_BLOCK_N
    return 2 if measured and fields.get("intra_wg_overlap", True) is True else 0


# Per-warpgroup key trimming (warpgroup_key_trim) is on by default where it measured faster: the
# 16-bit causal kernels of these head dims without pingpong or a variant. On the H200 (2026-12-01,
# bf16, 16k tokens, interleaved, TFLOP/s without -> with): hdim 64 causal (192 x 128, three
# warpgroups) s512 217.4 -> 236.6, s2k 370.6 -> 383.0, s4k 412.4 -> 420.4, s16k 486.7 -> 484.2;
# hdim 256 causal (128 x 80) s512 315.2 -> 329.3, s2k 523.3 -> 532.2, s16k 660.6 -> 661.2, (128 x
# 64) s512 328.1 -> 335.0, s1k 441.6 -> 451.7. e4m3 hdim 128 causal (pingpong, where the cut
# blocks still take their turns) lost at 16k: 743.4 -> 712.8 (s2k 551.5 -> 567.6). hdim 192
# causal (128 x 112), two runs: s512 303.1 -> 325.2 and 301.6 -> 324.1, s2k 559.1 -> 584.0 and
# 564.8 -> 587.4, s16k 715.4 -> 733.6 and 732.0 -> 739.5. Not causal (where only a warpgroup past
# seqlen_q trims), hdim 64 (192 x 128, 2026-12-02): within 0.7% either way at every length.
WARPGROUP_KEY_TRIM_HEAD_DIMS = (64, 192, 256)


def _warpgroup_key_trim_default(fields: dict[str, Any]) -> bool:
    """warpgroup_key_trim when unset, from a forward spec's raw fields (pingpong already filled):
    on for the 16-bit causal kernels of WARPGROUP_KEY_TRIM_HEAD_DIMS without pingpong or a variant."""
    return (_plain_16bit_of(fields, WARPGROUP_KEY_TRIM_HEAD_DIMS) and fields.get("causal") is True
            and fields.get("pingpong") is False)


# The narrow edge block (narrow_edge_block) is on by default for the 16-bit causal kernels without a
# variant of these (head_dim, block_n), where it measured faster. On the H200 (2026-12-02, bf16, 16k
# tokens, interleaved, two runs in one process, TFLOP/s without -> with): hdim 64 causal 128 x 128
# pingpong (then the registry's up to 1k) s512 239.9 -> 252.6 and 241.6 -> 256.5, s1k 315.1 -> 321.0 and
# 316.6 -> 326.5; 192 x 128 (past 1k) s2k 383.6 -> 395.3 and 383.8 -> 396.2, s4k +2%, s16k +1.7%;
# hdim 192 causal (128 x 112) s1k +2.6% / +1.5%, s2k +1.3% / +1.9%; hdim 256 causal on 64 keys
# s512 +2.1% / +0.4%, s1k +0.9% / +1.0%. Not taken: hdim 256 on 80 keys (within 0.3%), hdim 128
# causal (one Q buffer, Q in registers): s1k 425.4 -> 418.2 and 431.4 -> 419.4, s2k -2%.
NARROW_EDGE_BLOCK_TILES: tuple[tuple[int, int], ...] = ((64, 128), (192, 112), (256, 64))


def _narrow_edge_block_default(fields: dict[str, Any]) -> bool:
    """narrow_edge_block when unset, from a forward spec's raw fields (block_n already filled): on
    for the 16-bit causal kernels of NARROW_EDGE_BLOCK_TILES without a variant."""
    measured = _plain_16bit_of(fields, tuple(d for d, _ in NARROW_EDGE_BLOCK_TILES))
    return (measured and (fields.get("head_dim"), fields.get("block_n")) in NARROW_EDGE_BLOCK_TILES
            and fields.get("causal") is True and fields.get("intra_wg_overlap", True) is True)


# Backward kernels of head dims up to this one, with the keys split, keep K and V in registers
# (kv_registers) and run BWD_KV_REGISTERS_STAGES stages of Q and dO. At hdim 64 a step is bound by
# shared-memory bandwidth more than by the tensor cores: per step and CTA its SS GEMMs, dS, the dQ
# tile and the loads move about 208 KB through shared memory (1.6k cycles at 128 B a clock) against
# 1.3k cycles of WGMMA at peak, and K and V as A operands were 32 KB of it. Their 32 registers a
# thread fit beside hdim 64's accumulators, not hdim 96's (spilled 28-32 B, 3-15% slower).
# Measured on the H200 (2026-12-01, bf16, 16k tokens, same process, TFLOP/s; 2 stages from shared
# memory -> registers -> registers with 3 stages): s1k 297 -> 312 -> 315, s4k 350 -> 371 -> 380,
# s16k 374 -> 390 -> 404; causal s1k 190 -> 204 -> 205, s4k 283 -> 299 -> 304, s16k 325 -> 341 -> 349.
# Backward kernels of these head dims, with the keys split, issue each step's dQ GEMM in the next
# step (dq_deferred). Measured on the H200 (2026-12-01, bf16, 16k tokens, same process, TFLOP/s
# without -> with): hdim 64 (K and V in registers) s1k 300.6 -> 311.6, s4k 370.7 -> 387.4, s16k
# 399.9 -> 412.2; hdim 96 s1k 331.1 -> 340.5, s4k 432.6 -> 451.2, s16k 460.9 -> 480.9 (with the dQ
# issued at the start of the step, before its probabilities: hdim 96 0.3-1.2% below that, hdim 64
# 1-4% below the kernel without). hdim 128 spills 80-220 B and loses 15-40%.
BWD_DQ_DEFERRED_HEAD_DIMS = (64, 96)
BWD_KV_REGISTERS_MAX_HEAD_DIM = 64
# Backward kernels of these head dims that defer the dQ run each step's dQ GEMM in one warpgroup
# over the whole head dim, the two taking turns (dq_single_warpgroup): dS crosses shared memory
# once per step instead of once per warpgroup (16 KB of hdim 64's ~176 KB), and the warpgroup
# without the step's dQ no longer waits at the dS barrier. Measured on the H200 (2026-12-01, bf16,
# 16k tokens, same process, TFLOP/s, s1k / s4k / s16k, without -> with): hdim 64 315.6 -> 359.1,
# 392.9 -> 450.7, 415.5 -> 480.8, causal 203.4 -> 213.9, 291.5 -> 311.1, 340.2 -> 363.1; hdim 96
# 339.6 -> 368.9, 444.4 -> 482.6, 487.4 -> 523.7, causal 235.7 -> 245.3, 333.3 -> 368.6,
# 393.6 -> 415.8. (The causal hdim 96 kernels keep per-tile values in local memory, 28 B.)
BWD_DQ_SINGLE_WARPGROUP_HEAD_DIMS = (64, 96)
# ... and so do the backward kernels of these head dims, causal or not, at the step's end (hdim
# 128 does not defer its dQ). Measured there (same process, s1k / s4k / s16k):
# 376.6 -> 386.6, 492.4 -> 515.7, 541.2 -> 560.8, although the dQ accumulator beside dK's and dV's
# spills 40 B. Causal it spilled 72 B and lost 3-4% while every block tested each entry's mask
# (261.6 -> 251.6, 426.1 -> 408.3, 496.6 -> 478.0); with the test only on the diagonal's blocks it
# gains (2026-12-01, s1k / s4k / s16k: 270.8 -> 270.5, 440.5 -> 461.4, 512.4 -> 544.1), and more
# with the producer at 24 registers (below). So do the windows and soft-capping (same H200 and day,
# same process, with the producer at 24, s1k / s4k / s16k): causal 1k window 274.9 -> 285.6,
# 751.8 -> 785.1, 2702.6 -> 2914.8; causal softcap 244.0 -> 253.2, 378.4 -> 406.6, 432.7 -> 477.1;
# softcap 350.3 -> 354.9, 431.1 -> 448.3, 463.7 -> 486.2. ALiBi tied (529.8 -> 527.2 at s16k), and
# the custom mods were not measured: those keep the dQ split over both warpgroups.
BWD_DQ_SINGLE_WARPGROUP_STEP_END_HEAD_DIMS = (128,)
_BWD_DQ_SINGLE_WARPGROUP_STEP_END_WITHOUT = ("alibi", "bias", "score_mod", "mask_mod", "documents", "prefix_lm")
# Backward kernels of these head dims that run each step's dQ in one warpgroup at the step's end
# give the producer warpgroup 24 registers and their consumers 240: the 64 fp32 of the dQ
# accumulator beside dK's and dV's 128 then leave the step loop without spills (the causal kernel
# spilled 80 B at 232, 56 B at 240, none of it in the step loop; the plain one 40 -> 16 B), for
# spills in the producer's loops at 24. Measured on the H200 (2026-12-01, bf16, 16k tokens, same process, TFLOP/s,
# s512 / s1k / s4k / s16k, 40 -> 24): 300.2 -> 310.4, 390.0 -> 404.9, 503.9 -> 512.0,
# 566.6 -> 564.7; causal 177.1 -> 188.2, 270.5 -> 284.6, 461.4 -> 477.7, 544.1 -> 558.1 (cuDNN
# 505.8 there). The causal kernel with both halves of the dQ gained 1-3% from it.
BWD_PRODUCER_REGISTERS_DQ_SINGLE_HEAD_DIMS = (128,)
BWD_KV_REGISTERS_STAGES = 3
# Persistent backward kernels of these head dims (keys split) prefetch the key block their CTA
# claims next into L2 (kv_prefetch). Measured on the H200 (2026-12-01, bf16, 16k tokens, same
# process, TFLOP/s, s512 / s1k / s2k / s4k / s16k, off -> on): hdim 128 284.9 -> 291.6, 397.5 ->
# 401.3, 455.1 -> 462.0, 487.0 -> 494.6, 551.9 -> 553.4; causal 184.4 -> 188.9, 281.8 -> 286.3,
# 369.4 -> 385.8, 462.6 -> 464.5, 559.5 -> 561.6; hdim 64 269.9 -> 275.5, 344.6 -> 351.1, 400.8 ->
# 403.9, 429.1 -> 438.7, 462.8 -> 463.7, but in another process 263.0 -> 260.0, 334.8 -> 333.0,
# 400.1 -> 398.0, 416.3 -> 414.5, 463.1 -> 464.2, causal 160.1 -> 165.3, 247.5 -> 246.4, 314.7 ->
# 310.7, 397.5 -> 395.6, 466.2 -> 459.2: within the noise, so hdim 64 keeps it off. (hdim 96 and
# the head-dim split of 192 were not measured.)
BWD_KV_PREFETCH_HEAD_DIMS = (128,)


def _bwd_keys_split(fields: dict[str, Any]) -> bool:
    """A backward spec's consumer warpgroups each own 64 keys (block_n = 64 per warpgroup), rather
    than sharing 64 keys and splitting the head dim."""
    nwg = fields.get("num_consumer_warpgroups")
    return isinstance(nwg, int) and fields.get("block_n") == WGMMA_M * nwg


def _bwd_kv_registers_default(fields: dict[str, Any]) -> bool:
    """kv_registers when unset: on where the keys are split and the head dim is small enough."""
    head_dim = fields.get("head_dim")
    return isinstance(head_dim, int) and head_dim <= BWD_KV_REGISTERS_MAX_HEAD_DIM and _bwd_keys_split(fields)


def _bwd_dq_deferred_default(fields: dict[str, Any]) -> bool:
    """dq_deferred when unset: on for the head dims measured faster with it, with the keys split,
    except where the step also carries a score derivative (softcap, score_mod: the causal
    soft-capped hdim 64 kernel spilled 32 B with it)."""
    score_grad = bool(fields.get("softcap")) or fields.get("score_mod") is not None
    return fields.get("head_dim") in BWD_DQ_DEFERRED_HEAD_DIMS and _bwd_keys_split(fields) and not score_grad


def _bwd_dq_single_warpgroup_default(fields: dict[str, Any]) -> bool:
    """dq_single_warpgroup when unset: on for the head dims in BWD_DQ_SINGLE_WARPGROUP_HEAD_DIMS
    whose kernels defer the dQ, and for the kernels of BWD_DQ_SINGLE_WARPGROUP_STEP_END_HEAD_DIMS
    that do not, except with ALiBi or a custom mod."""
    head_dim, deferred = fields.get("head_dim"), fields.get("dq_deferred")
    if head_dim in BWD_DQ_SINGLE_WARPGROUP_HEAD_DIMS:
        # Not with ALiBi or a mask_mod (unmeasured there, and their hdim 64 kernels spill 12-24 B with it).
        return deferred is True and not fields.get("alibi") and not fields.get("bias") and not _has_mask(fields)
    measured = not any(fields.get(name) for name in _BWD_DQ_SINGLE_WARPGROUP_STEP_END_WITHOUT)
    return head_dim in BWD_DQ_SINGLE_WARPGROUP_STEP_END_HEAD_DIMS and measured and deferred is False and _bwd_keys_split(fields)


def _bwd_kv_prefetch_default(fields: dict[str, Any]) -> bool:
    """kv_prefetch when unset: on for the persistent kernels of BWD_KV_PREFETCH_HEAD_DIMS with the
    keys split."""
    lpt = fields.get("scheduler") == "lpt"
    return fields.get("head_dim") in BWD_KV_PREFETCH_HEAD_DIMS and _bwd_keys_split(fields) and lpt


def _bwd_producer_registers_default(fields: dict[str, Any]) -> int:
    """producer_registers when unset: 24 where a step's dQ runs in one warpgroup at the step's end
    (BWD_PRODUCER_REGISTERS_DQ_SINGLE_HEAD_DIMS), else BWD_PRODUCER_REGISTERS_DEFAULT."""
    step_end_dq = fields.get("dq_single_warpgroup") is True and fields.get("dq_deferred") is False
    if step_end_dq and fields.get("head_dim") in BWD_PRODUCER_REGISTERS_DQ_SINGLE_HEAD_DIMS:
        return min(BWD_PRODUCER_REGISTERS)
    return BWD_PRODUCER_REGISTERS_DEFAULT


# Fields that canonical_json leaves out at their filled default: each maps a spec's fields (as
# JSON) to that default. Added after kernels were cached, they change none of their keys.
_OMITTED_AT_DEFAULT: dict[str, Callable[[dict[str, Any]], Any]] = {
    "causal_group": lambda f: BWD_CAUSAL_GROUP_DEFAULT if f["kind"] == "bwd" else None,
    "q_registers": lambda f: _q_registers_default(f) if f["kind"] == "fwd" else None,
    "pin_pv_wait": lambda f: _pin_pv_wait_default(f) if f["kind"] == "fwd" else None,
    "warpgroup_key_trim": lambda f: _warpgroup_key_trim_default(f) if f["kind"] == "fwd" else None,
    "narrow_edge_block": lambda f: _narrow_edge_block_default(f) if f["kind"] == "fwd" else None,
    "kv_registers": lambda f: _bwd_kv_registers_default(f) if f["kind"] == "bwd" else None,
    "dq_deferred": lambda f: _bwd_dq_deferred_default(f) if f["kind"] == "bwd" else None,
    "dq_single_warpgroup": lambda f: _bwd_dq_single_warpgroup_default(f) if f["kind"] == "bwd" else None,
    "producer_registers": lambda f: _bwd_producer_registers_default(f) if f["kind"] == "bwd" else None,
    "kv_prefetch": lambda f: _bwd_kv_prefetch_default(f) if f["kind"] == "bwd" else None,
    "v_transpose_in_kernel": lambda f: False,
    "row_sums_mma": lambda f: _row_sums_mma_default(f) if f["kind"] == "fwd" else None,
    "kv_factors_in_smem": lambda f: _kv_factors_in_smem_default(f) if f["kind"] == "fwd" else None,
    "block_sparse": _block_sparse_default,
    "documents": lambda f: False,
    "bias": lambda f: False,
    "prefix_lm": lambda f: False,
    "bias_grad": lambda f: False,
    "bias_dtype": lambda f: "float32",
    "bias_staging": lambda f: False,
    "kv_multicast": lambda f: False,
    "split_tail": lambda f: False,
    "split_tail_min_saving_percent": lambda f: SPLIT_TAIL_MIN_SAVING_PERCENT,
    "split_tail_piece_blocks": lambda f: SPLIT_TAIL_PIECE_BLOCKS,
    "scores_f16": lambda f: False,
    "exp2_poly_every": lambda f: 0,
}

# The fields a forward and its backward share: the problem and its variants, not the tiles.
# The attention variants a spec can compile in.
_VARIANT_FIELDS = ("window", "softcap", "alibi", "bias", "score_mod", "mask_mod", *BUILT_IN_MASKS)
_PROBLEM_FIELDS = ("head_dim", "head_dim_v", "dtype", "out_dtype", "causal", *_VARIANT_FIELDS, "bias_dtype", "params")


def _has_variant(fields: dict[str, Any]) -> bool:
    """A spec's raw fields compile in a built-in variant or a custom mod."""
    return any(fields.get(name) for name in _VARIANT_FIELDS)


def _inter_tile_overlap_missing(intra_wg_overlap: Any, scheduler: Any, q_buffers: Any, epilogue: Any) -> list[str]:
    """What a forward spec lacks for inter_tile_overlap (empty: it may chain tiles)."""
    return [need for need, ok in (("intra_wg_overlap=True", intra_wg_overlap is True),
                                  ("a persistent scheduler ('static' or 'lpt')", scheduler != "grid"),
                                  ("q_buffers=2 or 3 (the next tile's Q loads while this tile runs)",
                                   isinstance(q_buffers, int) and q_buffers >= 2),
                                  ("an epilogue other than 'tma_v' (epilogue='tma_v' does not chain tiles: the "
                                   "next tile's first P·V would wait for this tile's store)", epilogue != "tma_v"))
            if not ok]


def _lazy_rescale_default(data: dict[str, Any]) -> bool:
    """A forward spec's raw fields: whether it rescales O lazily by default (head_dim_v of at
    least LAZY_RESCALE_MIN_HEAD_DIM_V at 16 bits, FP8_LAZY_RESCALE_MIN_HEAD_DIM_V for e4m3, with a
    window where FP8_LAZY_RESCALE_WITH_WINDOW)."""
    dv = data.get("head_dim_v")
    if data.get("dtype") == "e4m3":
        return (FP8_LAZY_RESCALE_DEFAULT and isinstance(dv, int) and dv >= FP8_LAZY_RESCALE_MIN_HEAD_DIM_V
                and (FP8_LAZY_RESCALE_WITH_WINDOW or not data.get("window")))
    return LAZY_RESCALE_DEFAULT and isinstance(dv, int) and dv >= LAZY_RESCALE_MIN_HEAD_DIM_V


def _row_sums_mma_blockers(fields: dict[str, Any]) -> list[str]:
    """A filled forward spec's fields: why its row sums cannot run on the tensor cores (empty: they can)."""
    why = []
    if fields.get("dtype") == "e4m3" and fields.get("lazy_rescale"):
        why.append("an e4m3 kernel without lazy_rescale (its lazy softmax weighs each block's sum by V's scale)")
    if fields.get("pin_pv_wait"):
        why.append("pin_pv_wait=0 (the pin stores the threads' row sums)")
    return why


def _row_sums_mma_default(fields: dict[str, Any]) -> bool:
    """row_sums_mma when unset, from a filled forward spec's fields: on for the dtypes of
    ROW_SUMS_MMA_DTYPES up to ROW_SUMS_MMA_MAX_HEAD_DIM_V where the spec allows it and the tile
    of ones fits in shared memory."""
    sizes = [fields.get(f) for f in ("block_m", "block_n", "head_dim", "head_dim_v", "stages", "q_buffers")]
    if (fields.get("dtype", "bf16") not in ROW_SUMS_MMA_DTYPES or _row_sums_mma_blockers(fields)
            or not all(isinstance(x, int) for x in sizes)):
        return False
    bm, bn, d, dv, stages, q_buffers = sizes
    if dv > ROW_SUMS_MMA_MAX_HEAD_DIM_V:
        return False
    return _smem_bytes(str(fields.get("dtype", "bf16")), bm, bn, d, dv, stages, str(fields.get("epilogue")), q_buffers,
                       bool(fields.get("v_transpose_in_kernel")), row_sums_mma=True,
                       staged_bias_bytes=_staged_bias_bytes(fields)) <= SMEM_BUDGET_BYTES


def _kv_factors_in_smem_blockers(fields: dict[str, Any]) -> list[str]:
    """A filled forward spec's fields: why the producer cannot pass its key blocks' factors through
    shared memory (empty: it can)."""
    why = []
    if fields.get("dtype") != "e4m3":
        why.append("dtype='e4m3' (only fp8 kernels have K and V factors)")
    return why


def _kv_multicast_blockers(fields: dict[str, Any]) -> list[str]:
    """A filled spec's fields: why its K and V blocks cannot be multicast across a cluster of two
    CTAs (empty: they can). Both CTAs load the same key blocks in the same order, so every tile of
    a head must visit the same ones, and the producer must load V with TMA as the GEMM reads it."""
    why = []
    if fields.get("scheduler") != "static":
        why.append("scheduler='static' (the cluster's CTAs take tile pairs in a fixed order)")
    per_tile_keys = [name for name in ("causal", "window", "mask_mod", *BUILT_IN_MASKS, "block_sparse", "warpgroup_key_trim")
                     if fields.get(name)]
    if per_tile_keys:
        why.append(f"the same key blocks for every tile of a head (not {', '.join(per_tile_keys)})")
    if fields.get("bias"):
        why.append("no attn_bias (its tile orders follow the bias's broadcast, not query-block pairs)")
    if fields.get("epilogue") == "tma_v":
        why.append("an epilogue other than 'tma_v' (O staged in V's buffers)")
    if fields.get("v_transpose_in_kernel"):
        why.append("V in the kernel's layout (not v_transpose_in_kernel)")
    if fields.get("kv_factors_in_smem"):
        why.append("K/V factors loaded by the consumers (not kv_factors_in_smem)")
    return why


def _kv_factors_in_smem_default(fields: dict[str, Any]) -> bool:
    """kv_factors_in_smem when unset: KV_FACTORS_IN_SMEM_DEFAULT where the spec allows it."""
    return KV_FACTORS_IN_SMEM_DEFAULT and not _kv_factors_in_smem_blockers(fields)


def _sixteen_bit_with_head_dim_v(data: dict[str, Any], min_head_dim_v: int) -> bool:
    """A forward spec's raw fields: 16-bit inputs and head_dim_v >= min_head_dim_v (the lazy
    rescale and the reduction chains pay off only there)."""
    dv = data.get("head_dim_v")
    return data.get("dtype") != "e4m3" and isinstance(dv, int) and dv >= min_head_dim_v


def _bwd_dq_buffers(block_n: int) -> int:
    """fp32 dQ tiles in shared memory: 2 when the warpgroups split the keys, 1 with the head-dim split."""
    return 1 if block_n == WGMMA_M else 2


def _bwd_smem_bytes(dtype: str, block_m: int, block_n: int, head_dim: int, head_dim_v: int, stages: int) -> int:
    """Backward shared memory: K and V of the CTA's key block, `stages` query blocks of Q, dO, LSE
    and D, two dS tiles (dQ of one step reads one while the next step writes the other), two P
    tiles when the warpgroups split the head dim (block_n 64), and the fp32 dQ tiles on their way
    to the accumulator (two when the warpgroups split the keys, so the consumers write one while
    the writer warp reads out the other; one when the head-dim split needs the room for P)."""
    e = _bytes_per_element(dtype)
    kv = block_n * (head_dim + head_dim_v) * e
    q_do = stages * block_m * (head_dim + head_dim_v) * e + stages * block_m * 2 * 4
    ds = 2 * block_m * block_n * e
    p = ds if block_n == WGMMA_M else 0
    dq = _bwd_dq_buffers(block_n) * block_m * head_dim * 4
    return kv + q_do + ds + p + dq + BARRIER_SMEM_BYTES


def _smem_bytes(dtype: str, block_m: int, block_n: int, head_dim: int, head_dim_v: int, stages: int,
                epilogue: str, q_buffers: int = 1, v_transpose_in_kernel: bool = False,
                row_sums_mma: bool = False, staged_bias_bytes: int = 0) -> int:
    """Shared memory of one CTA: the Q buffers, the K/V stages (and V's stages as loaded, before
    the in-kernel transpose), the O staging tile (TMA epilogue; "tma_v" stages O in the V stages'
    buffer instead), the tile of ones of the row sums on the tensor cores, the staged bias tile
    (bias_staging), barriers."""
    e = _bytes_per_element(dtype)
    q = q_buffers * block_m * head_dim * e
    kv = stages * block_n * (head_dim + head_dim_v * (2 if v_transpose_in_kernel else 1)) * e
    o = _o_tile_bytes(block_m, head_dim_v) if epilogue == "tma" else 0
    ones = -(-ROW_SUMS_MMA_N * block_n * e // 1024) * 1024 if row_sums_mma else 0  # 1024-byte aligned
    return q + kv + o + ones + staged_bias_bytes + BARRIER_SMEM_BYTES


def _staged_bias_bytes(fields: dict[str, Any]) -> int:
    """The bias tile of bias_staging, rows padded by 16 bytes (a spec's raw or filled fields; 0
    without it or before the tile is known)."""
    bm, bn = fields.get("block_m"), fields.get("block_n")
    if not fields.get("bias_staging") or not isinstance(bm, int) or not isinstance(bn, int):
        return 0
    return bm * (bn * BIAS_BYTES[str(fields.get("bias_dtype", "float32"))] + 16)


def _o_tile_bytes(block_m: int, head_dim_v: int) -> int:
    return block_m * head_dim_v * 2  # O is 16-bit for every input dtype


def _o_fits_in_v(dtype: str, block_m: int, block_n: int, head_dim_v: int, stages: int) -> bool:
    """The O tile fits in the V stages' buffer (epilogue "tma_v")."""
    return _o_tile_bytes(block_m, head_dim_v) <= stages * block_n * head_dim_v * _bytes_per_element(dtype)


class KernelSpec(BaseModel):
    """One attention kernel: shapes of its tiles, its pipeline and its schedule.

    kind="fwd" is the forward pass. kind="bwd" is the backward pass (dQ, dK, dV) of the forward
    kernel with the same head dims, dtype and mask: each CTA owns block_n keys of one kv head (64
    per consumer warpgroup for head dims up to 128; 64 shared by both, which split the head dim,
    for 192 and 256, or when block_n=64 is asked for) and walks the query blocks (block_m = 64 rows) of every query head of
    its GQA group, so dK and dV stay in registers and need no reduction; dQ is accumulated in fp32
    scratch. deterministic=True orders those dQ additions (bit-identical gradients run to run).
    The forward-only switches (pingpong, intra_wg_overlap, epilogue, ...) do not apply to it;
    scheduler may be "grid" (one CTA per key block) or "lpt" (persistent CTAs claiming key blocks).

    Fields left as None are filled with the per-head-dim defaults, so two specs that mean the
    same kernel compare, serialize and hash the same.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["fwd", "bwd"] = "fwd"
    deterministic: bool = False
    # Backward, causal: key blocks run longest first within groups of this many (batch, kv head)
    # pairs. None: BWD_CAUSAL_GROUP_DEFAULT for backward specs; forward specs leave it unset.
    causal_group: int | None = Field(default=None, ge=1, le=1024)
    # Backward with the keys split: each consumer warpgroup keeps its 64 keys of K and V in registers
    # for the whole key block, as the A operands of every step's Sᵀ and dPᵀ (register-sourced
    # WGMMA), instead of reading them from shared memory at every step. Forward specs leave it unset.
    kv_registers: bool | None = None
    # Backward with the keys split: each step's dQ = dS·K is issued in the next step, after its
    # probabilities, so it runs on the tensor cores beside that step's dPᵀ and dV instead of after
    # the step's own dK, where both warpgroups would wait for it. Forward specs leave it unset.
    dq_deferred: bool | None = None
    # Backward with the keys split: each step's dQ GEMM runs in one consumer warpgroup over the
    # whole head dim (N = head_dim), the two warpgroups taking turns by step, instead of both
    # splitting the head dim. dS and K then cross shared memory once per step (the split reads all of dS in
    # each warpgroup), and the warpgroup without the step's dQ only signals that its dS is written
    # instead of waiting for the other's. Forward specs leave it unset.
    dq_single_warpgroup: bool | None = None
    # Backward: registers per thread of the producer warpgroup (its load thread and dQ writer warp),
    # out of BWD_PRODUCER_REGISTERS; the consumer warpgroups get the rest (40 -> 232, 24 -> 240).
    # None: 24 where each step's dQ runs in one warpgroup at the step's end at hdim 128
    # (BWD_PRODUCER_REGISTERS_DQ_SINGLE_HEAD_DIMS), else 40. Forward: unset (REGISTER_SPLIT), or
    # with three or four consumer warpgroups one of FWD_PRODUCER_REGISTERS.
    producer_registers: int | None = None
    # Backward with persistent CTAs (scheduler "lpt"): the producer prefetches the key block it
    # claims next into L2 (K and V), while the consumers run the current one's last steps, so
    # its loads after them hit L2 instead of HBM. None: on for the persistent hdim 128 kernels
    # with the keys split (BWD_KV_PREFETCH_HEAD_DIMS). Forward specs leave it unset.
    kv_prefetch: bool | None = None
    head_dim: Literal[64, 96, 128, 192, 256]
    head_dim_v: int | None = None
    # Inputs' element type. "e4m3": Q, K, V in float8_e4m3fn with descaling factors (fa3gen.fp8),
    # both GEMMs in fp8 with fp32 accumulation, O in out_dtype; forward only.
    dtype: Literal["fp16", "bf16", "e4m3"] = "bf16"
    # O's element type: the input dtype for fp16/bf16 (None fills it), bf16 or fp16 for e4m3.
    out_dtype: Literal["fp16", "bf16"] | None = None
    causal: bool = False
    block_m: int | None = None
    block_n: int | None = None
    stages: int | None = None
    # Q tiles in shared memory: 2 lets the producer load the next tile's Q while this tile still
    # reads its own, so a short tile does not wait for Q from HBM; 3 lets it go out a whole tile
    # ahead with Q in shared memory (loads_q_a_tile_ahead). None: 2 where it fits beside K, V and
    # the epilogue's buffer, else 1.
    q_buffers: int | None = None
    num_consumer_warpgroups: int | None = None
    # Consumer warpgroups take turns issuing their GEMMs (named barriers). None: on for fp8 with two
    # consumer warpgroups, and for 16-bit ones that chain tiles and have no custom score_mod or
    # mask_mod (PINGPONG_DEFAULT).
    pingpong: bool | None = None
    # On by default: measured on the H200 (2026-11-29, bf16, 16k tokens) it lifts hdim 128 at 8k from
    # 574 to 614 TFLOP/s and helps every head dim; pingpong alone did not pay (549). None: on, except
    # with three consumer warpgroups from head_dim_v 128 (INTRA_WG_OVERLAP_MAX_HEAD_DIM_V_3WG).
    intra_wg_overlap: bool | None = None
    # Q as the A operand of Q·Kᵀ from registers: each consumer warpgroup loads its 64 rows once per
    # tile (ldmatrix), so each key block's Q·Kᵀ reads only K from shared memory. 16-bit forward
    # kernels only. None: on for causal kernels of Q_REGISTERS_CAUSAL_HEAD_DIMS.
    q_registers: bool | None = None
    # How many of a thread's two softmax rows finish (their exp2 and sum) before each key block's
    # wait for the previous block's P·V: the kernel stores their row sums to shared memory before
    # the wait (pin_before_wait), and ptxas keeps the wait after that store. 0: no pin, ptxas
    # places the wait (often above the whole softmax, which then runs after that GEMM rather than
    # under it). Needs intra_wg_overlap. None: _pin_pv_wait_default.
    pin_pv_wait: int | None = Field(default=None, ge=0, le=2)
    # Each consumer warpgroup visits only the key blocks its own 64 rows can see: the tile's last
    # blocks past its rows' right edge (causal, or a window's right side) are waited for and
    # released without their GEMMs, and a block is masked only where it crosses the warpgroup's
    # own edges. A warpgroup whose rows all lie past seqlen_q (in the last tile of a head, when
    # block_m does not divide seqlen_q) keeps one block only, causal or not. The producer still
    # loads the tile's blocks for the warpgroups that see them. None: _warpgroup_key_trim_default
    # (WARPGROUP_KEY_TRIM_HEAD_DIMS).
    warpgroup_key_trim: bool | None = None
    # A consumer warpgroup whose rows see none of the second half of the first key block a tile
    # visits (the diagonal's block when causal, with sq == sk warpgroup 0's of every 128-row tile)
    # computes that block's Q·Kᵀ and softmax over its first half only, with a WGMMA half as wide;
    # P's other half is zero, so the P·V that follows is unchanged. Needs a right key bound, 16-bit
    # inputs and intra_wg_overlap. None: _narrow_edge_block_default.
    narrow_edge_block: bool | None = None
    # Inter-tile overlap: a tile's last P·V runs beside the next tile's first Q·Kᵀ, whose softmax
    # runs before this tile's epilogue, so short tiles do not leave the tensor cores idle at their
    # ends. Needs intra_wg_overlap, a persistent scheduler and two Q buffers.
    # None: on wherever those hold (INTER_TILE_OVERLAP_DEFAULT).
    inter_tile_overlap: bool | None = None
    # Programmatic dependent launch: the kernel launches while the previous kernel in the stream
    # still runs; its CTAs initialize their barriers and prefetch descriptors, then wait for that
    # kernel to complete before touching global memory. None: PROGRAMMATIC_LAUNCH_DEFAULT.
    programmatic_launch: bool | None = None
    # Lazy rescale: a key block raises a row's running max (and multiplies O's rows by the
    # correction) only when the max grows by more than a factor 256 in probability, checked per
    # warp; the exact result is kept because O and the row sums share the stale max. Saves the
    # O multiply of most key blocks. e4m3: P's own factor drops to 2^(8 - FP8_LAZY_RESCALE_LOG2)
    # and the max may grow by 2^FP8_LAZY_RESCALE_LOG2; O keeps one V scale as its unit while the
    # blocks' scales stay within 2^FP8_UNIT_LOG2_RANGE below it, their ratios going into P.
    # None: on for 16-bit forward kernels with head_dim_v >= 128 (LAZY_RESCALE_DEFAULT) and for
    # e4m3 from head_dim_v 192, windows included (faster there; as accurate as the eager kernel
    # only with V's block scales powers of two, which fa3gen.fp8_ops checks before it picks the
    # kernel: FP8_LAZY_RESCALE_DEFAULT).
    lazy_rescale: bool | None = None
    # e4m3: V arrives as the model holds it, (batch, seqlen_k, nheads_kv, head_dim_v), and warps
    # 1-3 of the producer warpgroup transpose each block in shared memory into the layout the P·V
    # WGMMA reads (keys contiguous, in P's register order), while the consumers run the previous
    # blocks. False: V comes in that layout already (fa3gen.fp8.v_kernel_layout, which
    # fa3gen.fp8.prepare applies). Costs shared memory for V's stages as loaded and producer
    # registers (FP8_TRANSPOSE_REGISTER_SPLIT).
    v_transpose_in_kernel: bool = False
    # Row sums on the tensor cores: each key block's P·V batch also issues P·1, an N = 8 WGMMA over a
    # shared-memory tile of ones, whose accumulator (rescaled with O) holds every row's sum, so the
    # softmax adds no scores up (one FADD a score fewer). The sums are of P as the P·V GEMM reads it
    # (16-bit or e4m3). Not with e4m3 lazy_rescale or pin_pv_wait. None: _row_sums_mma_default.
    row_sums_mma: bool | None = None
    # e4m3: the producer writes each key block's K and V factors (per-block scales) into shared
    # memory beside the block's K, before the arrival that arms the K stage (which releases them
    # to the consumers' wait for K), so the consumers read them there: the overlapped loops
    # instead of loading them from L2 under their GEMMs (per-block scales measured 1.4-8% under
    # one factor per (batch, head), H200 2026-12-03), the serial loop instead of its lanes' loads
    # a block ahead. None: off (KV_FACTORS_IN_SMEM_DEFAULT: no faster, measured).
    kv_factors_in_smem: bool | None = None
    # K and V multicast across a cluster of two CTAs: the cluster's CTAs run adjacent query blocks
    # of one (batch, head) and each loads half of every K and V block with one TMA multicast into
    # both CTAs' shared memory, so each key block leaves L2 once per two query blocks (half the
    # L2-to-SM traffic, and its energy where a kernel runs at the power limit). The persistent grid
    # is as many clusters as fit at once; a head's query blocks are taken in pairs (an odd count's
    # last pair has a tile past seqlen_q that loads and computes but stores nothing). Needs every
    # tile of a head to visit the same key blocks (_kv_multicast_blockers). Off unless set.
    kv_multicast: bool = False
    # Static schedule: the tiles past the last whole wave (num_tiles % CTAs of them) are cut along
    # the keys into equal shares of key blocks, one share per CTA (the grid is every SM), and the
    # CTA that holds a tile's last key block merges the other pieces' partial O, row max and row
    # sum from the forward workspace into its own (stream-K's fix-up), so the last wave leaves no
    # SM idle. The kernel splits only where fa3gen.split_tail.splits, reckoning every tile at the
    # longest one's key blocks (a causal tile's shares past its last block are empty pieces); every
    # tile's blocks must start at the first (_split_tail_blockers). Off unless set (the registry's
    # split twins set it).
    split_tail: bool = False
    # With split_tail, the rule's cost model (fa3gen.split_tail.splits): the least the split must
    # shorten the busiest CTA's key blocks by, in percent, with a piece's own pipeline start and
    # merge counted as split_tail_piece_blocks key blocks on its share. The defaults (12%, 4 blocks)
    # are the rule measured on problems of a wave or two; a kernel of long tiles whose last partial
    # wave idles SMs for a whole tile may split for less.
    split_tail_min_saving_percent: int = Field(default=SPLIT_TAIL_MIN_SAVING_PERCENT, ge=0, le=99)
    split_tail_piece_blocks: int = Field(default=SPLIT_TAIL_PIECE_BLOCKS, ge=0, le=64)
    # e4m3: S = Q·Kᵀ accumulates in fp16, and the softmax's row max and exp2 argument run on fp16
    # pairs (HMNMX2, HFMA2: one instruction for two scores where fp32 takes two), the exp2 as fp16
    # and P cast to e4m3 from fp16 pairs. The fp8 key-block loop is bound by its issue slots and
    # the MUFU, not by the GEMMs (BENCHMARKS.md, the ncu note of the FP8 sections). Needs Q and K
    # quantized to |x| <= scores_f16_qk_max(head_dim) (16; 15 at hdim 256), so |S| stays finite
    # in fp16 (fa3gen.fp8.prepare does by default; fa3gen.fp8_ops runs such a kernel only on
    # inputs that say so, and for others the registry's kernel with fp32 scores), the row sums on
    # the tensor cores and the eager rescale (_scores_f16_blockers). Off unless set (the registry
    # sets it for its hdim 64 serial loop, its hdim 128 kernels by query length and hdim 256 at
    # every length not causal, past 2k queries causal).
    scores_f16: bool = False
    # With scores_f16: every n-th pair of a row's scores takes its exp2 from a degree-2 polynomial
    # on the FMA pipe (nine instructions a pair) instead of the MUFU (two ops a pair), which the
    # fp8 loop keeps as busy as the tensor cores. 0: all on the MUFU.
    exp2_poly_every: int = Field(default=0, ge=0, le=64)
    # Block sparsity for a mask_mod: before the first launch for a problem (shapes and param
    # values), a generated kernel classifies each (query block, key block) pair as empty, partial or
    # full, reduced per tile to the blocks it visits and the longest run of full ones: a forward
    # tile's key blocks, a backward tile's query blocks (of every query head of its kv head). The
    # kernel visits only that range and evaluates the mask_mod only outside the full run. The
    # ranges are cached per problem (fa3gen.block_sparsity) and travel in the last tensor param slot
    # (BLOCK_RANGES_SLOT). A forward's backward_spec() keeps it. None: _block_sparse_default.
    block_sparse: bool | None = None
    # Independent accumulator chains per row in the softmax's max and sum over a key block (the
    # columns split round-robin, the chains combined at the end): more instruction-level
    # parallelism for the two consumer warps a scheduler runs, whose dependent FMNMX/FADD chains
    # otherwise stall on fixed latency. None: ROW_REDUCE_CHAINS_DEFAULT for 16-bit forward kernels
    # with head_dim_v >= ROW_REDUCE_CHAINS_MIN_HEAD_DIM_V, else 1.
    row_reduce_chains: int | None = Field(default=None, ge=1, le=8)
    # How tiles map to CTAs: "grid" one CTA per tile; "static" a persistent grid (one CTA per SM)
    # walking tiles in a fixed stride; "lpt" persistent, claiming tiles dynamically from a global
    # counter, longest first. None: "static" when not causal (tiles are equal), "lpt" when causal
    # or block_sparse (tiles of unequal ranges).
    # Backward ("grid" or "lpt"): a tile is one key block; "lpt" claims them in the launch order
    # (causal: longest first), so one key block's dK/dV stores overlap the next one's loads.
    scheduler: Literal["grid", "static", "lpt"] | None = None
    # How O leaves the kernel: "tma" stages the tile in shared memory and writes it with one TMA
    # store that runs on while the next tile computes; "tma_v" stages it in the V stages' buffer
    # instead (no shared memory of its own): the producer issues the store and holds the next
    # tile's V loads until the store has read it; "direct" stores from registers and needs no
    # shared memory. None: "tma" where its buffer fits beside Q, K and V, else "tma_v" where O fits
    # in the V stages and the spec has no variants (O_IN_V_DEFAULT), else "direct".
    epilogue: Literal["tma", "tma_v", "direct"] | None = None
    # Attention variants compiled into the kernel. The built-ins take their sizes per call:
    # window: local attention, query i sees keys [i + sk - sq - left, i + sk - sq + right];
    # softcap: score = cap * tanh(score / cap); alibi: score -= slope[b, h] * |i + sk - sq - j|.
    # bias: score += attn_bias[b, h, i, j] (BUILT_IN_BIAS).
    # score_mod / mask_mod: C++ expressions over params (fa3gen.variant). Scores seen by the mods
    # are already scaled by softmax_scale; order: softcap, alibi, bias, score_mod, then the masks.
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    bias: bool = False
    # The element type of attn_bias: float32, or 16 bits as a bf16/fp16 model holds it (half the
    # bytes a kernel reads; torch SDPA's attn_mask takes q's dtype). Values are added in fp32.
    bias_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Forward with bias: each consumer warpgroup copies its rows of a key block's bias into shared
    # memory (16-byte cp.async, a warp's copy contiguous) under the block's GEMMs and reads its
    # entries from there, instead of loading them in the accumulator's layout (8 rows per warp
    # load). Costs a block_m x block_n tile of shared memory (the defaults then give up the O
    # staging tile or a Q buffer where it does not fit).
    bias_staging: bool = False
    # Backward with bias: also d(loss)/d(attn_bias), added into the tensor param attn_bias_grad.
    bias_grad: bool = False
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    params: tuple[Param, ...] = ()
    # Built-in masks (BUILT_IN_MASKS), values per call: documents (document_ids), prefix_lm
    # (prefix_lengths). They turn block_sparse on by default (their blocks depend on the values).
    documents: bool = False
    prefix_lm: bool = False

    @field_validator("head_dim_v")
    @classmethod
    def _head_dim_v_supported(cls, v: int | None) -> int | None:
        if v is not None and v not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim_v={v} is not supported; choose one of {SUPPORTED_HEAD_DIMS}")
        return v

    @field_validator("stages")
    @classmethod
    def _stages_in_range(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 4:
            raise ValueError(f"stages={v} must be between 1 and 4 (K/V pipeline depth)")
        return v

    @field_validator("q_buffers")
    @classmethod
    def _q_buffers_in_range(cls, v: int | None) -> int | None:
        if v is not None and v not in (1, 2, 3):
            raise ValueError(f"q_buffers={v} must be 1, 2 or 3 (Q tiles in shared memory)")
        return v

    @field_validator("num_consumer_warpgroups")
    @classmethod
    def _consumer_warpgroups_in_range(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v not in REGISTER_SPLIT:
            raise ValueError(
                f"num_consumer_warpgroups={v} must be 2, 3 or 4 (block_m 128, 192 or 256); "
                "one consumer warpgroup is not supported yet"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        d = data.get("head_dim")
        causal = bool(data.get("causal", False))
        if data.get("out_dtype") is None:
            dtype = data.get("dtype", "bf16")
            data["out_dtype"] = "bf16" if dtype == "e4m3" else dtype
        if data.get("kind") == "bwd":
            return cls._fill_bwd_defaults(data)
        bm = data.get("block_m")
        if isinstance(bm, int) and bm not in _BLOCK_M_CHOICES:
            # Here, not after the defaults: num_consumer_warpgroups, derived from block_m, would
            # fail first and name a field the user did not set.
            raise ValueError(f"block_m={bm!r} must be one of {', '.join(map(str, _BLOCK_M_CHOICES))}: each consumer "
                             f"warpgroup owns {WGMMA_M} query rows (one WGMMA M), and a forward kernel has "
                             f"{min(REGISTER_SPLIT)} to {max(REGISTER_SPLIT)} of them")
        if d in SUPPORTED_HEAD_DIMS:
            fp8 = data.get("dtype") == "e4m3"
            bm, bn = FP8_TILES.get(d, (128, 128)) if fp8 else _DEFAULT_TILES[(d, causal)]  # fp8 96: refused below
            if data.get("head_dim_v") is None:
                data["head_dim_v"] = d
            if data.get("block_m") is None:
                nwg = data.get("num_consumer_warpgroups")
                # Per-element variant code (ALiBi, score_mod, mask_mod) needs the registers of two
                # consumer warpgroups (232 each): with three (160 each) hdim 64 spilled 124-176 B.
                per_element = data.get("alibi") or _has_unmeasured_code(data)
                if per_element and bm > 2 * WGMMA_M and not isinstance(nwg, int):
                    bm = 2 * WGMMA_M
                data["block_m"] = WGMMA_M * nwg if isinstance(nwg, int) else bm
            if data.get("block_n") is None:
                data["block_n"] = bn
        if data.get("stages") is None:
            data["stages"] = 2
        if data.get("scheduler") is None:
            # Causal tiles differ in length, and so do a block-sparse mask's (their ranges): lpt
            # claims them dynamically, the last query blocks first. A block-sparse prefix-LM mask_mod
            # measured 2.635 -> 1.953 ms at s16k, 0.590 -> 0.569 at s4k (H200, 2026-12-05; hdim 128).
            sparse = data.get("block_sparse")
            sparse = _block_sparse_default(data) if sparse is None else sparse
            data["scheduler"] = "lpt" if causal or sparse else "static"
        if data.get("num_consumer_warpgroups") is None and isinstance(data.get("block_m"), int):
            data["num_consumer_warpgroups"] = data["block_m"] // WGMMA_M  # one of _BLOCK_M_CHOICES (checked above)
        if data.get("intra_wg_overlap") is None:
            data["intra_wg_overlap"] = _intra_wg_overlap_default(data)
        sizes = [data.get(f) for f in ("block_m", "block_n", "head_dim_v", "stages")]
        vtk = {"v_transpose_in_kernel": bool(data.get("v_transpose_in_kernel")),
               "staged_bias_bytes": _staged_bias_bytes(data)}
        if data.get("epilogue") is None and d in SUPPORTED_HEAD_DIMS and all(isinstance(x, int) for x in sizes):
            dtype = str(data.get("dtype", "bf16"))
            if FP8_CHAINED_OVER_O_TILE and dtype == "e4m3" and not causal and not data.get("window") \
                    and data.get("q_buffers") in (None, 2) \
                    and _smem_bytes(dtype, *sizes[:2], d, *sizes[2:], "tma", 2, **vtk) > SMEM_BUDGET_BYTES \
                    and _smem_bytes(dtype, *sizes[:2], d, *sizes[2:], "direct", 2, **vtk) <= SMEM_BUDGET_BYTES:
                data["epilogue"] = "direct"
            elif _smem_bytes(dtype, *sizes[:2], d, *sizes[2:], "tma", **vtk) <= SMEM_BUDGET_BYTES:
                data["epilogue"] = "tma"
            elif O_IN_V_DEFAULT and _o_fits_in_v(dtype, sizes[0], sizes[1], sizes[2], sizes[3]) \
                    and not _has_variant(data) and not vtk["v_transpose_in_kernel"]:
                data["epilogue"] = "tma_v"
            else:
                data["epilogue"] = "direct"
        if data.get("q_buffers") is None and d in SUPPORTED_HEAD_DIMS \
                and all(isinstance(x, int) for x in sizes) and data.get("epilogue") in ("tma", "tma_v", "direct"):
            two = _smem_bytes(str(data.get("dtype", "bf16")), *sizes[:2], d, *sizes[2:], data["epilogue"], 2, **vtk)
            data["q_buffers"] = 2 if two <= SMEM_BUDGET_BYTES else 1
        chained = not _inter_tile_overlap_missing(
            data.get("intra_wg_overlap", True), data.get("scheduler"), data.get("q_buffers"), data.get("epilogue"))
        if data.get("inter_tile_overlap") is None:
            data["inter_tile_overlap"] = INTER_TILE_OVERLAP_DEFAULT and chained
        if data.get("lazy_rescale") is None:
            data["lazy_rescale"] = _lazy_rescale_default(data)
        if data.get("programmatic_launch") is None:
            data["programmatic_launch"] = PROGRAMMATIC_LAUNCH_DEFAULT
        if data.get("q_registers") is None:
            data["q_registers"] = _q_registers_default(data)
        if data.get("pin_pv_wait") is None:
            data["pin_pv_wait"] = _pin_pv_wait_default(data)
        if data.get("row_reduce_chains") is None:
            wide = _sixteen_bit_with_head_dim_v(data, ROW_REDUCE_CHAINS_MIN_HEAD_DIM_V)
            data["row_reduce_chains"] = ROW_REDUCE_CHAINS_DEFAULT if wide else 1
        if data.get("pingpong") is None:
            # fp8: always with two warpgroups (FP8_TILES); 16-bit: with the chained tiles, and
            # without a custom score_mod or mask_mod (PINGPONG_DEFAULT).
            custom = _has_unmeasured_code(data)
            data["pingpong"] = data.get("num_consumer_warpgroups") == 2 and (
                data.get("dtype") == "e4m3" or (PINGPONG_DEFAULT and chained and not custom))
        if data.get("warpgroup_key_trim") is None:
            data["warpgroup_key_trim"] = _warpgroup_key_trim_default(data)
        if data.get("narrow_edge_block") is None:
            data["narrow_edge_block"] = _narrow_edge_block_default(data)
        if data.get("row_sums_mma") is None:
            data["row_sums_mma"] = _row_sums_mma_default(data)
        if data.get("kv_factors_in_smem") is None:
            data["kv_factors_in_smem"] = _kv_factors_in_smem_default(data)
        if data.get("block_sparse") is None:
            data["block_sparse"] = _block_sparse_default(data)
        return data

    @classmethod
    def _fill_bwd_defaults(cls, data: dict[str, Any]) -> dict[str, Any]:
        d = data.get("head_dim")
        if data.get("head_dim_v") is None:
            data["head_dim_v"] = d
        if data.get("num_consumer_warpgroups") is None:
            data["num_consumer_warpgroups"] = 2
        nwg = data["num_consumer_warpgroups"]
        if data.get("block_n") is None:
            wide = isinstance(d, int) and d > BWD_MAX_KEYS_SPLIT_HEAD_DIM
            data["block_n"] = WGMMA_M if wide else WGMMA_M * (nwg if isinstance(nwg, int) else 2)
        persistent = _bwd_keys_split(data) or (d in BWD_PERSISTENT_SPLIT_HEAD_DIMS and data["block_n"] == WGMMA_M)
        scheduler = "lpt" if BWD_PERSISTENT_DEFAULT and persistent else "grid"
        for field, default in (("block_m", BWD_BLOCK_M), ("causal_group", BWD_CAUSAL_GROUP_DEFAULT),
                               ("intra_wg_overlap", False), ("q_buffers", 1),
                               ("inter_tile_overlap", False), ("programmatic_launch", False),
                               ("lazy_rescale", False), ("row_reduce_chains", 1), ("pingpong", False),
                               ("scheduler", scheduler), ("epilogue", "direct"),
                               ("kv_registers", _bwd_kv_registers_default(data)),
                               ("dq_deferred", _bwd_dq_deferred_default(data)),
                               ("block_sparse", _block_sparse_default(data))):
            if data.get(field) is None:
                data[field] = default
        # In order, each default from the fields filled before it (dq_deferred and the scheduler above).
        for field, default_of in (("dq_single_warpgroup", _bwd_dq_single_warpgroup_default),
                                  ("producer_registers", _bwd_producer_registers_default),
                                  ("kv_prefetch", _bwd_kv_prefetch_default)):
            if data.get(field) is None:
                data[field] = default_of(data)
        if data.get("stages") is None:  # two when they fit (d256 fits one beside its fp32 dQ tile), three with kv_registers
            sizes = (data.get("block_m"), data.get("block_n"), d, data.get("head_dim_v"))

            def fits(stages: int) -> bool:  # sizes that are not ints are reported by their own fields
                return not all(isinstance(x, int) for x in sizes) or _bwd_smem_bytes(
                    str(data.get("dtype", "bf16")), *sizes, stages) <= SMEM_BUDGET_BYTES  # type: ignore[arg-type]

            wanted = BWD_KV_REGISTERS_STAGES if data["kv_registers"] is True else 2
            data["stages"] = next((n for n in range(wanted, 0, -1) if fits(n)), 1)
        return data

    def _check_fp8(self) -> None:
        if self.head_dim not in FP8_TILES or self.head_dim_v not in FP8_TILES:
            raise ValueError(f"dtype='e4m3' supports head dims {tuple(FP8_TILES)}, got head_dim={self.head_dim}, "
                             f"head_dim_v={self.head_dim_v}")
        if self.kind == "bwd":
            raise ValueError("dtype='e4m3' is forward-only: there is no FP8 backward kernel (train in bf16/fp16)")
        unsupported = [name for name, on in (("softcap", self.softcap), ("alibi", self.alibi), ("bias", self.bias),
                                             ("score_mod", self.score_mod is not None),
                                             ("mask_mod", self.mask_mod is not None),
                                             *((name, getattr(self, name)) for name in BUILT_IN_MASKS)) if on]
        if unsupported:
            raise ValueError(f"dtype='e4m3' supports causal and window masks only, not {', '.join(unsupported)}")
        assert self.block_n is not None
        if self.block_n % WGMMA_K_FP8 != 0:
            raise ValueError(f"dtype='e4m3' needs block_n to be a multiple of {WGMMA_K_FP8} (the K of an fp8 P·V "
                             f"WGMMA), got {self.block_n}")
        if self.v_transpose_in_kernel and self.epilogue == "tma_v":
            raise ValueError("v_transpose_in_kernel does not combine with epilogue='tma_v' (O staged in the V "
                             "stages, which the transposers write): use 'tma' or 'direct'")

    def _check_inter_tile_overlap(self) -> None:
        missing = _inter_tile_overlap_missing(self.intra_wg_overlap, self.scheduler, self.q_buffers, self.epilogue)
        if missing:
            raise ValueError(f"inter_tile_overlap needs {', '.join(missing)}")

    def _split_tail_blockers(self) -> list[str]:
        """Why split_tail cannot apply to this forward spec (empty: it can)."""
        why = []
        if self.scheduler != "static":
            why.append('scheduler="static" (the pieces are fixed shares of the last wave\'s key blocks)')
        if self.keys_bounded_left or self.block_sparse:
            why.append("every tile's key blocks to start at the first: no window or block_sparse (causal tiles "
                       "end early, so their shares past the end are empty pieces)")
        if self.kv_multicast:
            why.append("kv_multicast=False (a cluster's two CTAs load the same key blocks)")
        return why

    def _scores_f16_blockers(self) -> list[str]:
        """Why scores_f16 cannot apply to this forward spec (empty: it can)."""
        why = []
        if not self.is_fp8:
            why.append('dtype="e4m3" (16-bit inputs\' scores need fp32: their products are not bounded)')
        if self.lazy_rescale or not self.row_sums_mma:
            why.append("lazy_rescale=False and row_sums_mma=True (the row sums of fp16 P on the tensor cores, "
                       "in fp32)")
        return why

    def _check_narrow_edge_block(self) -> None:
        why = []
        if not self.keys_bounded_right:
            why.append("causal=True or window=True (without either no warpgroup's rows end inside a key block)")
        if self.is_fp8:
            why.append("16-bit inputs (an e4m3 P is laid out for the P·V GEMM across the whole block)")
        if not self.intra_wg_overlap:
            why.append("intra_wg_overlap=True (the narrow block is the overlapped mainloop's peeled first step)")
        if why:
            raise ValueError("narrow_edge_block needs " + "; ".join(why))

    def _check_block_sparse(self) -> None:
        if self.mask_expr is None:
            raise ValueError("block_sparse classifies key blocks by the spec's mask_mod: it needs one (causal and "
                             "window kernels skip their hidden blocks without it)")
        tensors = sum(isinstance(p, TensorParam) for p in self.variant_params)
        if tensors > BLOCK_RANGES_SLOT:
            raise ValueError(f"block_sparse takes the last of the {BLOCK_RANGES_SLOT + 1} tensor param slots for its "
                             f"block ranges: at most {BLOCK_RANGES_SLOT} tensor params (the built-in masks' "
                             f"included), got {tensors}")

    def _check_o_in_v(self) -> None:
        assert self.block_m and self.block_n and self.head_dim_v and self.stages
        if not _o_fits_in_v(self.dtype, self.block_m, self.block_n, self.head_dim_v, self.stages):
            raise ValueError(f"epilogue='tma_v' stages O ({self.block_m}x{self.head_dim_v}, 16-bit) in the V stages' "
                             f"buffer ({self.stages}x{self.block_n}x{self.head_dim_v}), which is smaller: "
                             "use epilogue='tma' or 'direct', or more stages or a larger block_n")

    def _check_bwd(self) -> None:
        bm, bn, d, dv, nwg = self.block_m, self.block_n, self.head_dim, self.head_dim_v, self.num_consumer_warpgroups
        if dv != d:
            raise ValueError(f"backward kernels need head_dim_v == head_dim, got {dv} and {d}")
        if nwg != 2:
            raise ValueError(f"backward kernels need num_consumer_warpgroups=2, got {nwg}")
        if bn not in (WGMMA_M, WGMMA_M * nwg):
            raise ValueError(f"backward block_n={bn} must be {WGMMA_M * nwg} (each consumer warpgroup owns 64 keys) "
                             f"or {WGMMA_M} (the warpgroups share 64 keys and split the head dim)")
        if bn != WGMMA_M and d > BWD_MAX_KEYS_SPLIT_HEAD_DIM:
            raise ValueError(f"backward head_dim {d} needs block_n={WGMMA_M}: fp32 dK and dV of 64 keys x {d} "
                             f"per warpgroup do not fit in registers beside the other accumulators")
        if bm != BWD_BLOCK_M:
            raise ValueError(f"backward block_m={bm} must be {BWD_BLOCK_M} (the M of the dQ WGMMA)")
        fwd_only = [name for name, on in (("pingpong", self.pingpong), ("intra_wg_overlap", self.intra_wg_overlap),
                                          ("inter_tile_overlap", self.inter_tile_overlap),
                                          ("programmatic_launch", self.programmatic_launch),
                                          ("lazy_rescale", self.lazy_rescale),
                                          ("row_reduce_chains", self.row_reduce_chains != 1),
                                          ("epilogue", self.epilogue != "direct"),
                                          ("q_buffers", self.q_buffers != 1),
                                          ("kv_multicast", self.kv_multicast),
                                          ("split_tail", self.split_tail),
                                          ("scores_f16", self.scores_f16),
                                          ("exp2_poly_every", self.exp2_poly_every)) if on]
        if fwd_only:
            raise ValueError(f"{', '.join(fwd_only)} apply to forward kernels only; leave them unset for kind='bwd'")
        if not self.causal and self.causal_group != BWD_CAUSAL_GROUP_DEFAULT:
            raise ValueError(f"causal_group={self.causal_group} orders a causal backward's key blocks; this spec is "
                             "not causal (its key blocks run in order): leave it unset")
        for name in ("q_registers", "pin_pv_wait", "warpgroup_key_trim", "narrow_edge_block", "row_sums_mma",
                     "kv_factors_in_smem"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} applies to forward kernels; leave it unset for kind='bwd'")
        # The step layouts these fields change exist only with the keys split: why not otherwise.
        keys_split_only = {"kv_registers": "both read the same keys",
                           "dq_deferred": "dK's GEMM already waits for both warpgroups' dS",
                           "dq_single_warpgroup": "each warpgroup's dK GEMM already reads both warpgroups' dS"}
        for name, why in keys_split_only.items():
            if getattr(self, name) and self.bwd_splits_head_dim:
                raise ValueError(f"{name} needs each consumer warpgroup to own 64 keys (block_n=128): with the head "
                                 f"dim split {why}")
        if self.producer_registers not in BWD_PRODUCER_REGISTERS:
            raise ValueError(f"producer_registers={self.producer_registers} must be one of {BWD_PRODUCER_REGISTERS}: "
                             f"the consumer warpgroups get the rest of the launch's {self.register_pool} registers "
                             "per CTA, in multiples of 8")
        if self.kv_prefetch and self.scheduler != "lpt":
            raise ValueError("kv_prefetch prefetches the key block a persistent CTA claims next: it needs "
                             "scheduler='lpt' (with 'grid' each CTA runs one key block)")
        if self.scheduler == "static":
            raise ValueError("backward scheduler='static' is not available: use 'grid' (one CTA per key block) or "
                             "'lpt' (persistent CTAs claiming key blocks in order)")
        if self.score_mod is not None and self.score_mod.grad is None:
            raise ValueError(f"a backward kernel with score_mod {self.score_mod.expr!r} needs score_mod.grad, its "
                             "derivative d(score_mod)/d(score) as an expression of the same names "
                             "(e.g. '1' for an additive bias)")
        if self.block_sparse:
            self._check_block_sparse()
            if self.deterministic:
                raise ValueError("deterministic adds a query block's dQ in the order of the key blocks of its band; "
                                 "with block_sparse a key block may skip it: use block_sparse=False")
        if self.smem_bytes > SMEM_BUDGET_BYTES:
            raise ValueError(f"backward shared memory {self.smem_bytes} B exceeds the {SMEM_BUDGET_BYTES} B budget "
                             f"(K, V {bn}x{d}, {self.stages} stages of Q, dO {bm}x{d}, dS): lower stages")

    def _check_expressions(self) -> None:
        if self.prefix_lm and self.causal:
            raise ValueError("prefix_lm is causal after its prefix by itself; leave causal=False (causal would hide "
                             "the prefix's keys right of the diagonal)")
        for name, param in BUILT_IN_TENSORS.items():
            if getattr(self, name) and any(p.name == param.name for p in self.params):
                raise ValueError(f"{name}=True passes its values as the tensor {param.name!r}: a declared param "
                                 "may not take that name")
        check_params(self.variant_params)
        if self.bias_dtype != "float32" and not self.bias:
            raise ValueError(f"bias_dtype={self.bias_dtype!r} is the element type of attn_bias: it needs bias=True")
        if self.bias_staging and not (self.bias and self.kind == "fwd"):
            raise ValueError("bias_staging stages the forward's attn_bias tiles in shared memory: it needs bias=True "
                             "and kind='fwd'")
        if self.bias_grad:
            self._check_bias_grad()
        if self.score_mod is not None:
            check_expression(self.score_mod.expr, "score_mod", self.params, allow_score=True)
            if self.score_mod.grad is not None:
                check_expression(self.score_mod.grad, "score_mod.grad", self.params, allow_score=True)
        if self.mask_mod is not None:
            check_expression(self.mask_mod.expr, "mask_mod", self.params, allow_score=False)
        if self.params and self.score_mod is None and self.mask_mod is None:
            raise ValueError("params are declared but neither score_mod nor mask_mod uses them")

    def _check_bias_grad(self) -> None:
        if self.kind != "bwd" or not self.bias:
            raise ValueError("bias_grad adds d(loss)/d(attn_bias) in a backward kernel: it needs kind='bwd' and "
                             "bias=True (fwd_spec.backward_spec(bias_grad=True))")
        if self.softcap and self.score_mod is not None:
            raise ValueError("bias_grad with both softcap and a score_mod is not available: the bias's derivative "
                             "would need a second per-entry array beside the score's")
        if self.deterministic:
            raise ValueError("bias_grad adds each entry's gradient with float atomics in no fixed order, so it is not "
                             "deterministic: use deterministic=False, or no gradient for attn_bias")

    @model_validator(mode="after")
    def _check_hardware_limits(self) -> KernelSpec:
        self._check_expressions()
        if self.dtype == "e4m3":
            self._check_fp8()
        elif self.out_dtype != self.dtype:
            raise ValueError(f"out_dtype={self.out_dtype!r} differs from dtype={self.dtype!r}: only e4m3 kernels "
                             "write O in another type")
        if self.kind == "bwd":
            self._check_bwd()
            return self
        if self.v_transpose_in_kernel and not self.is_fp8:
            raise ValueError("v_transpose_in_kernel applies to dtype='e4m3' (a 16-bit P·V WGMMA reads V as loaded)")
        if self.deterministic:
            raise ValueError("deterministic applies to backward kernels (kind='bwd'); the forward is deterministic")
        if self.causal_group is not None:
            raise ValueError("causal_group applies to backward kernels (kind='bwd'); the forward's lpt scheduler "
                             "orders its tiles by itself")
        for name in ("kv_registers", "dq_deferred", "dq_single_warpgroup", "kv_prefetch"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} applies to backward kernels (kind='bwd'); leave it unset for the forward")
        allowed = FWD_PRODUCER_REGISTERS.get(self.num_consumer_warpgroups or 0, ())
        if self.producer_registers is not None and self.producer_registers not in allowed:
            raise ValueError(f"producer_registers={self.producer_registers}: a forward spec may set it only with three "
                             f"or four consumer warpgroups, to one of {FWD_PRODUCER_REGISTERS[4]} "
                             "(else leave it unset: REGISTER_SPLIT)")
        bm, bn, d, dv = self.block_m, self.block_n, self.head_dim, self.head_dim_v
        assert bm is not None and bn is not None and dv is not None
        assert self.stages is not None and self.num_consumer_warpgroups is not None
        nwg = self.num_consumer_warpgroups
        if bm != WGMMA_M * nwg:
            raise ValueError(
                f"block_m={bm} must equal 64 * num_consumer_warpgroups ({WGMMA_M * nwg}): "
                "each consumer warpgroup owns 64 query rows (one WGMMA M)"
            )
        if bn % WGMMA_K != 0 or not WGMMA_K <= bn <= 256:
            raise ValueError(
                f"block_n={bn} must be a multiple of {WGMMA_K} in [16, 256]: it is the N of the "
                "Q·Kᵀ WGMMA (≤ 256) and the K of the P·V WGMMA (multiple of 16)"
            )
        if self.pingpong and nwg != 2:
            raise ValueError(f"pingpong needs num_consumer_warpgroups=2, got {nwg}")
        if self.bias_staging and nwg > 3:
            # One named barrier per warpgroup after the epilogue's (ids 2 + nwg ..): CUTLASS's user ids stop at 7.
            raise ValueError(f"bias_staging needs at most three consumer warpgroups (their staged-bias barriers must "
                             f"fit CUTLASS's eight named-barrier ids), got {nwg}")
        if self.inter_tile_overlap:
            self._check_inter_tile_overlap()
        if self.pin_pv_wait and not self.intra_wg_overlap:
            raise ValueError("pin_pv_wait keeps the wait for the previous key block's P·V after softmax rows: it needs "
                             "intra_wg_overlap=True (without it each P·V is waited for as soon as it is issued)")
        if self.narrow_edge_block:
            self._check_narrow_edge_block()
        if self.row_sums_mma and (blockers := _row_sums_mma_blockers(self.model_dump())):
            raise ValueError("row_sums_mma needs " + "; ".join(blockers))
        if self.kv_factors_in_smem and (blockers := _kv_factors_in_smem_blockers(self.model_dump())):
            raise ValueError("kv_factors_in_smem needs " + "; ".join(blockers))
        if self.block_sparse:
            self._check_block_sparse()
        if self.kv_multicast and (blockers := _kv_multicast_blockers(self.model_dump())):
            raise ValueError("kv_multicast needs " + "; ".join(blockers))
        if self.split_tail and (blockers := self._split_tail_blockers()):
            raise ValueError("split_tail needs " + "; ".join(blockers))
        if (self.split_tail_min_saving_percent != SPLIT_TAIL_MIN_SAVING_PERCENT
                or self.split_tail_piece_blocks != SPLIT_TAIL_PIECE_BLOCKS) and not self.split_tail:
            raise ValueError("split_tail_min_saving_percent and split_tail_piece_blocks set when split_tail splits: "
                             "they need split_tail=True")
        if self.scores_f16 and (blockers := self._scores_f16_blockers()):
            raise ValueError("scores_f16 needs " + "; ".join(blockers))
        if self.exp2_poly_every and not self.scores_f16:
            raise ValueError("exp2_poly_every computes fp16 pairs' exp2: it needs scores_f16=True")
        if self.epilogue == "tma_v":
            self._check_o_in_v()
        smem = self.smem_bytes
        if smem > SMEM_BUDGET_BYTES:
            raise ValueError(
                f"shared memory {smem} B exceeds the {SMEM_BUDGET_BYTES} B budget per block "
                f"(Q {self.q_buffers}x{bm}x{d}, K {self.stages}x{bn}x{d}, V {self.stages}x{bn}x{dv}"
                + (f", O {bm}x{dv} for the TMA-store epilogue" if self.epilogue == "tma" else "")
                + (f", the staged {bm}x{bn} bias tile" if self.bias_staging else "")
                + "): lower block_n, block_m, stages or q_buffers" + (", or use epilogue='direct'" if self.epilogue == "tma" else "")
            )
        need, limit = self.consumer_registers_estimate, self.register_split[1]
        if need > limit:
            raise ValueError(
                f"consumer warpgroup needs ~{need} registers per thread (S {self.score_registers} + O {dv // 2} "
                f"+ {CONSUMER_REGISTER_OVERHEAD}) but {nwg} consumer warpgroups get {limit}: "
                "lower block_n or use fewer consumer warpgroups"
            )
        return self

    # ---- derived quantities the templates and the checker share ----

    @property
    def smem_bytes(self) -> int:
        assert self.block_m and self.block_n and self.head_dim_v and self.stages and self.epilogue
        if self.kind == "bwd":
            return _bwd_smem_bytes(self.dtype, self.block_m, self.block_n, self.head_dim, self.head_dim_v, self.stages)
        assert self.q_buffers
        return _smem_bytes(self.dtype, self.block_m, self.block_n, self.head_dim, self.head_dim_v,
                           self.stages, self.epilogue, self.q_buffers, self.v_transpose_in_kernel,
                           bool(self.row_sums_mma), _staged_bias_bytes(dict(self)))  # dict(): fields, no dump

    @property
    def bwd_splits_head_dim(self) -> bool:
        """Backward: the consumer warpgroups share the CTA's 64 keys and split the head dim of dK,
        dV (and the query columns of Sᵀ, dPᵀ), rather than owning 64 keys each."""
        return self.kind == "bwd" and self.block_n == WGMMA_M

    def backward_spec(self, **changes: Any) -> KernelSpec:
        """The spec of this forward kernel's backward: the same problem (head dims, dtype, causal)
        and variants, with the backward's tiles (or `changes`, e.g. deterministic=True). It keeps
        block_sparse, except with deterministic=True (whose dQ order needs every key block of a
        query block's band)."""
        if self.kind != "fwd":
            raise ValueError(f"backward_spec() is the backward of a forward spec; {self.name} is kind={self.kind!r}")
        same = {name: getattr(self, name) for name in _PROBLEM_FIELDS}
        same["block_sparse"] = self.block_sparse and not changes.get("deterministic")
        return KernelSpec(kind="bwd", **{**same, **changes})

    @property
    def bwd_recomputes_softcap_grad(self) -> bool:
        """Backward with soft-capping alone: recover its derivative 1 − tanh² from P and the row's
        LSE at dS time (one more MUFU lg2 per entry) instead of keeping it per entry in registers.
        Chosen where registers are short, the masked keys-split kernels of head dim 128: measured on
        the H200, causal s16k 321 -> 402 TFLOP/s (the per-entry copy spilled 128 B); without a mask
        the extra lg2 costs 5%. ALiBi or a score_mod change the score after the cap: kept there."""
        return (self.kind == "bwd" and self.softcap and not self.alibi and not self.bias and self.score_mod is None
                and (self.causal or self.window) and self.head_dim >= 128 and not self.bwd_splits_head_dim)

    @property
    def bwd_dq_buffers(self) -> int:
        """Backward: fp32 dQ tiles in shared memory between the consumers and the writer warp."""
        return _bwd_dq_buffers(self.block_n)

    @property
    def consumer_registers_estimate(self) -> int:
        assert self.block_n and self.head_dim_v
        # fp32 accumulators of one 64-row warpgroup tile, spread over 128 threads (fp16 scores: two a
        # register); P reuses S's registers.
        return self.score_registers + self.head_dim_v // 2 + CONSUMER_REGISTER_OVERHEAD

    @property
    def score_registers(self) -> int:
        assert self.block_n
        return self.block_n // (4 if self.scores_f16 else 2)

    @property
    def lazy_rescale_log2(self) -> int:
        """The softmax's kLazyRescaleLog2: how far (log2, in probability) a row's max may grow
        before O is rescaled; -1 without lazy_rescale (rescaled every key block)."""
        if not self.lazy_rescale:
            return -1
        return FP8_LAZY_RESCALE_LOG2 if self.is_fp8 else LAZY_RESCALE_LOG2

    @property
    def fp8_unit_log2_range(self) -> int:
        """Fp8LazySoftmax's kUnitLog2Range: how far (log2) below O's V unit a key block's V scale
        may lie before the unit moves to it (and O is rescaled)."""
        return FP8_UNIT_LOG2_RANGE

    @property
    def prob_log2_scale(self) -> int:
        """The softmax's kProbLog2Scale: log2 of P's factor before its cast (fp8 only; 0 at 16 bits)."""
        if not self.is_fp8:
            return 0
        return FP8_PROB_LOG2_SCALE - (FP8_LAZY_RESCALE_LOG2 if self.lazy_rescale else 0)

    @property
    def bias_staged_ahead(self) -> bool:
        """bias_staging with a 16-bit bias: the next key block's bias is copied into the staging
        buffer as soon as this block's entries are added to S, instead of right after that block's
        own GEMMs. H100, b4 h16 s4k hdim 128, bias (1, h, s, s) bf16: 1.410 -> 1.256 ms, causal 0.774
        -> 0.704; with an fp32 bias it lost (1.631 -> 1.674 ms; (b, h, s, s) 1.843 -> 2.000)."""
        return self.bias_staging and self.bias_dtype != "float32"

    @property
    def bwd_bias_prefetch(self) -> bool:
        """Backward with attn_bias read in the probabilities (masked: not bwd_bias_under_gemms), in
        the loop that runs each step's dQ in the step: the next step's bias
        rows are prefetched into L1 under this step's dQ GEMM, so the reads after the GEMMs' wait hit
        L1 (ncu: waits for those reads were the largest stall). H100, b4 h16 s4k hdim 128 causal,
        bias (1, h, s, s): fp32 4.084 -> 3.879 ms, bf16 4.461 -> 4.242. The kernels that load under
        the GEMMs lost with it (fp32 6.251 -> 7.166 ms), and so did the hdim 256 one that splits the
        head dim (b4 h8 s4k causal: fp32 3.137 -> 3.255 ms, bf16 3.328 -> 3.510)."""
        return (self.kind == "bwd" and self.bias and not self.bwd_bias_under_gemms
                and not (self.softcap or self.score_mod)  # their kernels spill 300-400 B: untried
                and not (self.dq_deferred or self.dq_single_warpgroup or self.bwd_splits_head_dim))

    @property
    def bwd_bias_under_gemms(self) -> bool:
        """Backward with attn_bias, unmasked and unmodified: a step's bias entries are loaded right
        after its Sᵀ and dPᵀ GEMMs are issued, and with bias_grad d(bias) is added four adjacent
        keys per vector atomic (attn_bias_grad's rows 16-byte aligned). H100, b4 h16 s4k hdim 128:
        the loads 8.69 -> 7.82 ms (fp32 bias), 9.35 -> 7.92 (bf16); the vector atomics then 7.81 ->
        7.74 and 7.91 -> 7.80 (spills 80 -> 44 B, 84 -> 0 B). Causal the loads spilled 144 B and
        were slower (4.83 -> 4.94 ms); with softcap or a score_mod they spilled 352-564 B."""
        return (self.kind == "bwd" and self.bias and not (self.softcap or self.score_mod)
                and not (self.keys_bounded_right or self.keys_bounded_left))

    @property
    def keys_bounded_right(self) -> bool:
        """A row sees no key past a bound right of its diagonal (causal, or a window's right side):
        the kernels test keys against last_visible_key."""
        return self.causal or self.window

    @property
    def keys_bounded_left(self) -> bool:
        """A row sees no key before a bound left of its diagonal (a window's left side)."""
        return self.window

    @property
    def has_score_mod(self) -> bool:
        """Scores are modified after scaling (softcap, alibi or a custom score_mod)."""
        return self.softcap or self.alibi or self.bias or self.score_mod is not None

    @property
    def variant_params(self) -> tuple[Param, ...]:
        """The declared params, then the tensors of the built-ins that are on (BUILT_IN_TENSORS)."""
        return self.params + tuple(self._built_in_tensor(name, param) for name, param in BUILT_IN_TENSORS.items()
                                   if getattr(self, name))

    def _built_in_tensor(self, name: str, param: TensorParam) -> TensorParam:
        return param.model_copy(update={"dtype": self.bias_dtype}) if name == "bias" else param

    @property
    def bias_element(self) -> str:
        """The C++ element type the kernels read attn_bias as (bias_dtype): CUDA's own 16-bit types,
        whose paired forms (__nv_bfloat162, __half2) the forward loads two keys at a time as."""
        return _BIAS_ELEMENTS[self.bias_dtype]

    def tensor_slot(self, name: str) -> int:
        """The tensor_args slot of the tensor param `name` (declared or built-in)."""
        for param, array, slot in self.param_slots:
            if param.name == name and array == "tensor_args":
                return slot
        raise KeyError(f"{self.name} has no tensor param {name!r}")

    @property
    def mask_expr(self) -> str | None:
        """The kernel's mask expression: the built-in masks' and the mask_mod's, all of which must
        show an element (None: no per-element mask beyond causal and the window)."""
        parts = [expr for name, (_, expr) in BUILT_IN_MASKS.items() if getattr(self, name)]
        parts += [self.mask_mod.expr] if self.mask_mod is not None else []
        if len(parts) <= 1:
            return parts[0] if parts else None
        return " && ".join(f"({part})" for part in parts)

    @property
    def param_slots(self) -> tuple[tuple[Param, str, int], ...]:
        """Each param with where the ABI carries it: the array (float_args, int_args or
        tensor_args) and its slot there, in declaration order."""
        counters: dict[str, int] = {}
        slots = []
        for param in self.variant_params:
            if isinstance(param, ScalarParam):
                array = "float_args" if param.dtype == "float32" else "int_args"
            else:
                array = "tensor_args"
            slots.append((param, array, counters.get(array, 0)))
            counters[array] = counters.get(array, 0) + 1
        return tuple(slots)

    @property
    def block_ranges_per(self) -> tuple[bool, bool]:
        """Whether a block_sparse kernel's ranges differ per batch and per head: only where its
        mask_mod uses b and h (a mask of document ids indexed by b alone is classified once for
        all heads, and broadcast)."""
        used = names_used(self.mask_expr) if self.mask_expr is not None else frozenset()
        return "b" in used, "h" in used

    @property
    def block_ranges_slot(self) -> int:
        """The tensor param slot of a block_sparse kernel's block ranges (BLOCK_RANGES_SLOT)."""
        return BLOCK_RANGES_SLOT

    @property
    def num_threads(self) -> int:
        assert self.num_consumer_warpgroups
        return THREADS_PER_WARPGROUP * (1 + self.num_consumer_warpgroups)

    @property
    def register_pool(self) -> int:
        """Registers the launch allocates a CTA: 65536 / threads per thread, in multiples of 8;
        setmaxnreg moves registers only within them."""
        return REGISTERS_PER_SM // self.num_threads // 8 * 8 * self.num_threads

    @property
    def register_split(self) -> tuple[int, int]:
        assert self.num_consumer_warpgroups
        if self.kind == "bwd" or self.producer_registers is not None:
            assert self.producer_registers is not None
            rest = self.register_pool - THREADS_PER_WARPGROUP * self.producer_registers
            return self.producer_registers, rest // (THREADS_PER_WARPGROUP * self.num_consumer_warpgroups) // 8 * 8
        if self.is_fp8 and self.v_transpose_in_kernel and self.num_consumer_warpgroups in FP8_TRANSPOSE_REGISTER_SPLIT:
            return FP8_TRANSPOSE_REGISTER_SPLIT[self.num_consumer_warpgroups]
        if self.is_fp8 and self.num_consumer_warpgroups in FP8_REGISTER_SPLIT:
            return FP8_REGISTER_SPLIT[self.num_consumer_warpgroups]
        return REGISTER_SPLIT[self.num_consumer_warpgroups]

    @property
    def name(self) -> str:
        """A readable identifier; unique together with the hash."""
        dims = f"d{self.head_dim}" + (f"x{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")
        mask = "_causal" if self.causal else ""
        sched = ("_pp" if self.pingpong else "") + ("_ov" if self.intra_wg_overlap else "")
        sched += "_it" if self.inter_tile_overlap else ""
        sched += "_pdl" if self.programmatic_launch else ""
        sched += "_lr" if self.lazy_rescale else ""
        sched += f"_ch{self.row_reduce_chains}" if self.row_reduce_chains != 1 else ""
        sched += "" if self.scheduler == "grid" else f"_{self.scheduler}"
        sched += {"tma": "_otma", "tma_v": "_otmav", "direct": ""}[str(self.epilogue)]
        sched += f"_q{self.q_buffers}" if self.q_buffers != 1 else ""
        sched += "_qr" if self.q_registers else ""
        sched += f"_pin{self.pin_pv_wait}" if self.pin_pv_wait else ""
        sched += "_wgt" if self.warpgroup_key_trim else ""
        sched += "_neb" if self.narrow_edge_block else ""
        sched += "_vtk" if self.v_transpose_in_kernel else ""
        sched += "_rsm" if self.row_sums_mma else ""
        sched += "_bstg" if self.bias_staging else ""
        sched += "_kvfs" if self.kv_factors_in_smem else ""
        sched += "_bsp" if self.block_sparse else ""
        sched += "_mc2" if self.kv_multicast else ""
        sched += "_st" if self.split_tail else ""
        sched += (f"{self.split_tail_min_saving_percent}"
                  if self.split_tail_min_saving_percent != SPLIT_TAIL_MIN_SAVING_PERCENT else "")
        sched += f"p{self.split_tail_piece_blocks}" if self.split_tail_piece_blocks != SPLIT_TAIL_PIECE_BLOCKS else ""
        sched += "_sh" if self.scores_f16 else ""
        sched += f"_pe{self.exp2_poly_every}" if self.exp2_poly_every else ""
        sched += f"_p{self.producer_registers}" if self.producer_registers is not None else ""  # bwd: below
        if self.kind == "bwd":
            sched = ("_det" if self.deterministic else "") + ("" if self.scheduler == "grid" else f"_{self.scheduler}")
            sched += f"_g{self.causal_group}" if self.causal_group != BWD_CAUSAL_GROUP_DEFAULT else ""
            sched += "_kvr" if self.kv_registers else ""
            sched += "_dqd" if self.dq_deferred else ""
            sched += "_dq1" if self.dq_single_warpgroup else ""
            sched += f"_p{self.producer_registers}" if self.producer_registers != BWD_PRODUCER_REGISTERS_DEFAULT else ""
            sched += "_kvp" if self.kv_prefetch else ""
            sched += "_bsp" if self.block_sparse else ""
        variant = "".join(tag for on, tag in ((self.window, "_win"), (self.softcap, "_cap"), (self.alibi, "_alibi"), (self.bias, "_bias" + _BIAS_DTYPE_TAGS[self.bias_dtype]),
                                              (self.bias_grad, "_dbias"),
                                              (self.score_mod is not None, "_smod"),
                                              (self.mask_mod is not None, "_mmod"), (self.documents, "_doc"),
                                              (self.prefix_lm, "_plm")) if on)
        return (
            f"{self.kind}_{dims}_{self.dtype}{self._out_tag}{mask}{variant}_m{self.block_m}n{self.block_n}s{self.stages}{sched}"
        )

    @property
    def _out_tag(self) -> str:
        return f"_o{self.out_dtype}" if self.out_dtype != self.dtype else ""

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "e4m3"

    @property
    def loads_q_a_tile_ahead(self) -> bool:
        """The producer issues the next tile's Q right after this tile's first key block (not at
        the next tile's start): forward kernels with two Q buffers and Q in registers, whose
        buffer the previous tile's first Q·Kᵀ freed, on the static schedule. ncu's stall samples
        (H200, bf16 hdim 128 s512) had the consumers waiting for Q at 2.6% of all samples when it
        went out two key blocks ahead; a tile ahead (compare_templates.py, one process each,
        TFLOP/s): bf16 s512 476.2 -> 499.9 and 480.8 -> 504.7, s1k 554.8 -> 564.2 and 557.4 ->
        567.5, s2k 602.1 -> 606.8; fp16 s512 453.4 -> 473.6, s1k 531.3 -> 542.5; the ±1k window
        +0.7%. Where Q stays in shared memory its buffer frees only at the previous tile's end and
        the producer stalls the K/V loads behind it (hdim 64 causal, three stages: s512 266.4 ->
        242.8); with the lpt scheduler the next tile's claim is not back by then (e4m3 hdim 128
        causal s16k 831.6 -> 780.7, the causal 1k window -1 to -2%). With three Q buffers the
        next tile's was freed by the tile before this one, in shared memory too, and the producer
        need not wait for it: static and lpt (the claim's latency then shows; not yet timed)."""
        if self.kind != "fwd":
            return False
        return (self.q_buffers == 3 and self.scheduler in ("static", "lpt")) \
            or (self.q_buffers == 2 and bool(self.q_registers) and self.scheduler == "static")

    @property
    def stores_o_with_tma(self) -> bool:
        """O leaves through shared memory and a TMA store (its own buffer, or V's)."""
        return self.epilogue in ("tma", "tma_v")

    def canonical_json(self) -> str:
        """One JSON text per kernel: all fields, defaults filled, keys sorted, no whitespace. The
        fields of _OMITTED_AT_DEFAULT are left out where they hold their default (reading the text
        back fills it again): added after kernels were cached, they change no existing kernel's
        JSON, source or cache key."""
        full = self.model_dump(mode="json")
        # Each default from all the fields (one may depend on another that is left out).
        data = {k: v for k, v in full.items() if k not in _OMITTED_AT_DEFAULT or v != _OMITTED_AT_DEFAULT[k](full)}
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KernelSpec:
        return cls.model_validate_json(text)

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @property
    def symbol_suffix(self) -> str:
        """Suffix that makes the kernel's C++ symbols unique to this spec."""
        return self.content_hash
