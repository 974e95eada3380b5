"""fa3gen.sass on SASS text in cuobjdump's format: the loop it picks and the waits it counts."""

from __future__ import annotations

from fa3gen.sass import instructions, key_block_loop, wait_placement

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
