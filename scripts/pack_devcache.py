"""Packs the cache entries of a set of kernel specs into one archive for a device call to carry.

Compile on the CPU machine into FA3GEN_CACHE_DIR (e.g. .devcache), then carry only the entries the
call needs: a GPU test whose kernels are not in the carried cache compiles them on the device, once
per pytest process, which can eat a whole call. Entries are found by each spec's current cache key,
so stale entries of earlier templates are left out.

Usage: FA3GEN_CACHE_DIR=.devcache python scripts/pack_devcache.py [--build] [-j 2] [--out .devcache.tar.xz] SOURCE [SOURCE ...]
  SOURCE: "gpu" (every spec the GPU work needs, scripts/gpu_specs.py), "grid" (the FA3 grid's forward
          kernels and split twins that `fa3gen bench` and bench_fp8 run), "registry", a registry name,
          a spec as JSON, or @FILE (one spec JSON per line)
On the device: tar xJf .devcache.tar.xz, then FA3GEN_CACHE_DIR=$PWD/.devcache.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import fa3gen  # noqa: E402
from fa3gen import registry  # noqa: E402
from fa3gen.render import BuildSpec, spec_from_json  # noqa: E402


def specs_of(source: str) -> list[BuildSpec]:
    if source == "gpu":
        from gpu_specs import gpu_specs

        return gpu_specs()
    if source == "grid":
        from gpu_specs import grid_specs

        return grid_specs()
    if source == "registry":
        return list(registry.all_specs().values())
    if source.startswith("@"):
        return [spec_from_json(line) for line in Path(source[1:]).read_text().splitlines() if line.strip()]
    return [registry.resolve(source)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+")
    ap.add_argument("--build", action="store_true", help="compile the specs missing from the cache first")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=".devcache.tar.xz")
    args = ap.parse_args(argv)
    specs: list[BuildSpec] = []
    for source in args.sources:
        specs += [s for s in specs_of(source) if s not in specs]
    if args.build:
        fa3gen.build_many(specs, jobs=args.jobs, progress=lambda line: print(line, flush=True))
    build = importlib.import_module("fa3gen.build")  # the module, not fa3gen.build()
    entries, missing = [], []
    for spec in specs:
        entry = build.plan(spec).entry
        (entries if entry.is_valid() else missing).append(entry.path)
    for path in missing:
        print(f"not in the cache (the device would compile it): {path.name}")
    if not entries:
        print("nothing to pack")
        return 1
    root = entries[0].parent
    names = sorted({p.name for p in entries})
    # xz -1 on all cores: seconds for the ~50 MB of libraries, about a quarter of it carried.
    subprocess.run(["tar", "-c", "-I", "xz -T0 -1", "-f", args.out, "-C", str(root.parent),
                    *[f"{root.name}/{n}" for n in names]], check=True)
    print(f"{args.out}: {len(names)} entries of {len(specs)} specs, {Path(args.out).stat().st_size / 1e6:.1f} MB"
          + (f"; {len(missing)} missing" if missing else ""))
    return 0 if not missing else 2


if __name__ == "__main__":
    sys.exit(main())
