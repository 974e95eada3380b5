"""The examples/ scripts on a machine without a GPU: each renders its kernels and says that
running them needs a Hopper GPU, exiting 0 (on a Hopper GPU they run against float64)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fa3gen_testing import REPO

EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.py") if p.name != "common.py")


def test_every_variant_family_has_an_example() -> None:
    assert {"sliding_window.py", "softcap.py", "alibi.py", "custom_score_mod.py", "custom_mask_mod.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_renders_without_a_gpu(name: str) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the no-GPU path, on any machine
    done = subprocess.run([sys.executable, str(REPO / "examples" / name)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "characters of CUDA" in done.stdout and "needs a Hopper GPU" in done.stdout, done.stdout
