"""JIT build: render a spec, compile it with nvcc under ninja, install it into the cache.

Several specs build in parallel (one ninja per spec, in a thread pool); an inter-process lock
per cache key makes N processes asking for one spec compile it once.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import __version__, cache, toolchain
from .render import BuildSpec, include_dir, render


class BuildError(RuntimeError):
    """nvcc (or ninja) failed; the message carries nvcc's errors and the generated source's path."""


class JitDisabledError(RuntimeError):
    """FA3GEN_NO_JIT is set and the spec's kernel is not in the cache."""


class SerializedWgmmaWarning(UserWarning):
    """ptxas serialized a kernel's WGMMAs (each waits for the one before): it runs, correctly, at
    a fraction of its speed. Usually too many registers live across the GEMMs."""


def jit_disabled() -> bool:
    return os.environ.get("FA3GEN_NO_JIT", "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Plan:
    """A spec rendered and keyed: everything needed to find or build its cache entry."""

    spec: BuildSpec
    source: str
    headers: str  # digest of the plain headers the source includes
    key: str
    root: Path

    @property
    def entry(self) -> cache.Entry:
        return cache.entry_for(self.root, self.spec.name, self.key)


@dataclass(frozen=True)
class BuildResult:
    spec: BuildSpec
    entry: cache.Entry
    key: str
    seconds: float  # compile time; 0.0 for a cache hit
    cached: bool

    @property
    def entry_dir(self) -> Path:
        return self.entry.path


def plan(spec: BuildSpec) -> Plan:
    source = render(spec)
    headers = cache.headers_digest(include_dir())
    root = cache.cache_root()
    try:
        nvcc = toolchain.find_nvcc()
        key = cache.cache_key(
            source=source,
            headers=headers,
            flags=toolchain.NVCC_FLAGS,
            nvcc_version=toolchain.nvcc_version(nvcc),
            cutlass_version=toolchain.cutlass_version(),
            fa3gen_version=__version__,
        )
    except toolchain.ToolchainError:
        # No compiler here (e.g. a deployment with a prebuilt cache): the key cannot be computed,
        # but an entry built from this exact source and headers is the kernel we want.
        entry = cache.find_by_source(root, spec.name, source, headers, __version__)
        if entry is not None:
            return Plan(spec=spec, source=source, headers=headers, key=entry.manifest()["key"], root=root)
        if jit_disabled():
            raise _no_jit_error(spec, root) from None
        raise
    return Plan(spec=spec, source=source, headers=headers, key=key, root=root)


# ---- ninja ----

def _ninja_command() -> list[str]:
    try:
        import ninja  # the pip package ships the binary

        binary = Path(ninja.BIN_DIR) / "ninja"
        if binary.is_file():
            return [str(binary)]
        return [sys.executable, "-m", "ninja"]
    except ImportError:
        found = shutil.which("ninja")
        if found:
            return [found]
        raise toolchain.ToolchainError("ninja not found: `pip install ninja`") from None


def _write_ninja(build_dir: Path, nvcc: Path, flags: list[str]) -> None:
    # nvcc's stdout+stderr (including the ptxas -v report) go to build.log, kept with the entry.
    # Arguments are shell-quoted (ninja runs the command through sh) and '$' is ninja's escape.
    command = " ".join(shlex.quote(a).replace("$", "$$") for a in [str(nvcc), *flags])
    text = (
        "ninja_required_version = 1.3\n\n"
        "rule nvcc\n"
        f"  command = {command} -o $out $in > {cache.LOG} 2>&1\n"
        "  description = nvcc $out\n\n"
        f"build {cache.LIBRARY}: nvcc {cache.SOURCE}\n"
        f"default {cache.LIBRARY}\n"
    )
    (build_dir / "build.ninja").write_text(text)


def _error_excerpt(log: str, limit: int = 40) -> str:
    """nvcc's error lines, each with the two lines after it (source line and caret)."""
    lines = log.splitlines()
    hits = [i for i, line in enumerate(lines) if re.search(r"\berror\b|fatal", line, re.IGNORECASE)]
    keep = sorted({j for i in hits for j in range(i, min(i + 3, len(lines)))})
    excerpt = [lines[j] for j in keep] or lines[-limit:]
    return "\n".join(excerpt[:limit])


def _compile(p: Plan) -> BuildResult:
    """Build one planned spec into a fresh dir under the cache root and install it."""
    start = time.perf_counter()
    nvcc = toolchain.find_nvcc()
    build_dir = cache.make_build_dir(p.root, p.spec.name)
    (build_dir / cache.SOURCE).write_text(p.source)
    (build_dir / cache.SPEC).write_text(p.spec.canonical_json() + "\n")
    _write_ninja(build_dir, nvcc, toolchain.compile_flags())
    proc = subprocess.run(
        [*_ninja_command(), "-C", str(build_dir)], capture_output=True, text=True
    )
    if proc.returncode != 0 or not (build_dir / cache.LIBRARY).is_file():
        log_path = build_dir / cache.LOG
        log = log_path.read_text(errors="replace") if log_path.is_file() else proc.stdout + proc.stderr
        failed = cache.keep_failed(p.root, build_dir, p.spec.name, p.key)
        raise BuildError(
            f"nvcc failed to compile spec {p.spec.name}:\n{_error_excerpt(log)}\n"
            f"generated source: {failed / cache.SOURCE}\n"
            f"full log: {failed / cache.LOG}"
        )
    seconds = time.perf_counter() - start
    cache.write_manifest(
        build_dir,
        key=p.key,
        headers=p.headers,
        spec_name=p.spec.name,
        spec=p.spec.model_dump(mode="json"),
        build_seconds=round(seconds, 3),
        fa3gen_version=__version__,
        nvcc=toolchain.nvcc_release(nvcc),
        cutlass=toolchain.cutlass_version(),
    )
    entry = cache.install(build_dir, p.entry)
    for info in ptxas_report(entry):
        if info.wgmma_serialized:
            warnings.warn(f"fa3gen: ptxas serialized the WGMMAs of {p.spec.name}'s {info.function} "
                          f"({info.wgmma_serialized}): it computes correctly but at a fraction of its speed "
                          f"(generated source: {entry.path / cache.SOURCE})", SerializedWgmmaWarning, stacklevel=2)
    return BuildResult(p.spec, entry, p.key, seconds, cached=False)


def _no_jit_error(spec: BuildSpec, root: Path) -> JitDisabledError:
    return JitDisabledError(
        f"FA3GEN_NO_JIT is set and kernel {spec.name} is not in the cache {root}.\n"
        f"spec: {spec.canonical_json()}\n"
        "Prebuild it (`fa3gen build '<spec json>'`) or unset FA3GEN_NO_JIT."
    )


def build(spec: BuildSpec) -> BuildResult:
    """The spec's cache entry: found valid, or compiled (once across processes) and installed."""
    p = plan(spec)
    if p.entry.is_valid():
        return BuildResult(spec, p.entry, p.key, 0.0, cached=True)
    if jit_disabled():
        raise _no_jit_error(spec, p.root)
    with cache.entry_lock(p.root, p.key):
        if p.entry.is_valid():  # another process built it while we waited
            return BuildResult(spec, p.entry, p.key, 0.0, cached=True)
        return _compile(p)


def build_many(
    specs: Iterable[BuildSpec],
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BuildResult]:
    """Build specs in parallel (default min(#specs, CPUs) nvcc at once), in input order.

    Every spec is attempted; if any failed, one BuildError lists all failures at the end.
    """
    specs = list(dict.fromkeys(specs))  # a spec asked twice builds once
    if not specs:
        return []
    jobs = max(1, jobs or min(len(specs), os.cpu_count() or 1))
    say = progress or (lambda line: None)
    total = len(specs)

    def one(index: int, spec: BuildSpec) -> BuildResult | Exception:
        tag = f"[{index + 1}/{total}] {spec.name}"
        say(f"{tag}: building")
        try:
            result = build(spec)
        except (BuildError, JitDisabledError, toolchain.ToolchainError) as exc:
            say(f"{tag}: FAILED")
            return exc
        say(f"{tag}: {'cached' if result.cached else f'built in {result.seconds:.1f} s'}")
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(one, range(total), specs))
    failures = [o for o in outcomes if isinstance(o, Exception)]
    if failures:
        if len(failures) == 1:
            raise failures[0]
        raise BuildError(f"{len(failures)} of {total} specs failed:\n\n" + "\n\n".join(map(str, failures)))
    return [o for o in outcomes if isinstance(o, BuildResult)]


# ---- ptxas resource report ----

@dataclass(frozen=True)
class PtxasInfo:
    """Resources of one kernel (entry function) as ptxas -v reported them."""

    function: str
    arch: str
    registers: int
    smem_bytes: int  # static shared memory only; dynamic smem is set at launch
    spill_stores: int
    spill_loads: int
    stack_frame: int
    barriers: int
    wgmma_serialized: str | None = None  # ptxas's reason, when it serialized the WGMMAs (C7512)

    def summary(self) -> str:
        return (
            f"{self.function} ({self.arch}): {self.registers} registers, {self.smem_bytes} B static smem, "
            f"{self.spill_stores} B spill stores, {self.spill_loads} B spill loads, "
            f"{self.stack_frame} B stack frame"
            + (f", WGMMA SERIALIZED ({self.wgmma_serialized})" if self.wgmma_serialized else "")
        )


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"Used (\d+) registers")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_SERIALIZED_RE = re.compile(r"wgmma\.mma_async instructions are serialized due to (.+?) for the function '([^']+)'")


def parse_ptxas(log: str) -> list[PtxasInfo]:
    """Parse `ptxas info` lines; one record per entry function, in report order."""
    frames: dict[str, tuple[int, int, int]] = {}
    serialized = {m.group(2): m.group(1) for m in _SERIALIZED_RE.finditer(log)}
    records: list[dict] = []
    current: dict | None = None
    pending_props: str | None = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            current = {"function": m.group(1), "arch": m.group(2)}
            records.append(current)
        elif m := _PROPS_RE.search(line):
            pending_props = m.group(1)
        elif (m := _FRAME_RE.search(line)) and pending_props:
            frames[pending_props] = tuple(int(g) for g in m.groups())  # type: ignore[assignment]
            pending_props = None
        elif (m := _USED_RE.search(line)) and current is not None and "registers" not in current:
            current["registers"] = int(m.group(1))
            b, s = _BARRIERS_RE.search(line), _SMEM_RE.search(line)
            current["barriers"] = int(b.group(1)) if b else 0
            current["smem_bytes"] = int(s.group(1)) if s else 0
    out = []
    for r in records:
        stack, stores, loads = frames.get(r["function"], (0, 0, 0))
        out.append(
            PtxasInfo(
                function=r["function"], arch=r["arch"], registers=r.get("registers", 0),
                smem_bytes=r.get("smem_bytes", 0), spill_stores=stores, spill_loads=loads,
                stack_frame=stack, barriers=r.get("barriers", 0),
                wgmma_serialized=serialized.get(r["function"]),
            )
        )
    return out


def ptxas_report(entry: cache.Entry | BuildResult | Path | object) -> list[PtxasInfo]:
    """Resource report of every kernel in a cache entry (an Entry, a BuildResult, a
    CompiledKernel or an entry directory)."""
    path = getattr(entry, "entry_dir", None) or getattr(entry, "path", None) or entry
    return parse_ptxas((Path(path) / cache.LOG).read_text(errors="replace"))
