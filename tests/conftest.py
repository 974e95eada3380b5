"""Shared fixtures: private cache dirs, a tiny template set that compiles in ~2 s, a counting nvcc,
and the skip rule for GPU tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fa3gen_testing import MINI_TEMPLATE, WARM_SPECS, NvccCounter, write_templates


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FA3GEN_CACHE_DIR", str(root))
    monkeypatch.delenv("FA3GEN_NO_JIT", raising=False)
    return root


@pytest.fixture
def mini_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = write_templates(tmp_path / "templates", MINI_TEMPLATE)
    monkeypatch.setenv("FA3GEN_TEMPLATES_DIR", str(directory))
    return directory


@pytest.fixture(scope="session")
def _pristine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the mini build of WARM_SPECS, built once per session."""
    from fa3gen.build import build_many

    base = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FA3GEN_NVCC", raising=False)
        mp.setenv("FA3GEN_CACHE_DIR", str(base / "cache"))
        mp.setenv("FA3GEN_TEMPLATES_DIR", str(write_templates(base / "templates", MINI_TEMPLATE)))
        build_many(WARM_SPECS)
    return base / "cache"


@pytest.fixture
def warm_cache(cache_dir: Path, mini_templates: Path, _pristine_cache: Path) -> Path:
    """cache_dir pre-filled with mini builds of WARM_SPECS (keys are path-independent, so a copy is valid)."""
    shutil.copytree(_pristine_cache, cache_dir, dirs_exist_ok=True)
    return cache_dir


@pytest.fixture
def nvcc_counter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NvccCounter:
    from fa3gen import toolchain

    monkeypatch.delenv("FA3GEN_NVCC", raising=False)
    counter = NvccCounter(tmp_path, toolchain.find_nvcc())
    monkeypatch.setenv("FA3GEN_NVCC", str(counter.path))
    return counter


def _hopper_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _hopper_present():
        skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
        for item in gpu_items:
            item.add_marker(skip)


# Keep a developer's FA3GEN_* settings from leaking into the suite.
for _var in ("FA3GEN_NO_JIT", "FA3GEN_TEMPLATES_DIR"):
    os.environ.pop(_var, None)
