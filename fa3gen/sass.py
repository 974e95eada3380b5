"""Reading a compiled kernel's SASS (cuobjdump): what ptxas made of the generated code.

The real-compile tests check instructions in it, and scripts/sass_waits.py reports where the
forward key-block loop waits for its previous P·V relative to the softmax's exp2 (pin_pv_wait).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

# "/*01b0*/   MUFU.EX2 R18, R6 ;": an instruction's address and its text.
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BACKWARD_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")
EXP2 = "MUFU.EX2"
WAIT_ALL_WGMMA = "WARPGROUP.DEPBAR.LE gsb0, 0x0"  # wgmma.wait_group 0


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, beside nvcc, in /usr/local/cuda*, or from the nvidia-cuda-cuobjdump wheel."""
    from .toolchain import find_nvcc

    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc().resolve()
    # /usr/local/bin/nvcc may be a wrapper script: look in the toolkits next to it, and in the
    # wheel (the [test] extra) that brings cuobjdump to machines without a toolkit.
    wheel_bins = [Path(p) / "nvidia" / "cu13" / "bin" / "cuobjdump" for p in sys.path if p]
    candidates = [nvcc.parent / "cuobjdump", *Path("/usr/local").glob("cuda*/bin/cuobjdump"), *wheel_bins]
    return next((str(c) for c in candidates if c.is_file()), None)


def dump_sass(library: Path, tool: str) -> str:
    """The SASS of every kernel in a compiled library."""
    # cuobjdump runs nvdisasm for --dump-sass: let it find the one beside it.
    env = {**os.environ, "PATH": f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([tool, "--dump-sass", str(library)], capture_output=True, text=True, check=True,
                          env=env).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction, in order."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in _INSTRUCTION.finditer(sass)]


def key_block_loop(sass: str, min_exp2: int = 16) -> list[str]:
    """The instructions of the smallest loop (a backward branch's body) that holds at least
    min_exp2 exp2: the forward consumer's key-block loop, the backward's step loop. Empty if none."""
    code = instructions(sass)
    addresses = [address for address, _ in code]
    loops = []
    for end, (address, text) in enumerate(code):
        branch = _BACKWARD_BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for _, t in code[bisect_left(addresses, int(branch.group(1), 16)):end + 1]]
            if sum(EXP2 in t for t in body) >= min_exp2:
                loops.append(body)
    return min(loops, key=len, default=[])


@dataclass(frozen=True)
class WaitPlacement:
    """Where a loop's waits for all WGMMAs sit among its exp2."""

    exp2: int  # exp2 in the loop
    exp2_before_waits: tuple[int, ...]  # for each full wait, how many exp2 precede it

    def summary(self) -> str:
        return f"{self.exp2} exp2; waits for all WGMMAs after " + ", ".join(map(str, self.exp2_before_waits))


def wait_placement(loop: list[str]) -> WaitPlacement:
    exp2 = 0
    before = []
    for text in loop:
        exp2 += EXP2 in text
        if WAIT_ALL_WGMMA in text:
            before.append(exp2)
    return WaitPlacement(exp2, tuple(before))
