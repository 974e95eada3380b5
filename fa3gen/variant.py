"""Custom attention variants in a spec: score_mod and mask_mod expressions and their parameters.

A variant is compiled into the kernel, FlexAttention-style but as C++: ``score_mod`` is a float
expression over ``score`` (the scaled score q·k * softmax_scale, after any soft-capping), ``b``,
``h``, ``q_idx``, ``kv_idx`` and the declared parameters; ``mask_mod`` is a bool expression over
the same names without ``score`` (true = the query may see the key). ``seqlen_q`` and
``seqlen_k`` are also in scope. Parameters are run-time scalars (``float32`` / ``int32``) or
tensors (indexed like ``bias(h, q_idx)``, any strides, on the GPU).

Everything is checked here, at spec time: names are C identifiers that do not shadow the
built-in names, an expression is one expression (no statements, no comments, no preprocessor)
and uses only known names and math functions, so a typo fails with a message that names it
instead of failing in nvcc.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .abi import MAX_SCALAR_ARGS as MAX_SCALARS  # per dtype: float32 and int32 scalars
from .abi import MAX_TENSOR_ARGS as MAX_TENSORS
from .abi import MAX_TENSOR_DIMS

# Names every expression may use. score only in score_mod.
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx", "seqlen_q", "seqlen_k")
# Device math an expression may call (float versions; integer helpers min/max/abs).
FUNCTIONS = (
    "tanhf", "expf", "exp2f", "logf", "log2f", "log1pf", "sqrtf", "rsqrtf", "fabsf", "fminf", "fmaxf",
    "floorf", "ceilf", "roundf", "powf", "sinf", "cosf", "min", "max", "abs", "float", "int",
)
_KEYWORDS = ("true", "false")
_CPP_RESERVED = {
    "auto", "bool", "break", "case", "char", "const", "continue", "default", "delete", "do", "double",
    "else", "enum", "for", "goto", "if", "inline", "long", "new", "return", "short", "signed", "sizeof",
    "static", "struct", "switch", "template", "this", "typedef", "union", "unsigned", "void", "volatile",
    "while", "p", "s", "t", "args", "Element",
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER_SUFFIX = re.compile(r"(?<![A-Za-z0-9_.])(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?[fFuUlL]*")

TensorDtype = Literal["float32", "int32", "int64", "float16", "bfloat16", "bool"]
# C++ element type of each tensor dtype (bool tensors are bytes).
CPP_TYPES = {"float32": "float", "int32": "int", "int64": "int64_t", "float16": "cutlass::half_t",
             "bfloat16": "cutlass::bfloat16_t", "bool": "bool"}


def _check_name(name: str) -> str:
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"parameter name {name!r} is not a C identifier")
    if name in INDEX_NAMES or name == "score" or name in FUNCTIONS or name in _KEYWORDS \
            or name in _CPP_RESERVED or name.startswith("__") or name.startswith("fa3gen"):
        raise ValueError(f"parameter name {name!r} is reserved (it shadows a name the kernel uses)")
    return name


class _NamedParam(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return _check_name(v)


class ScalarParam(_NamedParam):
    """A run-time scalar: passed per call, read as a constant in the expression."""

    kind: Literal["scalar"] = "scalar"
    dtype: Literal["float32", "int32"] = "float32"


class TensorParam(_NamedParam):
    """A run-time tensor on the GPU, indexed with ``ndim`` integer indices: ``name(i, j)``."""

    kind: Literal["tensor"] = "tensor"
    dtype: TensorDtype = "float32"
    ndim: int = Field(ge=1, le=MAX_TENSOR_DIMS)

    @property
    def cpp_type(self) -> str:
        return CPP_TYPES[self.dtype]


Param = Annotated[Union[ScalarParam, TensorParam], Field(discriminator="kind")]


class ScoreMod(BaseModel):
    """score_mod: a float C++ expression giving the new score (see the module docstring).

    ``grad`` is d(score_mod)/d(score) as an expression of the same names; the backward pass needs
    it, the forward does not.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    expr: str
    grad: str | None = None


class MaskMod(BaseModel):
    """mask_mod: a bool C++ expression, true where query q_idx may see key kv_idx."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    expr: str


def names_used(text: str) -> frozenset[str]:
    """The identifiers an expression uses (numbers and their suffixes aside): e.g. whether a
    mask_mod depends on the head (``"h"``) or the batch (``"b"``)."""
    return frozenset(_IDENTIFIER.findall(_NUMBER_SUFFIX.sub(" ", text)))


def check_expression(text: str, what: str, params: tuple[Param, ...], allow_score: bool) -> None:
    """Raise ValueError unless `text` is one C++ expression over the names allowed for `what`."""
    if not text.strip():
        raise ValueError(f"{what} is empty")
    for bad, why in ((";", "a statement separator"), ("{", "a block"), ("}", "a block"),
                     ("#", "a preprocessor directive"), ("//", "a comment"), ("/*", "a comment"),
                     ('"', "a string"), ("'", "a character literal"), ("\\", "a backslash")):
        if bad in text:
            raise ValueError(f"{what} {text!r} contains {bad!r} ({why}); give one C++ expression")
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0:
        raise ValueError(f"{what} {text!r} has unbalanced parentheses")
    known = set(INDEX_NAMES) | set(FUNCTIONS) | set(_KEYWORDS) | {p.name for p in params}
    if allow_score:
        known.add("score")
    unknown = sorted(n for n in names_used(text) if n not in known)
    if unknown:
        allowed = ", ".join(sorted(known - set(FUNCTIONS) - set(_KEYWORDS)))
        raise ValueError(
            f"{what} {text!r} uses unknown name(s) {', '.join(unknown)}; it may use {allowed}, "
            f"declared params, and the functions {', '.join(FUNCTIONS)}"
        )


def check_params(params: tuple[Param, ...]) -> None:
    names = [p.name for p in params]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"parameter names must be unique; repeated: {', '.join(dupes)}")
    floats = sum(isinstance(p, ScalarParam) and p.dtype == "float32" for p in params)
    ints = sum(isinstance(p, ScalarParam) and p.dtype == "int32" for p in params)
    tensors = sum(isinstance(p, TensorParam) for p in params)
    if max(floats, ints) > MAX_SCALARS or tensors > MAX_TENSORS:
        raise ValueError(
            f"at most {MAX_SCALARS} float32 scalars, {MAX_SCALARS} int32 scalars and {MAX_TENSORS} tensors; "
            f"got {floats}, {ints} and {tensors}"
        )
