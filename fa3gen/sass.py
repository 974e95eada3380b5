"""Reading a compiled kernel's SASS (cuobjdump): what ptxas made of the generated code.

The real-compile tests check instructions in it, and scripts/sass_waits.py reports where the
forward key-block loop waits for its previous P·V relative to the softmax's exp2 (pin_pv_wait)
and how many fixed-latency stall cycles ptxas scheduled on a full key block's path.
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
# ... and its two 64-bit words, which cuobjdump prints after it, the second on the next line.
_ENCODED_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);\s*/\* 0x[0-9a-f]{16} \*/\s*/\* (0x[0-9a-f]{16}) \*/")
_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")  # a branch and its target
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


def _key_block_loop_span(code: list[tuple[int, str]], min_exp2: int) -> tuple[int, int] | None:
    """[first, last + 1) of the smallest loop (a backward branch's body) with min_exp2 exp2."""
    addresses = [address for address, _ in code]
    spans = []
    for end, (address, text) in enumerate(code):
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = bisect_left(addresses, int(branch.group(1), 16))
            if sum(EXP2 in t for _, t in code[start:end + 1]) >= min_exp2:
                spans.append((start, end + 1))
    return min(spans, key=lambda span: span[1] - span[0], default=None)


def key_block_loop(sass: str, min_exp2: int = 16) -> list[str]:
    """The instructions of the smallest loop (a backward branch's body) that holds at least
    min_exp2 exp2: the forward consumer's key-block loop, the backward's step loop. Empty if none."""
    code = instructions(sass)
    span = _key_block_loop_span(code, min_exp2)
    return [t for _, t in code[span[0]:span[1]]] if span else []


@dataclass(frozen=True)
class Scheduled:
    """An instruction with the cycles ptxas makes its warp wait before the next one issues (the
    stall count of its control bits: fixed-latency dependencies, which ncu counts as "wait")."""

    address: int
    text: str
    stall_cycles: int


def scheduled(sass: str) -> list[Scheduled]:
    """Every instruction with its stall count (bits 105-108 of the 128-bit encoding: 41-44 of the
    second word)."""
    return [Scheduled(int(m.group(1), 16), m.group(2).strip(), (int(m.group(3), 16) >> 41) & 0xF)
            for m in _ENCODED_INSTRUCTION.finditer(sass)]


def full_block_path(sass: str, min_exp2: int = 16) -> list[Scheduled]:
    """The forward key-block loop (as key_block_loop) without the code that its largest in-loop
    forward branch skips: in a not-causal loop, the path of every block but a ragged last one,
    whose key mask that branch guards. Empty if there is no such loop."""
    code = scheduled(sass)
    span = _key_block_loop_span([(ins.address, ins.text) for ins in code], min_exp2)
    if span is None:
        return []
    body = code[span[0]:span[1]]
    skips = [(ins.address, int(branch.group(1), 16)) for ins in body
             if (branch := _BRANCH.search(ins.text)) and ins.address < int(branch.group(1), 16) <= body[-1].address]
    if not skips:
        return body
    branch, target = max(skips, key=lambda skip: skip[1] - skip[0])
    return [ins for ins in body if not branch < ins.address < target]


def stall_cycles(path: list[Scheduled]) -> int:
    """The cycles a warp running `path` alone needs by its stall counts (1: the next instruction
    issues in the next cycle)."""
    return sum(ins.stall_cycles for ins in path)


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
