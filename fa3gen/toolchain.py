"""The compiler toolchain: nvcc, the CUTLASS/CuTe headers, and the one list of compile flags."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

from .render import include_dir


class ToolchainError(RuntimeError):
    """nvcc or the CUTLASS headers are missing or unusable."""


# Flags that decide the generated code; kept in one place because they are part of the cache key.
# No torch include dirs: the kernel library must not depend on torch's C++ ABI.
NVCC_FLAGS: tuple[str, ...] = (
    "-O3",
    "-std=c++17",
    "-gencode", "arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "-DNDEBUG",
    "-lineinfo",
    "-Xptxas", "-v",  # resource report (registers, smem, spills) into build.log
    "-Xcompiler", "-fPIC",
    "-shared",
)


def find_nvcc() -> Path:
    """$FA3GEN_NVCC, else nvcc on PATH, else $CUDA_HOME/bin/nvcc (then /usr/local/cuda)."""
    explicit = os.environ.get("FA3GEN_NVCC")
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise ToolchainError(f"FA3GEN_NVCC={explicit} is not an executable file")
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home) / "bin" / "nvcc"
    raise ToolchainError(
        "nvcc not found: install the CUDA toolkit (12.3+ for sm_90a) and put nvcc on PATH, "
        "or set CUDA_HOME or FA3GEN_NVCC"
    )


@functools.lru_cache(maxsize=8)
def _nvcc_version(nvcc: Path) -> str:
    try:
        proc = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise ToolchainError(f"cannot run {nvcc}: {exc}") from exc
    if proc.returncode != 0:
        raise ToolchainError(f"{nvcc} --version failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout.strip()


def nvcc_version(nvcc: Path | None = None) -> str:
    """`nvcc --version` output (release and build id), part of the cache key."""
    return _nvcc_version(nvcc or find_nvcc())


def nvcc_release(nvcc: Path | None = None) -> str:
    """Short form for humans, e.g. 'release 13.0, V13.0.88'."""
    text = nvcc_version(nvcc)
    for line in text.splitlines():
        if "release" in line:
            return line.split(",", 1)[-1].strip()
    return text.splitlines()[-1] if text else "unknown"


def _cutlass_root() -> Path:
    try:
        import cutlass_library  # the nvidia-cutlass wheel ships the C++ headers inside it
    except ImportError as exc:
        raise ToolchainError(
            "CUTLASS headers not found: `pip install nvidia-cutlass` (fa3gen uses the CuTe headers "
            "under cutlass_library/source/include)"
        ) from exc
    root = Path(cutlass_library.__file__).resolve().parent / "source"
    if not (root / "include" / "cute").is_dir():
        raise ToolchainError(f"nvidia-cutlass is installed but {root / 'include' / 'cute'} is missing")
    return root


def cutlass_include_dirs() -> list[Path]:
    root = _cutlass_root()
    return [root / "include", root / "tools" / "util" / "include"]


def cutlass_version() -> str:
    """Version of the nvidia-cutlass wheel, which pins the header contents."""
    _cutlass_root()
    try:
        return metadata.version("nvidia-cutlass")
    except metadata.PackageNotFoundError:
        return "unknown"


def include_flags() -> list[str]:
    return [f"-I{d}" for d in (include_dir(), *cutlass_include_dirs())]


def compile_flags() -> list[str]:
    """Everything nvcc gets besides the input and output paths."""
    return [*NVCC_FLAGS, *include_flags()]
