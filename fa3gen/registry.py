"""The prebuilt registry: the specs `fa3gen build --all` compiles and generated/ holds."""

from __future__ import annotations

from typing import Any

from . import split_tail
from .prepare_spec import Fp8PrepareSpec
from .spec import BIAS_BYTES, SUPPORTED_HEAD_DIMS, KernelSpec

_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def _registry_name(head_dim: int, dtype: str, causal: bool, kind: str = "fwd") -> str:
    return f"{kind}_d{head_dim}_{dtype}" + ("_causal" if causal else "")


# Registry forward tiles that differ from the spec defaults at every query length, per (head_dim,
# causal). hdim 128 causal: one Q buffer (so no chained tiles and no pingpong), Q in registers.
# Measured on the H200 (2026-12-01, 16k tokens, interleaved, two processes) against the chained
# pingpong default it replaced up to 2k queries: bf16 s512 311 -> 334 and 316 -> 338, s1k 415 ->
# 428 and 423 -> 434, s2k 500 -> 513 and 516 -> 525; fp16 s512 307 -> 328, s1k 422 -> 434, s2k
# 484 -> 495. Past 2k it had been SEQLEN_TILES' long bucket.
REGISTRY_TILES: dict[tuple[int, bool], dict[str, Any]] = {
    (128, True): {"q_buffers": 1},
}

# Forward kernels of every head dim, then the backward kernels (non-deterministic); the deterministic
# backward kernels are compiled on first use.
REGISTRY: dict[str, KernelSpec] = {
    _registry_name(d, dtype, causal, kind): KernelSpec(kind=kind, head_dim=d, dtype=dtype, causal=causal,
                                                       **(REGISTRY_TILES.get((d, causal), {}) if kind == "fwd" else {}))
    for kind in ("fwd", "bwd")
    for d in SUPPORTED_HEAD_DIMS
    for dtype in ("bf16", "fp16")
    for causal in (False, True)
}

# Forward tiles by query length, per (head_dim, causal): buckets in order of length, each (name, the
# longest seqlen_q it takes or None for any, the spec fields that differ from the default); a
# length past the last bucket's takes the default spec. Each bucket is a registry kernel of its own.
SeqlenTiers = tuple[tuple[str, int | None, dict[str, Any]], ...]
# Measured on the H200 (2026-11-30, bf16, 16k tokens, interleaved timing, same process):
# - hdim 64, causal: the default 192-row tiles waste most of the diagonal's blocks; 128 rows:
#   s512 168 -> 197 TFLOP/s, s1k 218 -> 259 (s2k 321 -> 309). (Not causal, 128 rows paid at s512
#   until each warpgroup stored its own O rows: then 192 rows 370 vs 364, s1k 420 vs 417.) Three
#   stages for the 128-row tiles (2026-12-01, three processes): s512 237.4 -> 245.7, 228.5 ->
#   237.1, 226.6 -> 234.9; s1k 317.3 -> 319.8, 309.2 -> 303.7, 302.4 -> 303.6. (Not causal, three
#   stages for the 192-row tiles lost at s512: 387.1 -> 371.2.) 2026-12-02: with each warpgroup's
#   own key range (warpgroup_key_trim, the last tile's warpgroups past seqlen_q keeping one block)
#   and the narrow edge block, the 192-row tiles win at every length (two runs, s512 264.5 vs
#   257.6 and 249.8 vs 248.3, s1k 328.3 vs 323.1 and 322.4 vs 317.1). Three stages for them (two
#   runs, one process): s512 258.6 -> 271.6 and 265.4 -> 277.2, s1k 326.8 -> 330.9 and 324.8 ->
#   330.6, s2k 407.6 -> 410.9 and 402.9 -> 407.0; s4k 450.7 -> 442.8 and 446.1 -> 438.9 (s16k
#   +0.4%, +0.8%). Q in registers lost 10% at every length.
# - hdim 128, not causal: 176-key blocks (FA3's tile; O from registers, one Q buffer) halve the
#   softmax's share per key: s16k 594 -> 630, s4k 575 -> 578, but s512 435 -> 386, s1k 512 -> 481.
#   With lazy rescale (2026-11-30, later) the 128-key default gains and keeps s4k: 622 vs 597
#   (s16k 647 vs 655 for 176 keys). Then, past 2k, the 128-key tiles with one Q buffer (so no
#   chained tiles and no pingpong) beat both: s4k 627 (two Q buffers 618, 176 keys 589), s8k 637
#   (176 keys 625), s16k 642 (639); s2k ties (604 vs 603).
# - hdim 128, causal: past 4k, 176-key blocks with O staged in the V buffer: s8k 555 -> 566,
#   s16k 555 -> 601 (s4k 533 -> 508, s512 295 -> 239). With lazy rescale, past 2k the 128-key
#   tiles with one Q buffer win: s2k 503 (two Q buffers 496), s4k 563 (555), s8k 604 (176 keys 573),
#   s16k 604 (593). (2026-12-01: they win at every length; REGISTRY_TILES.)
# - hdim 128, not causal, up to 2k: Q in registers (q_registers) on the chained pingpong tiles,
#   three A/B runs in three processes (2026-12-01/02, bf16, TFLOP/s): s512 487.2 -> 486.8, 486.8 ->
#   490.4, 477.5 -> 478.7; s1k 556.5 -> 565.1, 570.0 -> 575.5, 558.0 -> 559.4; s2k 617.9 -> 623.3,
#   603.6 -> 613.2, 614.2 -> 617.9.
# - hdim 128, not causal, past 1k: 192 x 128 tiles on three consumer warpgroups, without
#   intra-warpgroup overlap (spec.INTRA_WG_OVERLAP_MAX_HEAD_DIM_V_3WG), against the two tiles above
#   (2026-12-03, three processes, bf16, TFLOP/s, short tiles / one-Q-buffer tiles / 192 rows):
#   s2k 605.7 / - / 624.1, 593.7 / 599.8 / 617.4, 597.3 / 601.9 / 617.2; s4k 628.9 / 638.0 /
#   648.5, 612.8 / 627.2 / 631.1, 621.5 / 630.6 / 639.8; s16k 654.0 / 673.7 / 681.5, 640.8 /
#   656.0 / 664.7, 643.7 / 656.2 / 662.7; fp16 s2k 601.5 / 600.4 / 605.8, s4k 610.3 / 618.2 /
#   629.6, s16k 618.8 / 634.1 / 643.5. At s1k the 192-row tiles lose (539.6-543.9 against
#   554.4-555.7; a head's last tile is a third full) and at s512 they tie (460.2, 480.5 against
#   470.5, 476.4), so the short tiles keep up to 1k.
# - hdim 256, up to 512 queries: 64-key blocks (O staged in the V buffer) instead of the default
#   80, whose last block of a 512-key row is 60% padding. s512, as CUDA-graph replays: 490 -> 495,
#   causal 314 -> 321; eager: 456 -> 476, causal 293 -> 302. From 1k on 80 keys win (graphs: s1k
#   611 vs 567, causal 418 vs 404; s2k 673 vs 613). With lazy rescale (measured later that day)
#   64 keys also win causal s1k: 460 vs 448 (graphs 461 vs 448); not causal s1k ties (661 vs 663).
# - hdim 64, not causal, up to 2k: three Q buffers (the next two tiles' Q land while a tile runs;
#   a 512-query head is three 192-row tiles, so tile starts weigh most there). H100s (the H200 was
#   not lent), `scripts/compare_specs.py --seqlens 512,1024,2048`, TFLOP/s two Q buffers -> three:
#   2026-12-05 bf16 s512 368.1 -> 380.9, s1k 412.5 -> 417.9, fp16 s512 385.9 -> 392.2, s1k 406.3
#   -> 409.4; 2026-12-06, two processes per dtype: bf16 s512 378.0 -> 383.4 and 382.6 -> 393.0,
#   s1k 422.1 -> 423.0 and 422.3 -> 424.0, s2k 486.8 -> 488.5 and 485.3 -> 486.2; fp16 s512 369.7
#   -> 374.7 and 369.6 -> 373.3, s1k 413.8 -> 415.3 and 410.7 -> 413.1, s2k 468.7 -> 469.2 and
#   472.1 -> 472.4. Past 2k within -1.3% to +0.8% (2026-12-05), so the long bucket keeps two.
#   (Three stages on top lost 2-3% at every length; 128-row pingpong tiles with three Q buffers
#   lost 3-12%.)
# - hdim 64 causal up to 1k: 256-row tiles on four consumer warpgroups (64-key blocks, three
#   stages, 112 registers each, trimmed per warpgroup): 1024 queries are four whole tiles, where
#   192 rows leave a third-full last tile whose two idle warpgroups leave the tensor cores to one.
#   H100 (2026-12-06, `scripts/compare_specs.py`, four processes, TFLOP/s, the registry's three
#   stages on 192 rows -> 256 rows): bf16 s512 269.3 -> 277.9, 267.0 -> 277.9, 264.1 -> 276.9,
#   264.1 -> 277.0; s1k 338.8 -> 356.5, 330.2 -> 348.0, 330.3 -> 347.0, 328.1 -> 346.4; fp16 s512
#   259.4 -> 271.8, 262.8 -> 276.5, s1k 319.7 -> 335.4, 325.6 -> 341.9. From 2k they lose (64-key
#   blocks: 11 instructions a score in the key-block loop against 9 on 128 keys; s2k 415.9 ->
#   391.3, s4k 445.7 -> 421.1), so s2k keeps three stages on 192 rows ("mid"). Four stages or
#   three Q buffers on top: within -2% to +2%.
# - hdim 64 not causal up to 1k: the same tiles with the producer at 24 registers
#   (producer_registers; at REGISTER_SPLIT's 32 they tied three Q buffers on 192 rows, s512 +0.4%
#   to +2.7%, s1k -1.1% to +1.9% over four processes). H100 (2026-12-06, three processes per
#   dtype, TFLOP/s, three Q buffers on 192 rows / producer at 32 / at 24): bf16 s512 405.6 / 406.2
#   / 415.8, 417.2 / 418.0 / 428.0, 416.8 / 417.9 / 427.1; s1k 441.7 / 435.3 / 447.5, 450.3 /
#   445.7 / 457.1, 446.0 / 441.2 / 452.5; fp16 s512 392.1 / 393.7 / 402.3, 394.6 / 397.4 / 405.0,
#   390.7 / 393.2 / 402.1; s1k 425.6 / 420.6 / 433.8, 428.9 / 426.0 / 438.2, 431.7 / 426.7 /
#   437.9. At 2k three Q buffers on 192 rows keep their lead (504.1 vs 463.5): "mid".
_FOUR_WARPGROUPS_64 = {"block_m": 256, "block_n": 64, "stages": 3}
SEQLEN_TILES: dict[tuple[int, bool], SeqlenTiers] = {
    (64, False): (("short", 1024, {**_FOUR_WARPGROUPS_64, "producer_registers": 24}), ("mid", 2048, {"q_buffers": 3})),
    (64, True): (("short", 1024, _FOUR_WARPGROUPS_64), ("mid", 2048, {"stages": 3})),
    (128, False): (("short", 1024, {"q_registers": True}), ("long", None, {"block_m": 192})),
    (256, False): (("short", 512, {"block_n": 64}),),
    (256, True): (("short", 1024, {"block_n": 64}),),
}


def _bucket_name(head_dim: int, dtype: str, causal: bool, bucket: str) -> str:
    return f"{_registry_name(head_dim, dtype, causal)}_{bucket}"


def _bucket_specs(tiles: dict[tuple[int, bool], SeqlenTiers], dtypes: tuple[str, ...]) -> dict[str, KernelSpec]:
    """The registry entries of a table of tiles by query length (one per bucket with fields of its
    own and dtype; a bucket without is the default kernel's)."""
    return {
        _bucket_name(d, dtype, causal, bucket): KernelSpec(head_dim=d, dtype=dtype, causal=causal, **fields)
        for (d, causal), tiers in tiles.items()
        for bucket, _, fields in tiers if fields
        for dtype in dtypes
    }


REGISTRY.update(_bucket_specs(SEQLEN_TILES, ("bf16", "fp16")))


def seqlen_bucket(head_dim: int, causal: bool, seqlen_q: int | str | None) -> str | None:
    """The bucket ("short", "mid", "long") whose tiles the registry has for this query length
    (SEQLEN_TILES), else None: the default spec. A bucket name (what kernel keys carry) is
    returned as it is."""
    return _bucket_of(SEQLEN_TILES.get((head_dim, causal)), seqlen_q)


def _bucket_of(tiers: SeqlenTiers | None, seqlen_q: int | str | None) -> str | None:
    if isinstance(seqlen_q, str):
        return seqlen_q
    if tiers is None or seqlen_q is None:
        return None
    return next((name for name, limit, _ in tiers if limit is None or seqlen_q <= limit), None)


def _bucket_fields(tiers: SeqlenTiers | None, bucket: str | None) -> dict[str, Any]:
    """The spec fields of a bucket of a table of tiles by query length ({} for none: the default)."""
    return next((fields for name, _, fields in tiers or () if name == bucket), {})


# FP8 forward kernels (e4m3 in, bf16 out) of the head dims the FA3 paper measures.
REGISTRY.update({
    _registry_name(d, "e4m3", causal): KernelSpec(head_dim=d, dtype="e4m3", causal=causal)
    for d in (64, 128, 256)
    for causal in (False, True)
})

# FP8 forward tiles by query length, as SEQLEN_TILES (fields over the e4m3 defaults, FP8_TILES):
# 192-row tiles on three consumer warpgroups (each warpgroup's own Q factor lets 128-row Q scale
# blocks span a tile) wherever they measured faster than the 128 x 192 pingpong kernel, which stays
# for K/V scale blocks that the buckets' key blocks do not divide and for hdim 256; fp16 scores
# and 256-key blocks below. The loop by length (H200, 2026-12-04, one process, `scripts/bench_fp8.py --spec ...
# --candidate-blocks prepare`: each candidate interleaved with the previous default on the same
# prepared inputs, TFLOP/s, previous -> new; two processes where two figures):
# - hdim 128 not causal, the serial loop at every length (was: past 1k): s512 532.9 -> 618.7,
#   s1k 621.3 -> 725.1 (the row sums on the tensor cores and the per-tile factor rows made it
#   the faster one there too).
# - hdim 128 causal up to 4k, the serial loop with per-warpgroup key trimming: s512 327.0 ->
#   386.3, s1k 474.5 -> 517.2 / 470.7 -> 504.7, s2k 622.1 -> 668.4 / 620.2 -> 656.9, s4k 725.9 ->
#   735.5; s8k 774.6 -> 778.3 (a tie), s16k 825.8 -> 802.7 (the pingpong kernel stays).
# - hdim 64 not causal from 1k, the serial loop (in place of the intra-warpgroup overlap with
#   chained tiles): s1k 433.1 -> 453.7 / 437.6 -> 458.3, s2k 529.9 -> 542.3, s4k 549.1 -> 563.3,
#   s8k 593.3 -> 601.6, s16k 603.0 -> 611.8; s512 410.1 -> 398.8 (the overlap kernel stays).
# - hdim 64 causal up to 2k, per-warpgroup key trimming on the overlap kernel: s512 228.2 ->
#   244.8, s1k 309.0 -> 330.1, s2k 430.8 -> 438.9; s8k 536.7 -> 528.5 (untrimmed past 2k). The
#   serial loop with trimming tied up to 1k (248.9, 329.6) and lost from 2k (427.9, 512.5). Three
#   K/V stages on top (as the 16-bit kernel there): s512 243.8 -> 255.5, s1k 327.2 -> 337.2, s2k
#   435.4 -> 436.2 (at hdim 128 three stages lost 2-3%, causal too).
# (Earlier: the 192 x 128 overlap kernel took hdim 64 from the pingpong kernel at every length,
# s512 323.6 -> 392.4, s16k 505.8 -> 592.4, causal s16k 464.8 -> 531.0.)
_FP8_TILES_192 = {"block_m": 192, "block_n": 128}
# Scores in fp16 (scores_f16) where measured faster, for inputs whose Q and K keep to its bound
# (fa3gen.fp8.prepare's default). Two scores a register leave room for 256-key blocks on three
# consumer warpgroups (192 x 256: S 64 + O 64 registers), which halve the per-key cost of O's
# rescale and of the pipeline's waits. H100, 2026-12-06, scripts/compare_fp8_shapes.py, 16k
# tokens, TFLOP/s (BENCHMARKS.md):
# - hdim 128 not causal, 192 x 128 fp16 scores + every 8th exp2 on the FMA pipe (the previous
#   kernel) -> 192 x 256 with one Q buffer + every 4th -> 128 x 256 pingpong + every 8th: s512
#   657.6 -> 690.3 -> 718.9, s1k 752.1 -> 851.9 -> 875.8, s2k 879.9 -> 1038.1 -> 955.0, s4k
#   915.0 -> 1097.3 -> 998.4, s16k 945.1 -> 1144.3 -> 1032.6 (192 x 192: 935.3 / 986.0 / 1052.5).
#   Earlier: fp32 -> fp16 scores on 192 x 128, s2k 860.1 -> 877.8, s16k 915.7 -> 967.5.
#   The 192 x 256 kernel's exp2 split (H100, 2026-12-07, bench_fp8.py, s16k): every 4th 1138.5-1142.7
#   against every 2nd 1071.5, 3rd 1099.4, 5th 1110.9, 6th 1118.0 (causal every 3rd within the spread).
# - hdim 128 causal, fp32 -> fp16 scores + every 8th: 192 x 128 trimmed s1k 539.0 -> 570.0, s2k
#   684.6 -> 737.3, s4k 756.7 -> 826.0; 128 x 192 pingpong s8k 815.2 -> 917.7, s16k 845.4 ->
#   955.1. Past 1k 192 x 256 trimmed (one Q buffer, every 4th): 192 x 128 trimmed -> 128 x 192
#   pingpong -> 192 x 256 s4k 796.6 -> 808.0 -> 893.0, s8k 869.6 -> 880.8 -> 1002.4, s16k 904.3 ->
#   926.9 -> 1071.3; s512 404.8 -> 367.9, s1k 566.6 -> 559.2, s2k 744.2 -> 777.4 (192 x 128 -> 192 x 256).
# - hdim 64 not causal, 192 x 128 fp16 scores -> 192 x 256 + every 8th: s1k 483.9 -> 574.3, s2k
#   572.7 -> 676.4, s16k 656.8 -> 750.3. Causal: the serial loop with fp16 scores tied the
#   overlapped one with fp32 (s2k 445.3 vs 455.0, s16k 625.0 vs 611.7): unchanged.
# - hdim 256 past 2k, not causal and causal: 128 x 192 pingpong with fp16 scores (O staged in the
#   V buffer, one Q buffer; S 48 + O 128 registers of the pingpong consumers' 240) against the
#   lazy fp32-score 128 x 128 kernel (H100, 2026-12-06, compare_fp8_shapes.py --qk-max-abs 16,
#   8 heads): s4k 1065.7 -> 1177.4, s8k 1140.7 -> 1243.5, s16k 1168.3 -> 1241.8; causal 978.6 ->
#   1006.9, 1036.5 -> 1096.3, 1069.6 -> 1149.6 (128 x 128 and 128 x 160 with fp16 scores: within
#   -1.4% to +1.4% of the lazy kernel). bench_fp8.py beside fa3gen's bf16 kernel: s16k 1203.7 ->
#   1298.4 (1.66x bf16's 781.3), s8k 1139.7 -> 1255.9, causal s16k 1046.7 -> 1163.3.
#   H200 (2026-12-06, bench_fp8.py --candidate-blocks prepare, the lazy kernel -> 128 x 192): not
#   causal it wins below 2k too, s512 589.6 -> 745.4, s1k 800.7 -> 934.1, s2k 966.6 -> 1123.1, so
#   it takes every length; causal it does not (s512 451.2 -> 441.1, s1k 689.7 -> 653.6, s2k 835.1
#   -> 830.4): the lazy kernel keeps up to 2k. Every 4th exp2 on the FMA pipe on top measured
#   faster (H200, compare_fp8_shapes.py, 8 heads, none / every 8th / every 4th): 2 x 8k 1203.4 /
#   1328.9 / 1355.4, 1 x 16k 1202.8 / 1343.2 / 1367.1; causal 1040.0 / 1107.6 / 1113.7, 1112.3 /
#   1192.3 / 1198.7: every 4th taken (_WIDE_F16_256), once the fp8 GPU tests passed on it.
_SCORES_F16 = {"scores_f16": True}
_WIDE_F16 = {"block_m": 192, "block_n": 256, "intra_wg_overlap": False, **_SCORES_F16}
_WIDE_F16_256 = {"block_n": 192, "q_buffers": 1, "lazy_rescale": False, "row_sums_mma": True, **_SCORES_F16,
                 "exp2_poly_every": 4}
FP8_SEQLEN_TILES: dict[tuple[int, bool], SeqlenTiers] = {
    (64, False): (("short", 512, _FP8_TILES_192),
                  ("long", None, {**_WIDE_F16, "exp2_poly_every": 8})),
    (64, True): (("short", 2048, {**_FP8_TILES_192, "warpgroup_key_trim": True, "stages": 3}),
                 ("long", None, _FP8_TILES_192)),
    (128, False): (("short", 1024, {"block_n": 256, **_SCORES_F16, "exp2_poly_every": 8}),
                   ("long", None, {**_WIDE_F16, "q_buffers": 1, "exp2_poly_every": 4})),
    (128, True): (("short", 1024, {**_FP8_TILES_192, "warpgroup_key_trim": True, **_SCORES_F16, "exp2_poly_every": 8}),
                  ("long", None, {**_WIDE_F16, "q_buffers": 1, "warpgroup_key_trim": True, "exp2_poly_every": 4})),
    # ("short", ..., {}): the default kernel's tiles (its registry entry, no bucket entry of its own)
    (256, False): (("long", None, _WIDE_F16_256),),
    (256, True): (("short", 2048, {}), ("long", None, _WIDE_F16_256)),
}
# The tiles of each fp16-score bucket for Q and K outside that bound (fp32 scores,
# default_fp8_spec(scores_f16_inputs=False)): the previous registry kernels, where fp32 scores
# do not fit the bucket's registers.
FP8_FP32_SCORE_TILES: dict[tuple[int, bool, str], dict[str, Any]] = {
    (64, False, "long"): {**_FP8_TILES_192, "intra_wg_overlap": False},
    (128, False, "short"): _FP8_TILES_192,
    (128, False, "long"): _FP8_TILES_192,
    (128, True, "short"): {**_FP8_TILES_192, "warpgroup_key_trim": True},
    (128, True, "long"): {**_FP8_TILES_192, "warpgroup_key_trim": True},
    (256, False, "long"): {},
    (256, True, "long"): {},
}
assert {(d, c, name) for (d, c), tiers in FP8_SEQLEN_TILES.items() for name, _, fields in tiers
        if fields.get("scores_f16")} == set(FP8_FP32_SCORE_TILES)

REGISTRY.update(_bucket_specs(FP8_SEQLEN_TILES, ("e4m3",)))

# Split twins: each forward kernel with split_tail (causal ones on the static schedule), which the
# dispatchers take only for the problems fa3gen.split_tail.splits (a wave or two of tiles: a
# small batch, few heads, few queries over many keys: decoding from a KV cache). The split code
# costs a kernel 2-5% where it does not split, so the kernels themselves stay as they are for every
# other problem. _SPLIT_TWIN_OF finds a kernel's twin in one hash lookup: the dispatch asks on
# every forward call.
SPLIT_TWIN_SUFFIX = "_split"
# Twins that split for less than the rule's default (split_tail_min_saving_percent; a piece's
# start, partial and merge counted as split_tail_piece_blocks key blocks): hdim 128's 192-row
# kernels, whose FA3-grid problems at 8k-16k (1376 tiles = 10.4 waves) leave 76 of 132 SMs idle
# for the last tile. H100, 2026-12-07, `scripts/compare_fp8_shapes.py` and `scripts/compare_specs.py
# --shapes ...`, TFLOP/s, kernel -> twin at the default rule (not splitting) -> twin at 3%: e4m3 1 x
# 16k x 16 heads 1146.1 -> 1118.3 -> 1172.8, 2 x 8k 1110.1 -> 1084.5 -> 1129.6; bf16 701.5 -> 689.1
# -> 720.2, 669.6 -> 658.7 -> 684.2; fp16 678.5 -> 661.2 -> 692.2, 656.2 -> 638.0 -> 669.1. 4 x 4k (a
# 2.8% shorter busiest CTA) stays whole: the twin's code costs 1-2.5% where it does not split. A
# wave of 112 tiles over 3072 keys lost split (e4m3 738.8 -> 688.9 at 12 key blocks a tile, one
# saved; bf16 530.7 -> 451.3 at 24, three saved): a tile in two pieces pays two starts, a partial
# and the merge, about four key blocks, which the piece count (split_tail.PIECE_BLOCKS) keeps whole.
# And one that splits only for much more: hdim 256's e4m3 128 x 192 twin, whose key-block loop
# ptxas schedules with 13% more stall cycles than the kernel's (fa3gen.sass.full_block_path; the
# merge's code beside the loop, in any form tried): not splitting it ran 14% behind (1 x 16k x 8
# heads 1416.4 -> 1217.4 TFLOP/s, H100, 2026-12-07), and split it lost on problems the default
# rule splits (1 x 4096 x 2 heads, a 32% shorter busiest CTA: 447.9 -> 438.2; 1 x 3072 x 8, 13%:
# 1017.8 -> 1003.4) where 4 x 128 x 16k x 8 (71%) gained 34% (412.5 -> 553.4).
_LOW_SPLIT_RULE = {"split_tail_min_saving_percent": 3}
SPLIT_TWIN_FIELDS: dict[str, dict[str, Any]] = {
    "fwd_d128_bf16_long": _LOW_SPLIT_RULE, "fwd_d128_fp16_long": _LOW_SPLIT_RULE, "fwd_d128_e4m3_long": _LOW_SPLIT_RULE,
    "fwd_d256_e4m3_long": {"split_tail_min_saving_percent": 35},
}
_TWIN_FIELDS_OF = {REGISTRY[name]: fields for name, fields in SPLIT_TWIN_FIELDS.items()}
_SPLIT_TWIN_OF: dict[KernelSpec, KernelSpec] = {
    spec: KernelSpec(**{**spec.model_dump(exclude_unset=True), "split_tail": True, "scheduler": "static",
                        **_TWIN_FIELDS_OF.get(spec, {})})
    for spec in REGISTRY.values() if spec.kind == "fwd"
}
REGISTRY.update({name + SPLIT_TWIN_SUFFIX: _SPLIT_TWIN_OF[spec] for name, spec in list(REGISTRY.items())
                 if spec.kind == "fwd"})
# The laxest rule of any twin (fa3gen.split_tail.splits' min_saving_percent, piece_blocks): a
# problem it does not split, no twin splits, so the dispatch looks no twin up for it.
SPLIT_RULE_FLOOR = (min(t.split_tail_min_saving_percent for t in _SPLIT_TWIN_OF.values()),
                    min(t.split_tail_piece_blocks for t in _SPLIT_TWIN_OF.values()))


def fp8_seqlen_bucket(head_dim: int, head_dim_v: int, causal: bool, window: bool, v_transpose_in_kernel: bool,
                      seqlen_q: int | str | None) -> str | None:
    """As seqlen_bucket, for the e4m3 kernels (FP8_SEQLEN_TILES): only the plain problem
    (head_dim_v == head_dim, no window, V in the kernel's layout) has tiles by query length."""
    if head_dim_v != head_dim or window or v_transpose_in_kernel:
        return None
    return _bucket_of(FP8_SEQLEN_TILES.get((head_dim, bool(causal))), seqlen_q)


def fp8_bucket_spec(head_dim: int, causal: bool, bucket: str) -> KernelSpec:
    """The registry's e4m3 kernel of a bucket of fp8_seqlen_bucket (bf16 out; the tiles are the
    same for fp16)."""
    return REGISTRY[_fp8_registry_name(head_dim, causal, bucket, _fp8_tiles(head_dim, causal, bucket, True))]


def _fp8_registry_name(head_dim: int, causal: bool, bucket: str | None, tiles: dict[str, Any]) -> str:
    """The registry name of a bucket's e4m3 kernel with these tiles: the default kernel's where
    they are the defaults (a bucket without fields of its own, or its fp32-score tiles)."""
    if bucket is None or not tiles:
        return _registry_name(head_dim, "e4m3", bool(causal))
    return _bucket_name(head_dim, "e4m3", bool(causal), bucket)


def _fp8_tiles(head_dim: int, causal: bool, bucket: str | None, scores_f16_inputs: bool) -> dict[str, Any]:
    """The spec fields (over the e4m3 defaults) of a bucket of FP8_SEQLEN_TILES ({} for none), or
    its fp32-score tiles (FP8_FP32_SCORE_TILES) for inputs outside scores_f16's bound."""
    tiles = _bucket_fields(FP8_SEQLEN_TILES.get((head_dim, bool(causal))), bucket)
    if not scores_f16_inputs and tiles.get("scores_f16"):
        return FP8_FP32_SCORE_TILES[(head_dim, bool(causal), bucket)]
    return tiles


def fp8_bucket_block_n(head_dim: int, causal: bool, bucket: str, scores_f16_inputs: bool = True) -> int:
    """The key-block rows of the kernel default_fp8_spec takes for a bucket (its fp32-score tiles
    for inputs outside scores_f16's bound): the K/V scale blocks must be multiples of it."""
    from .spec import FP8_TILES

    return _fp8_tiles(head_dim, causal, bucket, scores_f16_inputs).get("block_n", FP8_TILES[head_dim][1])


def fp8_key_block_sizes(head_dim: int) -> tuple[int, ...]:
    """The key-block rows (block_n) of the registry's e4m3 kernels of a head dim, in any bucket
    (and their fp32-score tiles): the K/V scale blocks that every one of them takes are
    multiples of all of them."""
    from .spec import FP8_TILES

    buckets = [fields for (d, _), tiers in FP8_SEQLEN_TILES.items() if d == head_dim for _, _, fields in tiers]
    buckets += [fields for (d, _, _), fields in FP8_FP32_SCORE_TILES.items() if d == head_dim]
    sizes = {FP8_TILES[head_dim][1]} | {fields["block_n"] for fields in buckets if "block_n" in fields}
    return tuple(sorted(sizes))


# fa3gen.fp8.prepare's fused kernels for the registry's e4m3 head dims and 16-bit inputs (fp32
# inputs compile on first use). `fa3gen build --all` and `render --all` take them with REGISTRY.
PREPARE_REGISTRY: dict[str, Fp8PrepareSpec] = {
    spec.name: spec
    for spec in (Fp8PrepareSpec(head_dim=d, input_dtype=dtype) for d in (64, 128, 256) for dtype in ("bf16", "fp16"))
}

# The spec `fa3gen demo` and the real-compile test build.
REPRESENTATIVE = "fwd_d128_bf16"


def all_specs() -> dict[str, KernelSpec | Fp8PrepareSpec]:
    """Every prebuilt spec by name: the attention kernels, then the fp8 prepare kernels."""
    return {**REGISTRY, **PREPARE_REGISTRY}


def registry_name(spec: KernelSpec | Fp8PrepareSpec) -> str | None:
    """The short registry name of a spec, if it is one of the registry's."""
    for name, candidate in all_specs().items():
        if candidate == spec:
            return name
    return None


def display_name(spec: KernelSpec | Fp8PrepareSpec) -> str:
    """Registry name when there is one, else the spec's own (longer) name."""
    return registry_name(spec) or spec.name


def _canonical_problem(head_dim: int, head_dim_v: int, dtype: str) -> str:
    """Checks the head dims are ones fa3gen has kernels for; returns the canonical dtype name."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} is not supported: fa3gen kernels exist for head dims {SUPPORTED_HEAD_DIMS}"
        )
    if head_dim_v not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim_v={head_dim_v} is not supported: fa3gen kernels exist for head dims "
            f"{SUPPORTED_HEAD_DIMS}"
        )
    canonical = _DTYPE_ALIASES.get(str(dtype).removeprefix("torch."))
    if canonical is None:
        raise ValueError(f"dtype={dtype!r} is not supported: use 'bf16' or 'fp16'")
    return canonical


# The attn_bias forwards that stage the bias through shared memory (bias_staging) when its rows
# are 16-byte aligned: the bias element sizes (bytes) staged per head dim. Measured on an H100
# (2026-12-05, .dev A/B in one process, b4 h16 s4k, bias (1, h, s, s), register path -> staged):
# hdim 128 fp32 1.800 -> 1.713 ms, bf16 1.587 -> 1.413; hdim 96 bf16 1.356 -> 1.268, hdim 64 bf16
# 1.164 -> 1.081. An fp32 tile at hdim 64 / 96 costs a Q buffer or chained tiles and was slower
# (1.206 -> 1.441, 1.405 -> 1.619). fp16 biases (2 bytes, the same copies) follow bf16's.
BIAS_STAGING_ELEMENT_BYTES: dict[int, tuple[int, ...]] = {64: (2,), 96: (2,), 128: (4, 2)}


def default_spec(head_dim: int, head_dim_v: int, dtype: str, causal: bool, window: bool = False,
                 softcap: bool = False, alibi: bool = False, seqlen_q: int | str | None = None,
                 documents: bool = False, prefix_lm: bool = False, bias: bool = False,
                 bias_dtype: str = "float32", bias_rows_aligned: bool = False) -> KernelSpec:
    """The forward spec to use for a problem: the registry's when present, else the per-head-dim
    defaults (with the built-in variants, masks and bias asked for; bias_dtype: attn_bias's element
    type, "float32", "bfloat16" or "float16"; bias_rows_aligned: its rows start on 16-byte
    boundaries, so the bias may be staged in shared memory, BIAS_STAGING_ELEMENT_BYTES). seqlen_q (a
    length, or a bucket's name from seqlen_bucket) picks the registry's tiles for that
    query length (SEQLEN_TILES)."""
    canonical = _canonical_problem(head_dim, head_dim_v, dtype)
    if head_dim_v == head_dim and not (window or softcap or alibi or documents or prefix_lm or bias):
        bucket = seqlen_bucket(head_dim, bool(causal), seqlen_q)
        if bucket is not None:
            return REGISTRY[_bucket_name(head_dim, canonical, bool(causal), bucket)]
        return REGISTRY[_registry_name(head_dim, canonical, bool(causal))]
    fields = dict(head_dim=head_dim, head_dim_v=head_dim_v, dtype=canonical, causal=bool(causal),
                  window=bool(window), softcap=bool(softcap), alibi=bool(alibi), documents=bool(documents),
                  prefix_lm=bool(prefix_lm), bias=bool(bias), bias_dtype=bias_dtype if bias else "float32")
    if bias and bias_rows_aligned and BIAS_BYTES[bias_dtype] in BIAS_STAGING_ELEMENT_BYTES.get(head_dim, ()):
        try:
            return KernelSpec(**fields, bias_staging=True)
        except ValueError:  # a combination whose staged tile does not fit: the register path
            pass
    # A pydantic ValidationError (a ValueError) names the limit if this combination does not fit.
    return KernelSpec(**fields)


def split_twin(spec: KernelSpec) -> KernelSpec | None:
    """The registry's split twin of a forward spec (SPLIT_TWIN_SUFFIX), None where it has none."""
    return _SPLIT_TWIN_OF.get(spec)


def split_twin_for(spec: KernelSpec, batch: int, seqlen_q: int, nheads: int, seqlen_k: int, sms: int) -> KernelSpec | None:
    """The split twin the dispatch runs in place of a registry forward spec on a GPU of `sms` SMs:
    where the spec's kernel would leave SMs idle in its last wave and the twin's rule
    (fa3gen.split_tail.splits: a wave or two of tiles, or a long last tile on a twin with a lower
    bar; causal: fewer tiles than SMs) splits it. None: the spec's own kernel runs."""
    if spec.split_tail:
        return None
    # The rule first, at the laxest twin's (SPLIT_RULE_FLOOR): it is a few integer operations, and
    # most calls stop there.
    tiles = -(-seqlen_q // spec.block_m) * nheads * batch
    key_blocks = -(-seqlen_k // spec.block_n)
    if not split_tail.splits(tiles, key_blocks, sms, *SPLIT_RULE_FLOOR):
        return None
    # A causal kernel's lpt schedule spreads its uneven tiles over the SMs; its twin's static one
    # cannot: the split pays only where SMs idle anyway, with fewer tiles than SMs. (H100,
    # 2026-12-07, hdim 256 e4m3: 192 tiles over 4096 keys, which the rule splits 18% shorter,
    # 804.3 -> 591.7 TFLOP/s split; 64 tiles 350.7 -> 392.4, 4 x 128 x 16k x 8 200.0 -> 275.6.)
    if spec.causal and tiles >= sms:
        return None
    twin = split_twin(spec)
    if twin is None or not split_tail.splits(tiles, key_blocks, sms, twin.split_tail_min_saving_percent,
                                             twin.split_tail_piece_blocks):
        return None
    return twin


def default_fp8_spec(head_dim: int, head_dim_v: int, out_dtype: str, causal: bool, window: bool = False,
                     power_of_two_v_scales: bool = True, v_transpose_in_kernel: bool = False,
                     seqlen_q: int | str | None = None, scores_f16_inputs: bool = True) -> KernelSpec:
    """The e4m3 forward spec for a problem (O in out_dtype): the registry's when present.
    power_of_two_v_scales=False (V's per-block scales are not all powers of two): never a lazy
    rescale, whose P would carry the blocks' inexact ratios (spec.FP8_LAZY_RESCALE_DEFAULT).
    v_transpose_in_kernel: the kernel takes V as (batch, seqlen_k, nheads, head_dim_v) and
    transposes it in shared memory (no registry kernel does). seqlen_q (a length or a bucket's
    name) picks the tiles of FP8_SEQLEN_TILES, for the plain problem (head_dim_v == head_dim, no
    window, V in the kernel's layout). scores_f16_inputs=False (Q and K not quantized within
    spec.scores_f16_qk_max(head_dim)): the same tiles with fp32 scores."""
    _canonical_problem(head_dim, head_dim_v, "bf16")
    out = _DTYPE_ALIASES.get(str(out_dtype).removeprefix("torch."))
    if out is None:
        raise ValueError(f"out_dtype={out_dtype!r} is not supported: use 'bf16' or 'fp16'")
    bucket = fp8_seqlen_bucket(head_dim, head_dim_v, causal, window, v_transpose_in_kernel, seqlen_q)
    tiles = _fp8_tiles(head_dim, causal, bucket, scores_f16_inputs)
    spec = KernelSpec(head_dim=head_dim, head_dim_v=head_dim_v, dtype="e4m3", out_dtype=out, causal=bool(causal),
                      window=bool(window), v_transpose_in_kernel=bool(v_transpose_in_kernel),
                      **{**tiles, **({} if power_of_two_v_scales else {"lazy_rescale": False})})
    name = _fp8_registry_name(head_dim, causal, bucket, tiles)
    return REGISTRY[name] if REGISTRY.get(name) == spec else spec


def default_bwd_spec(head_dim: int, head_dim_v: int, dtype: str, causal: bool, deterministic: bool = False,
                     window: bool = False, softcap: bool = False, alibi: bool = False) -> KernelSpec:
    """The backward spec (dq, dk, dv) for a problem: the registry's when present, else the
    backward defaults (deterministic=True: dQ additions in a fixed order, bit-identical runs;
    the built-in variants of the forward it differentiates)."""
    canonical = _canonical_problem(head_dim, head_dim_v, dtype)
    if head_dim_v != head_dim:
        raise ValueError(
            f"backward supports head_dim_v == head_dim only so far, got head_dim={head_dim}, "
            f"head_dim_v={head_dim_v}"
        )
    if not (deterministic or window or softcap or alibi):
        return REGISTRY[_registry_name(head_dim, canonical, bool(causal), "bwd")]
    return KernelSpec(kind="bwd", head_dim=head_dim, dtype=canonical, causal=bool(causal),
                      deterministic=bool(deterministic), window=bool(window), softcap=bool(softcap), alibi=bool(alibi))


def resolve(text: str) -> KernelSpec | Fp8PrepareSpec:
    """A spec from the command line: a registry name, a spec's full name in the registry, or JSON."""
    text = text.strip()
    if text.startswith("{"):
        from .render import spec_from_json

        return spec_from_json(text)
    specs = all_specs()
    if text in specs:
        return specs[text]
    for spec in specs.values():
        if spec.name == text:
            return spec
    raise ValueError(
        f"unknown spec {text!r}: give a registry name ({', '.join(REGISTRY)}) or a spec as JSON, "
        'e.g. \'{"head_dim": 128, "dtype": "bf16", "causal": true}\''
    )
