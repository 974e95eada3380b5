"""generated/ holds the rendered sources of the registry and must match the templates."""

from __future__ import annotations

from fa3gen_testing import REPO
from fa3gen import render
from fa3gen.registry import all_specs

FIX = "regenerate with `fa3gen render --all --out generated` (and delete files not in the registry)"


def test_generated_is_not_stale() -> None:
    generated = REPO / "generated"
    present = {p.name for p in generated.glob("*.cu")}
    specs = all_specs()
    expected = {f"{name}.cu" for name in specs}
    assert present == expected, f"generated/ has {sorted(present ^ expected)} out of place: {FIX}"
    stale = [name for name, spec in specs.items() if (generated / f"{name}.cu").read_text() != render(spec)]
    assert not stale, f"stale in generated/: {stale}: {FIX}"
