"""Where each cached kernel's loop waits for all its WGMMAs, counted in the softmax's exp2, and
the fixed-latency stall cycles ptxas scheduled on a full key block's path.

For every valid entry of the kernel cache ($FA3GEN_CACHE_DIR or ~/.cache/fa3gen) whose name
matches the filters, finds the smallest loop with the softmax's exp2 in its SASS (the forward's
key-block loop, the backward's step loop) and prints how many exp2 it has and how many precede
each wait for all WGMMAs. In the forward that wait is the one for the previous key block's P·V:
at 0 the softmax runs after that GEMM, not under it (pin_pv_wait moves it; BENCHMARKS.md).

Usage: python scripts/sass_waits.py [--match fwd_d128] [--match e4m3 ...]   # all must match
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fa3gen import cache  # noqa: E402
from fa3gen.sass import dump_sass, find_cuobjdump, full_block_path, key_block_loop, stall_cycles, wait_placement  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", action="append", default=[], help="a substring the kernel's name must hold")
    args = parser.parse_args(argv)
    tool = find_cuobjdump()
    if tool is None:
        print("cuobjdump not found (CUDA toolkit or the nvidia-cuda-cuobjdump wheel)", file=sys.stderr)
        return 2
    shown = 0
    for entry in cache.list_entries():
        name = (entry.manifest() or {}).get("spec_name", entry.path.name)
        if not all(m in name for m in args.match) or not entry.is_valid():
            continue
        sass = dump_sass(entry.library, tool)
        loop, path = key_block_loop(sass), full_block_path(sass)
        print(f"{name}: " + (f"{wait_placement(loop).summary()}; a full block's path {len(path)} instructions, "
                             f"{stall_cycles(path)} stall cycles" if loop else "no loop with exp2"))
        shown += 1
    if not shown:
        print(f"no cached kernel matches {args.match} in {cache.cache_root(create=False)}", file=sys.stderr)
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
