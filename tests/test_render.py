"""Rendering: deterministic, strict about undefined names, and independent of the template's contents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from fa3gen_testing import REPO, write_templates
from fa3gen import REGISTRY, KernelSpec, render
from fa3gen.render import include_dir, templates_dir


def test_templates_found_in_source_tree() -> None:
    assert templates_dir() == REPO / "templates"
    assert (include_dir() / "fa3gen" / "abi.h").is_file()


@pytest.mark.parametrize("name", ["fwd_d128_bf16", "fwd_d64_fp16_causal", "fwd_d256_bf16"])
def test_render_is_deterministic(name: str) -> None:
    spec = REGISTRY[name]
    first = render(spec)
    assert first == render(KernelSpec.from_json(spec.canonical_json()))
    for symbol in ("fa3gen_abi_version", "fa3gen_spec_json", "fa3gen_fwd"):
        assert symbol in first
    # and across processes (no dict-order or id() leaking into the text)
    code = f"import fa3gen,sys; sys.stdout.write(fa3gen.render(fa3gen.REGISTRY[{name!r}]))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=REPO).stdout
    assert other == first


def test_different_specs_render_differently() -> None:
    assert render(REGISTRY["fwd_d128_bf16"]) != render(REGISTRY["fwd_d128_bf16_causal"])


@pytest.mark.parametrize("expression", ["{{ no_such_variable }}", "{{ spec.no_such_field }}"])
def test_strict_undefined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expression: str) -> None:
    write_templates(tmp_path, f"// {expression}\n")
    monkeypatch.setenv("FA3GEN_TEMPLATES_DIR", str(tmp_path))
    with pytest.raises(jinja2.UndefinedError):
        render(REGISTRY["fwd_d128_bf16"])
