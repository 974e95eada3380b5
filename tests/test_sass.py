"""fa3gen.sass on SASS text in cuobjdump's format: the loop it picks and the waits it counts."""

from __future__ import annotations

from fa3gen.sass import full_block_path, instructions, key_block_loop, scheduled, stall_cycles, wait_placement

_LINE = "        /*{:04x}*/                   {} ;                  /* 0x000fe20000000900 */\n"


def _sass(body: list[str]) -> str:
    return "\t\tFunction : k\n" + "".join(_LINE.format(16 * i, text) for i, text in enumerate(body))


def _loop_of(exp2: int, wait_after: int, tag: str) -> list[str]:
    """A loop of `exp2` MUFU.EX2 with the wait for all WGMMAs after `wait_after` of them."""
    body = [f"UMOV UR4, {tag}"]
    for i in range(exp2):
        if i == wait_after:
            body.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
        body += [f"FFMA.FTZ R{i}, R{i}, R1, R2", f"MUFU.EX2 R{i}, R{i}"]
    if wait_after >= exp2:
        body.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    return body


def test_key_block_loop_is_the_smallest_loop_with_the_exp2():
    outer_head = ["IMAD.MOV.U32 R0, RZ, RZ, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    inner = _loop_of(20, 4, "inner")
    n_outer, n_inner = len(outer_head), len(inner)
    code = outer_head + inner
    code.append(f"@P0 BRA 0x{16 * n_outer:x}")  # closes the inner loop
    code += _loop_of(2, 2, "epilogue")  # too few exp2 for a key-block loop
    code.append("@P1 BRA 0x0")  # closes the outer loop, which holds everything
    code.append("EXIT")
    sass = _sass(code)
    assert len(instructions(sass)) == len(code) and instructions(sass)[1] == (16, "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    loop = key_block_loop(sass)
    assert loop[0] == "UMOV UR4, inner" and len(loop) == n_inner + 1
    placement = wait_placement(loop)
    assert placement.exp2 == 20 and placement.exp2_before_waits == (4,)
    assert placement.summary() == "20 exp2; waits for all WGMMAs after 4"
    assert wait_placement(_loop_of(8, 8, "pinned")).exp2_before_waits == (8,)
    assert key_block_loop(_sass(_loop_of(30, 0, "straight"))) == []  # no backward branch: no loop


def _encoded(body: list[tuple[str, int]]) -> str:
    """cuobjdump's two lines per instruction, the second word carrying the stall count."""
    lines = [f"        /*{16 * i:04x}*/                   {text} ;      /* 0x0000000000007919 */\n"
             f"                                                         /* 0x{stall << 41 | 0x000fe00000000000:016x} */\n"
             for i, (text, stall) in enumerate(body)]
    return "\t\tFunction : k\n" + "".join(lines)


def test_full_block_path_leaves_out_the_mask_and_sums_the_stalls():
    head = [("S2R R0, SR_TID.X", 15)]  # before the loop: not counted
    loop = [("UMOV UR4, 0x1", 1), ("@!P1 BRA 0x{mask_end:x}", 2)]
    mask = [("FSEL R5, R5, -INF, P2", 9)] * 3  # the ragged last block's key mask, skipped by full blocks
    loop_rest = [(f"MUFU.EX2 R{i}, R{i}", 2) for i in range(16)] + [("@!P3 BRA 0x400", 5)]  # a wait loop outside
    start = len(head)
    mask_end = 16 * (start + len(loop) + len(mask))
    body = head + [(t.format(mask_end=mask_end), c) for t, c in loop] + mask + loop_rest
    body.append((f"@P0 BRA 0x{16 * start:x}", 4))  # closes the key-block loop
    body.append(("EXIT", 5))
    code = scheduled(_encoded(body))
    assert [c.stall_cycles for c in code] == [c for _, c in body]
    assert [(c.address, c.text) for c in code] == instructions(_encoded(body))
    path = full_block_path(_encoded(body))
    assert [c.text for c in path][:2] == ["UMOV UR4, 0x1", f"@!P1 BRA 0x{mask_end:x}"] and not any("FSEL" in c.text for c in path)
    assert len(path) == len(loop) + len(loop_rest) + 1
    assert stall_cycles(path) == 1 + 2 + 16 * 2 + 5 + 4
    assert full_block_path(_encoded([("MUFU.EX2 R0, R0", 1)] * 20)) == []  # no loop
