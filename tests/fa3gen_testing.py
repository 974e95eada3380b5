"""Helpers shared by the CPU tests (kept out of conftest.py so tests can import them by name)."""

from __future__ import annotations

import shutil
import stat
import textwrap
from pathlib import Path

import pytest

# Exports the kernel library ABI like the real template, plus one trivial __global__ so ptxas
# reports something; compiling it takes seconds, so cache tests never wait on the real kernel.
MINI_TEMPLATE = textwrap.dedent(
    """\
    // mini test template: {{ spec.name }}
    #include "fa3gen/abi.h"
    extern "C" int fa3gen_abi_version(void) { return {{ abi_version }}; }
    extern "C" const char* fa3gen_spec_json(void) { return R"FA3GEN({{ spec.canonical_json() }})FA3GEN"; }
    extern "C" int fa3gen_fwd_workspace_bytes(void) { return 0; }
    __global__ void fa3gen_test_kernel(float* x) { x[threadIdx.x] *= 2.f; }
    extern "C" int fa3gen_fwd(const Fa3genFwdParams* p, void* stream) { return 0; }
    """
)
# The backward counterpart: exports the bwd pair instead of the fwd pair. Its workspace size is over
# 2^32 (so a 32-bit return type would show) and its launch fails with error 98 when batch < 0.
MINI_BWD_TEMPLATE = textwrap.dedent(
    """\
    // mini test template (backward): {{ spec.name }}
    #include "fa3gen/abi.h"
    extern "C" int fa3gen_abi_version(void) { return {{ abi_version }}; }
    extern "C" const char* fa3gen_spec_json(void) { return R"FA3GEN({{ spec.canonical_json() }})FA3GEN"; }
    extern "C" int64_t fa3gen_bwd_workspace_bytes(const Fa3genBwdParams* p) {
      return ((int64_t)p->seqlen_q << 33) + 256 * (int64_t)p->nheads_q;
    }
    __global__ void fa3gen_test_kernel(float* x) { x[threadIdx.x] *= 2.f; }
    extern "C" int fa3gen_bwd(const Fa3genBwdParams* p, void* stream) { return p->batch < 0 ? 98 : 0; }
    """
)
REPO = Path(__file__).resolve().parent.parent


def _warm_specs() -> list:
    from fa3gen import REGISTRY

    return [REGISTRY["fwd_d128_bf16"], REGISTRY["fwd_d64_fp16_causal"]]


WARM_SPECS = _warm_specs()  # built once per session by the warm_cache fixture


def write_templates(directory: Path, entry_text: str, bwd_entry_text: str = MINI_BWD_TEMPLATE) -> Path:
    """A template dir with the given forward entry template, a backward one (the mini one unless
    given) and the real plain headers."""
    (directory / "include" / "fa3gen").mkdir(parents=True, exist_ok=True)
    abi_h = REPO / "templates" / "include" / "fa3gen" / "abi.h"
    (directory / "include" / "fa3gen" / "abi.h").write_text(abi_h.read_text())
    (directory / "fwd_kernel.cu.j2").write_text(entry_text)
    (directory / "bwd_kernel.cu.j2").write_text(bwd_entry_text)
    return directory


class NvccCounter:
    """An nvcc wrapper that logs each compile (start/end times) before running the real nvcc."""

    def __init__(self, directory: Path, real_nvcc: Path) -> None:
        self.log = directory / "nvcc_calls.log"
        self.path = directory / "nvcc"
        self._real = real_nvcc
        self.write(delay=0.0)

    def write(self, delay: float) -> None:
        """(Re)write the wrapper; a delay widens the window in which concurrent builds overlap."""
        real_nvcc, delay_cmd = self._real, f"sleep {delay}" if delay else ":"
        self.path.write_text(
            "#!/bin/sh\n"
            'case " $* " in *" -o "*) compiling=1;; *) compiling=0;; esac\n'
            f'[ $compiling = 1 ] && echo "start $(date +%s.%N)" >> "{self.log}"\n'
            f'[ $compiling = 1 ] && {delay_cmd}\n'
            f'"{real_nvcc}" "$@"; rc=$?\n'
            f'[ $compiling = 1 ] && echo "end $(date +%s.%N)" >> "{self.log}"\n'
            "exit $rc\n"
        )
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)

    def intervals(self) -> list[tuple[float, float]]:
        if not self.log.exists():
            return []
        lines = [l.split() for l in self.log.read_text().splitlines()]
        starts = sorted(float(t) for kind, t in lines if kind == "start")
        ends = sorted(float(t) for kind, t in lines if kind == "end")
        return list(zip(starts, ends))

    @property
    def compiles(self) -> int:
        if not self.log.exists():
            return 0
        return sum(1 for l in self.log.read_text().splitlines() if l.startswith("start"))


def host_cxx(purpose: str) -> str:
    """A host C++ compiler on PATH (g++, c++ or clang++); skips the calling test, saying why, without one."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip(f"no C++ compiler (g++, c++ or clang++) on PATH {purpose}")
    return cxx
