"""When a forward kernel with split_tail cuts its last wave's tiles along the keys.

One rule for the kernel (rendered into its scheduler) and the dispatcher (which takes a
registry kernel's split twin only for problems the rule splits): a split must shorten the
busiest CTA's key blocks, its share counting PIECE_BLOCKS for a piece's own costs, by
MIN_SAVING_PERCENT and give each CTA at least MIN_SHARE_BLOCKS of them. Measured (H100,
2026-12-06, scripts/compare_specs.py --shapes): problems of a wave or two gain 9-68% (hdim 128
1 x 4096 x 8 heads +18%, 128 queries over 16k keys +68%); the FA3 grid's tails of 3-5% gained
0-2% at 8k-16k and lost up to 7% at 1k, and shares of 4 key blocks lost 5%: each piece starts
its own pipeline and hands a partial over, and the split code costs a kernel that does not split
2-5% (so the registry keeps it in twins the dispatcher picks). A spec may set its own bar and
piece cost (split_tail_min_saving_percent, split_tail_piece_blocks): the registry's hdim 128
192-row twins split the FA3 grid's 8k-16k tails at 3% (1.8-3.3% faster than the plain kernels
there, H100, 2026-12-07; registry.SPLIT_TWIN_FIELDS).
"""

from __future__ import annotations

MAX_CTAS = 144  # the workspace holds one partial per CTA (Hopper parts have at most 132 SMs)
MIN_SAVING_PERCENT = 12
MIN_SHARE_BLOCKS = 8
# What a piece's own pipeline start, partial and merge cost, in key blocks, counted on the busiest
# CTA's share (H100, 2026-12-07: a wave of 112 tiles over 3072 keys, split where the share alone
# saved 8% (e4m3, 1 of 12 blocks) and 12.5% (bf16, 3 of 24), lost 7% and 15%).
PIECE_BLOCKS = 4


def splits(num_tiles: int, key_blocks: int, ctas: int, min_saving_percent: int = MIN_SAVING_PERCENT,
           piece_blocks: int = PIECE_BLOCKS) -> bool:
    """Whether a split_tail kernel on `ctas` CTAs splits a problem of num_tiles tiles of key_blocks
    key blocks each (the scheduler's rule in templates/fwd/schedule.j2). min_saving_percent and
    piece_blocks: the spec's split_tail_min_saving_percent and split_tail_piece_blocks (what a
    piece's pipeline start and merge cost, in key blocks, counted on the busiest CTA's share)."""
    rest = num_tiles % ctas
    units = rest * key_blocks
    share = -(-units // ctas)
    whole = num_tiles // ctas * key_blocks
    return (rest > 0 and ctas <= MAX_CTAS and units <= (2**31 - 1) // 2 and share >= MIN_SHARE_BLOCKS
            and (whole + share + piece_blocks) * 100 <= (whole + key_blocks) * (100 - min_saving_percent))
