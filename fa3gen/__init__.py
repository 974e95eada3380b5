"""fa3gen: declarative FlashAttention-3 style attention kernels for Hopper.

KernelSpec -> render (Jinja) -> build (nvcc, cached) -> compile() -> flash_attn_func (torch).
"""

from __future__ import annotations

__version__ = "0.1.0"  # part of every cache key; keep equal to pyproject's version

from typing import TYPE_CHECKING, Any

from .build import BuildError, JitDisabledError, SerializedWgmmaWarning, build, build_many, ptxas_report
from .kernel import CompiledKernel, compile
from .prepare_spec import Fp8PrepareSpec
from .registry import REGISTRY, default_bwd_spec, default_spec, resolve
from .render import render
from .spec import KernelSpec
from .toolchain import ToolchainError

if TYPE_CHECKING:
    from .ops import flash_attn_func

__all__ = [
    "REGISTRY",
    "BuildError",
    "CompiledKernel",
    "Fp8PrepareSpec",
    "JitDisabledError",
    "KernelSpec",
    "SerializedWgmmaWarning",
    "ToolchainError",
    "__version__",
    "build",
    "build_many",
    "compile",
    "default_bwd_spec",
    "default_spec",
    "flash_attn_func",
    "ptxas_report",
    "render",
    "resolve",
]


def __getattr__(name: str) -> Any:
    # The torch op is imported on first use, so `import fa3gen` (and the CLI) works without torch.
    if name == "flash_attn_func":
        from .ops import flash_attn_func

        return flash_attn_func
    raise AttributeError(f"module 'fa3gen' has no attribute {name!r}")
