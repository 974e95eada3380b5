"""A real nvcc compile of the representative spec for sm_90a, with its resource report checked.

Slow (the CuTe kernel takes minutes on two cores): it is the CPU suite's proof that the templates
produce a Hopper kernel that fits its budget.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fa3gen import REGISTRY, ptxas_report
from fa3gen.build import BuildResult, build
from fa3gen.registry import REPRESENTATIVE
from fa3gen.render import ENTRY_TEMPLATE, templates_dir
from fa3gen.spec import SMEM_BUDGET_BYTES

SPEC = REGISTRY[REPRESENTATIVE]
# While the entry template is the stand-in that only exports the ABI, there is no real kernel to check.
PLACEHOLDER = "PLACEHOLDER" in (templates_dir() / ENTRY_TEMPLATE).read_text()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> BuildResult:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FA3GEN_CACHE_DIR", str(tmp_path_factory.mktemp("real") / "cache"))
        mp.delenv("FA3GEN_NO_JIT", raising=False)
        mp.delenv("FA3GEN_TEMPLATES_DIR", raising=False)
        result = build(SPEC)
    assert not result.cached
    print(f"\n{SPEC.name}: cold compile {result.seconds:.1f} s -> {result.entry_dir}")
    return result


def test_ptxas_report(built: BuildResult) -> None:
    report = ptxas_report(built)
    if PLACEHOLDER and not report:
        pytest.xfail("the entry template is still the PLACEHOLDER: no kernel to report on")
    assert report, "ptxas reported no kernel"
    for info in report:
        print(info.summary())
        assert info.arch == "sm_90a"
        assert info.registers > 0
        assert info.spill_stores == 0 and info.spill_loads == 0, info.summary()
        assert info.smem_bytes <= min(SPEC.smem_bytes, SMEM_BUDGET_BYTES), info.summary()


def _cuobjdump() -> str | None:
    from fa3gen.toolchain import find_nvcc

    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc().resolve()
    # /usr/local/bin/nvcc may be a wrapper script: look in the toolkits next to it too.
    candidates = [nvcc.parent / "cuobjdump", *Path("/usr/local").glob("cuda*/bin/cuobjdump")]
    return next((str(c) for c in candidates if c.is_file()), None)


@pytest.mark.xfail(PLACEHOLDER, reason="the entry template is still the PLACEHOLDER (no HGMMA/TMA kernel yet)",
                   strict=False)
def test_sass_uses_hgmma_and_tma_without_local_memory(built: BuildResult) -> None:
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (it ships with the CUDA toolkit): SASS not checked")
    sass = subprocess.run([tool, "--dump-sass", str(built.entry.library)], capture_output=True, text=True,
                          check=True).stdout
    assert "HGMMA" in sass, "no warpgroup MMA (HGMMA) in the kernel"
    assert "UTMALDG" in sass, "no TMA loads (UTMALDG) in the kernel"
    local = re.findall(r"\b(LDL|STL)\b", sass)
    assert not local, f"local-memory traffic: {len(local)} LDL/STL instructions"
