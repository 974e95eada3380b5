"""The on-disk kernel cache: keys, entry layout, manifests, locks and atomic installs.

<root>/<spec.name>-<key[:16]>/   one entry: kernel.cu, kernel.so, build.log, spec.json, manifest.json
<root>/locks/<key>.lock          inter-process build locks
<root>/tmp/                      builds in progress (same filesystem as entries, so rename is atomic)
<root>/failed/                   failed builds, kept for inspection
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SOURCE = "kernel.cu"
LIBRARY = "kernel.so"
LOG = "build.log"
SPEC = "spec.json"
MANIFEST = "manifest.json"
_RESERVED = {"locks", "tmp", "failed"}


def cache_root(create: bool = True) -> Path:
    """$FA3GEN_CACHE_DIR or ~/.cache/fa3gen; private (0700) because it holds code we dlopen."""
    root = Path(os.environ.get("FA3GEN_CACHE_DIR") or Path.home() / ".cache" / "fa3gen")
    if create and not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)  # mkdir's mode is filtered by the umask; chmod is not
    return root


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def headers_digest(include_dir: Path) -> str:
    """Hash of the plain headers the source #includes: changing one must change the key."""
    h = hashlib.sha256()
    if include_dir.is_dir():
        for path in sorted(p for p in include_dir.rglob("*") if p.is_file()):
            h.update(path.relative_to(include_dir).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(
    source: str,
    headers: str,
    flags: Sequence[str],
    nvcc_version: str,
    cutlass_version: str,
    fa3gen_version: str,
) -> str:
    """sha256 over everything that decides the binary. Flags exclude -I paths (machine-specific)."""
    material = {
        "source": source,
        "headers": headers,
        "flags": list(flags),
        "nvcc": nvcc_version,
        "cutlass": cutlass_version,
        "fa3gen": fa3gen_version,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One cache entry directory; valid only when its manifest matches the files on disk."""

    path: Path

    @property
    def library(self) -> Path:
        return self.path / LIBRARY

    @property
    def source(self) -> Path:
        return self.path / SOURCE

    @property
    def log(self) -> Path:
        return self.path / LOG

    def manifest(self) -> dict | None:
        try:
            data = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None  # missing or truncated
        return data if isinstance(data, dict) else None

    def is_valid(self) -> bool:
        manifest = self.manifest()
        if not manifest or not isinstance(manifest.get("files"), dict):
            return False
        files = manifest["files"]
        if LIBRARY not in files:
            return False
        try:
            for name, info in files.items():
                path = self.path / name
                if path.stat().st_size != info["size"] or _sha256_file(path) != info["sha256"]:
                    return False
        except (OSError, KeyError, TypeError):
            return False
        return True


def entry_for(root: Path, name: str, key: str) -> Entry:
    return Entry(root / f"{name}-{key[:16]}")


def find_by_source(root: Path, name: str, source: str, headers: str, fa3gen_version: str) -> Entry | None:
    """A valid entry built from exactly this source and headers (for use without a compiler)."""
    for entry in sorted(root.glob(f"{name}-*")):
        e = Entry(entry)
        manifest = e.manifest() or {}
        if (
            manifest.get("headers") == headers
            and manifest.get("fa3gen_version") == fa3gen_version
            and isinstance(manifest.get("key"), str)
            and e.source.is_file()
            and e.source.read_text() == source
            and e.is_valid()
        ):
            return e
    return None


def write_manifest(directory: Path, **info: object) -> None:
    """Written last, via rename, so its presence means every other file is complete."""
    files = {
        p.name: {"sha256": _sha256_file(p), "size": p.stat().st_size}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name in (SOURCE, LIBRARY, LOG, SPEC)
    }
    manifest = {**info, "created": time.time(), "files": files}
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)


def make_build_dir(root: Path, name: str) -> Path:
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))


def install(build_dir: Path, entry: Entry) -> Entry:
    """Move a finished build into place atomically; if a valid entry is already there, keep it."""
    try:
        os.rename(build_dir, entry.path)
        return entry
    except OSError:
        if entry.is_valid():  # another process won the race: theirs is as good as ours
            shutil.rmtree(build_dir, ignore_errors=True)
            return entry
    remove(entry)  # a corrupted entry is in the way
    os.rename(build_dir, entry.path)
    return entry


def remove(entry: Entry) -> None:
    """Delete an entry without a window where a reader sees it half-deleted: rename it away first."""
    tmp = entry.path.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    discard = Path(tempfile.mkdtemp(prefix="stale-", dir=tmp))
    try:
        os.rename(entry.path, discard / "entry")
    except FileNotFoundError:
        pass
    shutil.rmtree(discard, ignore_errors=True)


def keep_failed(root: Path, build_dir: Path, name: str, key: str) -> Path:
    """Park a failed build where a human can read its source and log."""
    failed = root / "failed"
    failed.mkdir(exist_ok=True)
    target = failed / f"{name}-{key[:16]}"
    shutil.rmtree(target, ignore_errors=True)
    os.rename(build_dir, target)
    return target


@contextlib.contextmanager
def entry_lock(root: Path, key: str) -> Iterator[None]:
    """Exclusive inter-process lock for building one key (released if the process dies)."""
    locks = root / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{key}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def list_entries(root: Path | None = None) -> list[Entry]:
    root = root or cache_root(create=False)
    if not root.is_dir():
        return []
    return [Entry(p) for p in sorted(root.iterdir()) if p.is_dir() and p.name not in _RESERVED]


def clear(root: Path | None = None) -> int:
    """Remove every entry, failed and temporary build; locks stay (a builder may hold one)."""
    root = root or cache_root(create=False)
    entries = list_entries(root)
    for entry in entries:
        shutil.rmtree(entry.path, ignore_errors=True)
    for sub in ("tmp", "failed"):
        shutil.rmtree(root / sub, ignore_errors=True)
    return len(entries)
