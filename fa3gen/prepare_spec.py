"""Fp8PrepareSpec: the fused FP8 input-preparation kernels of one head dim and input dtype.

``fa3gen.fp8.prepare`` runs them on Hopper: the random-sign Hadamard transform of Q and K, the
block amax, the e4m3 cast, and V's transpose into the attention kernel's layout, each input read
from memory in one pass per step instead of torch's chain of GEMMs, reductions and copies. Like a
KernelSpec, the spec renders through the templates (``fp8_prepare.cu.j2``), builds into a cache
entry and loads as a library with a plain C ABI.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

LANES = 32  # head dims are multiples of a warp's lanes (the V layout kernel: a lane per key)
ROW_LANES = 8  # lanes that share a row in the Hadamard kernels: each holds head_dim / 8 values
MAX_HEAD_DIM = 256
InputDtype = Literal["bf16", "fp16", "fp32"]
CXX_INPUT_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}


class Fp8PrepareSpec(BaseModel):
    """The fused prepare kernels for inputs (batch, seqlen, nheads, head_dim) of one dtype."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["fp8_prepare"] = "fp8_prepare"
    head_dim: int
    input_dtype: InputDtype = "bf16"

    @field_validator("head_dim")
    @classmethod
    def _whole_lanes(cls, value: int) -> int:
        if value <= 0 or value % LANES or value > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be a multiple of {LANES} up to {MAX_HEAD_DIM} for the fused fp8 "
                             f"prepare kernels (Hadamard blocks of at least 32 values over {ROW_LANES} lanes), "
                             f"got {value}")
        return value

    @property
    def hadamard_block(self) -> int:
        """The Hadamard transform's block: the largest power of two dividing the head dim
        (``fa3gen.fp8.hadamard_transform``'s block-diagonal form for 96 and 192)."""
        return self.head_dim & -self.head_dim

    @property
    def row_lanes(self) -> int:
        """Lanes that share one row (a warp loads 32 / row_lanes rows at once)."""
        return ROW_LANES

    @property
    def lane_values(self) -> int:
        """Values of one Hadamard block that each of a row's lanes holds (4 to 32)."""
        return self.hadamard_block // ROW_LANES

    @property
    def loads_in_flight(self) -> int:
        """Loads (of 32 / row_lanes rows) one warp issues before it transforms any: 1024 values
        (2 at head dim 256, 8 at 64), enough bytes in flight per SM at 24 or more warps."""
        return 1 << max(0, (1024 * ROW_LANES // (LANES * self.head_dim)).bit_length() - 1)

    @property
    def hadamard_norm(self) -> str:
        """1 / sqrt(hadamard_block) as a C++ float literal (the transform's orthonormal factor)."""
        return f"{1.0 / math.sqrt(self.hadamard_block):.9e}f"

    @property
    def cxx_input_type(self) -> str:
        return CXX_INPUT_TYPES[self.input_dtype]

    @property
    def name(self) -> str:
        return f"fp8prep_d{self.head_dim}_{self.input_dtype}"

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Fp8PrepareSpec:
        return cls.model_validate_json(text)
