"""The `fa3gen` command line: list, render, build, cache, doctor, bench, demo."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import cache, registry
from .prepare_spec import Fp8PrepareSpec
from .spec import KernelSpec

_DEMO_TOLERANCE = 0.05  # max abs error vs fp32 SDPA: bf16 rounding gives ~1e-3, a wrong kernel ~1
_NO_GPU = "no CUDA GPU: running kernels needs a Hopper (sm_90) GPU"


def _repo_generated_dir() -> Path:
    """generated/ of the source checkout; ./generated when fa3gen is installed elsewhere."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").is_file() and (repo / "templates").is_dir():
        return repo / "generated"
    return Path("generated")


def _specs(args: argparse.Namespace) -> list[tuple[str, KernelSpec | Fp8PrepareSpec]]:
    if args.all:
        return list(registry.all_specs().items())
    if not args.spec:
        raise SystemExit("give a SPEC (registry name or JSON) or --all")
    spec = registry.resolve(args.spec)
    return [(registry.display_name(spec), spec)]


def _cmd_list(args: argparse.Namespace) -> int:
    print(f"{'name':<24} {'tile (MxN)':>10} {'stages':>6} {'WGs':>3} {'smem':>10}  spec name")
    for name, spec in registry.REGISTRY.items():
        tile = f"{spec.block_m}x{spec.block_n}"
        print(
            f"{name:<24} {tile:>10} {spec.stages:>6} {spec.num_consumer_warpgroups:>3} "
            f"{spec.smem_bytes / 1024:>8.1f}KB  {spec.name}"
        )
    print(f"\n{'fp8 prepare kernels':<24} {'input':>10} {'Hadamard block':>15}")
    for name, spec in registry.PREPARE_REGISTRY.items():
        print(f"{name:<24} {spec.input_dtype:>10} {spec.hadamard_block:>15}")
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from .render import render

    out = Path(args.out) if args.out else (_repo_generated_dir() if args.all else None)
    for name, spec in _specs(args):
        source = render(spec)
        if out is None:
            sys.stdout.write(source)
            continue
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{name}.cu"
        path.write_text(source)
        print(f"wrote {path}")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    from .build import BuildError, JitDisabledError, build_many
    from .toolchain import ToolchainError

    specs = [spec for _, spec in _specs(args)]
    start = time.perf_counter()
    try:
        results = build_many(specs, jobs=args.jobs, progress=lambda line: print(line, flush=True))
    except (BuildError, JitDisabledError, ToolchainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"\n{'spec':<32} {'time':>8}  entry")
    for r in results:
        when = "cached" if r.cached else f"{r.seconds:.1f} s"
        print(f"{registry.display_name(r.spec):<32} {when:>8}  {r.entry_dir}")
    print(f"{len(results)} spec(s) in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    root = cache.cache_root(create=False)
    if args.action == "clear":
        print(f"removed {cache.clear(root)} entries from {root}")
        return 0
    entries = cache.list_entries(root)
    print(f"cache: {root} ({len(entries)} entries)")
    for entry in entries:
        manifest = entry.manifest() or {}
        state = "ok" if entry.is_valid() else "CORRUPT"
        size = sum(f.stat().st_size for f in entry.path.iterdir() if f.is_file())
        built = manifest.get("build_seconds")
        built_text = f"{built:.1f} s" if isinstance(built, (int, float)) else "?"
        print(f"  {entry.path.name:<56} {state:<7} {size / 1e6:>7.2f} MB  built in {built_text}")
    return 0


def _gpu_line() -> tuple[str, bool]:
    """(description, is_hopper)."""
    try:
        import torch
    except ImportError:
        return "torch not installed", False
    if not torch.cuda.is_available():
        return _NO_GPU, False
    cap = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})", cap == (9, 0)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from . import __version__, toolchain
    from .render import templates_dir

    ok = True

    def check(label: str, fn) -> None:
        nonlocal ok
        try:
            print(f"{label:<10} {fn()}")
        except Exception as exc:  # doctor reports every problem instead of stopping at the first
            ok = False
            print(f"{label:<10} MISSING: {exc}")

    print(f"{'fa3gen':<10} {__version__}")
    check("nvcc", lambda: f"{toolchain.find_nvcc()} ({toolchain.nvcc_release()})")
    check("cutlass", lambda: f"{toolchain.cutlass_version()} headers at {toolchain.cutlass_include_dirs()[0]}")
    check("templates", templates_dir)
    print(f"{'cache':<10} {cache.cache_root(create=False)}")
    try:
        import torch

        print(f"{'torch':<10} {torch.__version__}")
    except ImportError:
        print(f"{'torch':<10} not installed")
    print(f"{'gpu':<10} {_gpu_line()[0]}")
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .build import ptxas_report
    from .kernel import compile

    name = registry.REPRESENTATIVE
    spec = registry.REGISTRY[name]
    print(f"spec {name}: {spec.canonical_json()}")
    start = time.perf_counter()
    kernel = compile(spec)
    result = kernel.build_result
    how = "cache hit" if result.cached else f"compiled in {result.seconds:.1f} s"
    print(f"kernel {kernel.library_path} ({how}, ready in {time.perf_counter() - start:.1f} s)")
    for info in ptxas_report(kernel):
        print(f"ptxas: {info.summary()}")

    _, hopper = _gpu_line()
    if not hopper:
        print("No Hopper GPU found: kernel compiled, running it needs an sm_90 GPU")
        return 0
    import torch
    import torch.nn.functional as F

    from . import flash_attn_func

    b, s, h, d = 2, 1024, 8, spec.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = flash_attn_func(q, k, v)
    ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    err = (out.float() - ref).abs().max().item()
    print(f"flash_attn_func {tuple(q.shape)} bf16 on {torch.cuda.get_device_name()}: "
          f"max |out - sdpa_fp32| = {err:.3e}")
    if not err <= _DEMO_TOLERANCE:  # also catches NaN
        print(f"MISMATCH: error above {_DEMO_TOLERANCE} (bf16 rounding alone stays well below it)")
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fa3gen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="the prebuilt registry: names, tiles, shared memory")

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", nargs="?", help="registry name or spec JSON")
        p.add_argument("--all", action="store_true", help="every registry spec")

    p = sub.add_parser("render", help="write the CUDA source of specs")
    spec_args(p)
    p.add_argument("--out", help="directory for <name>.cu (default: stdout; generated/ with --all)")

    p = sub.add_parser("build", help="compile specs into the cache (in parallel)")
    spec_args(p)
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc (default: min(#specs, CPUs))")

    p = sub.add_parser("cache", help="list or clear the kernel cache")
    p.add_argument("action", choices=["ls", "clear"])

    sub.add_parser("doctor", help="check nvcc, CUTLASS headers, cache dir, torch and the GPU")
    sub.add_parser("bench", help="benchmark against torch SDPA (see `fa3gen bench --help`)", add_help=False)
    sub.add_parser("demo", help="compile the representative spec and run it if a Hopper GPU is present")
    return parser


_COMMANDS = {
    "list": _cmd_list,
    "render": _cmd_render,
    "build": _cmd_build,
    "cache": _cmd_cache,
    "doctor": _cmd_doctor,
    "demo": _cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # bench owns its own arguments
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = _parser().parse_args(argv)
    if getattr(args, "all", False) and getattr(args, "spec", None):
        _parser().error("give either SPEC or --all, not both")
    try:
        return _COMMANDS[args.command](args)
    except ValueError as exc:  # a bad SPEC (unknown name, invalid JSON or limits)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
