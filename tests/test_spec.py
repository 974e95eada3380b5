"""KernelSpec is the DSL's type checker: good specs pass, each bad one names its field and limit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fa3gen import REGISTRY, KernelSpec
from fa3gen.spec import SMEM_BUDGET_BYTES


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registry_specs_are_valid(name: str) -> None:
    spec = REGISTRY[name]
    assert spec.smem_bytes <= SMEM_BUDGET_BYTES
    assert name.startswith(f"{spec.kind}_d{spec.head_dim}_{spec.dtype}")
    if spec.kind == "bwd":  # a consumer warpgroup owns 64 keys, or (hdim > 128) they share 64; block_m is one WGMMA M
        keys = 64 if spec.head_dim > 128 else 64 * spec.num_consumer_warpgroups
        assert spec.block_n == keys and spec.bwd_splits_head_dim == (spec.head_dim > 128) and spec.block_m == 64
        assert not spec.deterministic
        return
    assert spec.block_m == 64 * spec.num_consumer_warpgroups
    assert spec.block_n % 16 == 0


def test_defaults_filled() -> None:
    spec = KernelSpec(head_dim=128)
    assert spec.head_dim_v == 128 and spec.dtype == "bf16" and not spec.causal
    assert spec.block_m and spec.block_n and spec.stages and spec.num_consumer_warpgroups
    assert KernelSpec(head_dim=192, head_dim_v=128).head_dim_v == 128


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"head_dim": 256, "block_n": 128, "stages": 2}, rf"shared memory .* exceeds the {SMEM_BUDGET_BYTES} B budget"),
        ({"head_dim": 128, "block_m": 128, "num_consumer_warpgroups": 3}, r"block_m=128 must equal 64 \* num_consumer_warpgroups"),
        # a bad block_m is named itself, not through the num_consumer_warpgroups derived from it
        ({"head_dim": 128, "block_m": 64}, r"block_m=64 must be one of 128, 192, 256"),
        ({"head_dim": 128, "block_m": 100}, r"block_m=100 must be one of 128, 192, 256"),
        ({"head_dim": 128, "block_m": 320}, r"block_m=320 must be one of 128, 192, 256"),
        ({"head_dim": 128, "block_m": "x"}, r"block_m\s+Input should be a valid integer"),
        ({"head_dim": 128, "block_n": 120}, r"block_n=120 must be a multiple of 16"),
        ({"head_dim": 128, "block_n": 272}, r"block_n=272 .*\[16, 256\]"),
        ({"head_dim": 80}, r"head_dim"),
        ({"head_dim": 128, "head_dim_v": 80}, r"head_dim_v=80 is not supported"),
        ({"head_dim": 128, "dtype": "fp8"}, r"dtype"),
        ({"head_dim": 128, "stages": 0}, r"stages=0 must be between 1 and 4"),
        ({"head_dim": 128, "stages": 5}, r"stages=5 must be between 1 and 4"),
        ({"head_dim": 64, "pingpong": True}, r"pingpong needs num_consumer_warpgroups=2"),
        ({"head_dim": 128, "num_consumer_warpgroups": 5}, r"num_consumer_warpgroups=5 must be 2, 3 or 4"),
        ({"head_dim": 128, "num_consumer_warpgroups": 4}, r"4 consumer warpgroups get 112: lower block_n"),
        ({"head_dim": 128, "producer_registers": 24}, r"producer_registers=24: a forward spec may set it only with three or four"),
        ({"head_dim": 64, "block_m": 256, "block_n": 64, "producer_registers": 40}, r"to one of \(24, 32\)"),
        ({"head_dim": 256, "num_consumer_warpgroups": 3, "stages": 1}, r"registers per thread .* get 160"),
        ({"head_dim": 128, "tile_magic": 3}, r"tile_magic\s+Extra inputs are not permitted"),
    ],
)
def test_bad_specs_name_field_and_limit(fields: dict, expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        KernelSpec(**fields)


def test_frozen() -> None:
    spec = KernelSpec(head_dim=128)
    with pytest.raises(ValidationError):
        spec.causal = True  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_json_round_trip(name: str) -> None:
    spec = REGISTRY[name]
    again = KernelSpec.from_json(spec.canonical_json())
    assert again == spec
    assert again.canonical_json() == spec.canonical_json()
    assert again.content_hash == spec.content_hash


def test_hash_is_canonical() -> None:
    # Explicit defaults, field order and whitespace do not change the kernel's identity.
    implicit = KernelSpec(head_dim=128, causal=True)
    explicit = KernelSpec.from_json(
        '{ "causal": true, "dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "stages": 2 }'
    )
    assert implicit.content_hash == explicit.content_hash
    assert implicit.name == explicit.name
    hashes = {s.content_hash for s in REGISTRY.values()}
    assert len(hashes) == len(REGISTRY)
    assert KernelSpec(head_dim=128, stages=3).content_hash != KernelSpec(head_dim=128).content_hash
