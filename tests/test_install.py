"""A non-editable install ships the templates: build the wheel, unpack it elsewhere, render from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from fa3gen_testing import REPO


def test_wheel_ships_templates_and_renders(tmp_path: Path) -> None:
    # Build from a copy so the checkout gets no build/ or egg-info litter.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("fa3gen", "templates"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
        check=True, capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("fa3gen-0.1.0-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in (src / "templates").rglob("*"):
        if template.is_file():
            assert f"fa3gen/templates/{template.relative_to(src / 'templates').as_posix()}" in names
    assert any(n.endswith("entry_points.txt") for n in names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import fa3gen; from fa3gen.render import templates_dir; "
        "print(templates_dir()); print(len(fa3gen.render(fa3gen.REGISTRY['fwd_d128_bf16']))); "
        "print(len(fa3gen.render(fa3gen.REGISTRY['bwd_d128_bf16'])))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         check=True, capture_output=True, text=True).stdout.split()
    assert out[0] == str(site / "fa3gen" / "templates") and int(out[1]) > 0 and int(out[2]) > 0
