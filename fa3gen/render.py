"""Render a spec (a KernelSpec, or an Fp8PrepareSpec) into CUDA C++ source through the Jinja templates."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jinja2

from . import abi, split_tail
from .prepare_spec import Fp8PrepareSpec
from .spec import KernelSpec

ENTRY_TEMPLATE = "fwd_kernel.cu.j2"
# By the spec's kind: attention forward and backward (KernelSpec), fp8 input preparation.
ENTRY_TEMPLATES = {"fwd": ENTRY_TEMPLATE, "bwd": "bwd_kernel.cu.j2", "fp8_prepare": "fp8_prepare.cu.j2"}
# Everything that renders, builds into a cache entry and loads as a kernel library.
BuildSpec = KernelSpec | Fp8PrepareSpec
_PACKAGE_DIR = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """Where the templates are: $FA3GEN_TEMPLATES_DIR, else the installed copy, else the source tree.

    A non-editable install ships templates/ as the package fa3gen.templates (fa3gen/templates/);
    running from a checkout (PYTHONPATH or editable install) finds <repo>/templates instead.
    """
    override = os.environ.get("FA3GEN_TEMPLATES_DIR")
    if override:
        return Path(override).resolve()
    for candidate in (_PACKAGE_DIR / "templates", _PACKAGE_DIR.parent / "templates"):
        if (candidate / ENTRY_TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(
        f"fa3gen templates not found (looked for {ENTRY_TEMPLATE} in {_PACKAGE_DIR / 'templates'} "
        f"and {_PACKAGE_DIR.parent / 'templates'}); reinstall fa3gen or set FA3GEN_TEMPLATES_DIR"
    )


def include_dir() -> Path:
    """Plain headers the kernel sources #include (e.g. "fa3gen/abi.h")."""
    return templates_dir() / "include"


@functools.lru_cache(maxsize=8)
def _environment(root: Path) -> jinja2.Environment:
    # One environment per templates dir, so tests and users may point at their own templates.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,  # a typo in a template fails loudly, never renders ""
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def spec_from_json(text: str) -> BuildSpec:
    """The spec a JSON text describes: its "kind" says which model (KernelSpec when it has none).
    Text that is not a JSON object goes to KernelSpec, whose validation error names the problem."""
    try:
        kind = json.loads(text).get("kind")
    except (ValueError, AttributeError):
        kind = None
    return Fp8PrepareSpec.from_json(text) if kind == "fp8_prepare" else KernelSpec.from_json(text)


def render(spec: BuildSpec) -> str:
    """The CUDA source of one spec. Deterministic: same spec and templates give the same text."""
    template = _environment(templates_dir()).get_template(ENTRY_TEMPLATES[spec.kind])
    return template.render(spec=spec, abi_version=abi.ABI_VERSION, split_tail=split_tail)
