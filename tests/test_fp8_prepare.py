"""The fused fp8 prepare kernels on the CPU: spec checks, the rendered source, real nvcc builds
for sm_90a with their ptxas reports, the ctypes mirror of the params struct, the library's
symbols, and prepare's choice between the fused kernels and torch ops. The GPU tests
(tests/gpu/test_fp8_prepare_gpu.py) check what the kernels compute."""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest
import torch
from pydantic import ValidationError

import fa3gen
from fa3gen import abi, fp8, fp8_prepare
from fa3gen.build import build_many, ptxas_report
from fa3gen.render import render, spec_from_json
from fa3gen.prepare_spec import Fp8PrepareSpec
from fa3gen_testing import REPO, host_cxx


@pytest.mark.parametrize("head_dim", [0, 16, 80, 288])
def test_spec_rejects_head_dims_the_lanes_cannot_split(head_dim):
    with pytest.raises(ValidationError, match="multiple of 32"):
        Fp8PrepareSpec(head_dim=head_dim)


def test_spec_rejects_unknown_dtype_and_fields():
    with pytest.raises(ValidationError):
        Fp8PrepareSpec(head_dim=128, input_dtype="e4m3")
    with pytest.raises(ValidationError):
        Fp8PrepareSpec(head_dim=128, block_m=128)


@pytest.mark.parametrize(("head_dim", "block", "lane_values"), [(64, 64, 8), (96, 32, 4), (128, 128, 16),
                                                                  (192, 64, 8), (256, 256, 32)])
def test_hadamard_block_is_the_python_transforms(head_dim, block, lane_values):
    spec = Fp8PrepareSpec(head_dim=head_dim)
    assert (spec.hadamard_block, spec.lane_values) == (block, lane_values)
    # fp8.hadamard_transform is block-diagonal with the same block: its matrix has no entry across blocks.
    m = fp8.hadamard_transform(torch.eye(head_dim, dtype=torch.float64))
    assert torch.count_nonzero(m[:block, block:]) == 0
    assert torch.count_nonzero(m[:block, :block]) == block * block


def test_spec_json_round_trip_and_kind_dispatch():
    spec = Fp8PrepareSpec(head_dim=192, input_dtype="fp32")
    assert spec_from_json(spec.canonical_json()) == spec
    assert spec.name == "fp8prep_d192_fp32"
    attention = fa3gen.KernelSpec(head_dim=128)
    assert spec_from_json(attention.canonical_json()) == attention


def test_rendered_source_constants():
    source = render(Fp8PrepareSpec(head_dim=192, input_dtype="fp16"))
    assert "using Input = __half;" in source
    assert "constexpr int kBlock = 64;" in source and "constexpr int kLaneValues = 8;" in source
    assert "constexpr float kNorm = 1.250000000e-01f;" in source  # 1 / sqrt(64)
    assert Fp8PrepareSpec(head_dim=192, input_dtype="fp16").canonical_json() in source
    for entry in abi.FP8_PREPARE_ENTRY_POINTS:
        assert f'extern "C" int {entry}(' in source


_LAYOUT_PROGRAM = """\
#include <cstddef>
#include <cstdio>
#include <stdint.h>
%STRUCT%
#define FIELD(f) std::printf("%s %zu %zu\\n", #f, offsetof(Fa3genFp8PrepareParams, f), sizeof(((Fa3genFp8PrepareParams*)0)->f));
int main() {
  std::printf("sizeof %zu %zu\\n", sizeof(Fa3genFp8PrepareParams), alignof(Fa3genFp8PrepareParams));
%FIELDS%
}
"""


def test_params_struct_matches_the_template(tmp_path):
    """abi.Fp8PrepareParams against what a C++ compiler makes of the struct in the rendered source."""
    cxx = host_cxx("to compile the params struct")
    source = render(Fp8PrepareSpec(head_dim=128))
    struct = re.search(r"typedef struct Fa3genFp8PrepareParams \{.*?\} Fa3genFp8PrepareParams;", source, re.S)
    assert struct is not None
    fields = "\n".join(f"  FIELD({name})" for name, _ in abi.Fp8PrepareParams._fields_)
    (tmp_path / "layout.cpp").write_text(_LAYOUT_PROGRAM.replace("%STRUCT%", struct.group(0)).replace("%FIELDS%", fields))
    subprocess.run([cxx, "-std=c++17", str(tmp_path / "layout.cpp"), "-o", str(tmp_path / "layout")], check=True,
                   capture_output=True, text=True)
    lines = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.splitlines()
    size, align = (int(x) for x in lines[0].split()[1:])
    assert (size, align) == (ctypes.sizeof(abi.Fp8PrepareParams), ctypes.alignment(abi.Fp8PrepareParams))
    c_fields = {name: (int(off), int(sz)) for name, off, sz in (line.split() for line in lines[1:])}
    py_fields = {name: (getattr(abi.Fp8PrepareParams, name).offset, getattr(abi.Fp8PrepareParams, name).size)
                 for name, _ in abi.Fp8PrepareParams._fields_}
    assert py_fields == c_fields


# Head dims with four values per lane (96: Hadamard blocks of 32), three blocks of 64 values
# (192), and 32 values per lane (256, fp32: eight 16-byte loads each).
BUILT = [Fp8PrepareSpec(head_dim=96, input_dtype="bf16"), Fp8PrepareSpec(head_dim=192, input_dtype="fp16"),
         Fp8PrepareSpec(head_dim=256, input_dtype="fp32"), Fp8PrepareSpec(head_dim=128, input_dtype="bf16")]


@pytest.fixture(scope="module")
def prepare_builds(tmp_path_factory):
    import os

    old = os.environ.get("FA3GEN_CACHE_DIR")
    os.environ["FA3GEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("prepcache"))
    try:
        results = build_many(BUILT)
        yield {r.spec.name: r for r in results}
    finally:
        if old is None:
            os.environ.pop("FA3GEN_CACHE_DIR", None)
        else:
            os.environ["FA3GEN_CACHE_DIR"] = old


@pytest.mark.parametrize("spec", BUILT, ids=lambda s: s.name)
def test_real_build_ptxas_report(prepare_builds, spec):
    """Four kernels per library, for sm_90a, without spills or local memory, and few registers
    (memory-bound kernels want many warps in flight: 3 CTAs of 256 threads per SM need <= 80; the
    scales kernel's 1024 threads <= 64)."""
    reports = ptxas_report(prepare_builds[spec.name])
    names = sorted(re.sub(r"^_ZN14fa3gen_prepare\d+|E22Fa3genFp8PrepareParams$", "", r.function) for r in reports)
    assert names == ["amax_kernel", "quantize_kernel", "quantize_v_layout_kernel", "scales_kernel"]
    for r in reports:
        assert r.arch == "sm_90a"
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_frame == 0, r.summary()
        assert r.registers <= (64 if "scales" in r.function else 80), r.summary()


def test_library_loads_and_binds_its_kind(prepare_builds, monkeypatch):
    """fa3gen.compile loads a prepare library (no GPU needed to dlopen it); the attention entry
    points refuse it with the kind in the message."""
    monkeypatch.setenv("FA3GEN_CACHE_DIR", str(prepare_builds[BUILT[3].name].entry.path.parent))
    kernel = fa3gen.compile(BUILT[3])
    assert kernel.kind == "fp8_prepare"
    with pytest.raises(TypeError, match="fp8_prepare kernel"):
        kernel.fwd(abi.FwdParams(), 0)
    with pytest.raises(TypeError, match="fp8_prepare kernel"):
        kernel.bwd(abi.BwdParams(), 0)
    with pytest.raises(ValueError, match="entry must be one of"):
        kernel.fp8_prepare("fa3gen_fwd", abi.Fp8PrepareParams(), 0)


def test_unsupported_reasons_on_this_machine():
    x = torch.zeros(1, 8, 2, 128)
    assert "not a CUDA device" in fp8_prepare.unsupported_reason(x)


def test_prepare_fused_true_says_why_not():
    q = k = v = torch.randn(1, 64, 2, 128)
    with pytest.raises(ValueError, match=r"cannot use the fused kernels: q: it is on cpu"):
        fp8.prepare(q, k, v, fused=True)


def test_prepare_falls_back_to_torch_ops_off_the_gpu():
    """fused=None on CPU tensors takes torch ops: the same result as fused=False."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 200, 2, 64, generator=gen) for _ in range(3))
    auto, torch_ops = fp8.prepare(q, k, v), fp8.prepare(q, k, v, fused=False)
    for a, b in ((auto.q, torch_ops.q), (auto.k, torch_ops.k), (auto.v, torch_ops.v)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_prepare_rejects_mismatched_q_k_head_dims():
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 1, 128), torch.randn(1, 8, 1, 128)
    with pytest.raises(ValueError, match="q and k head dims differ"):
        fp8.prepare(q, k, v)


@pytest.mark.parametrize("power", range(-30, 30))
def test_power_of_two_scales_are_exact(power):
    """scales_from_amax rounds up to the next power of two exactly: a power of two stays, one ulp
    above it goes up, one ulp below stays below."""
    base = torch.tensor([2.0**power], dtype=torch.float32) * fp8.E4M3_MAX
    for amax, want in ((base, 2.0**power), (torch.nextafter(base, torch.tensor(float("inf"))), 2.0 ** (power + 1)),
                       (torch.nextafter(base, torch.tensor(0.0)), 2.0**power)):
        scale = fp8.scales_from_amax(amax, power_of_two=True)
        exact = (amax.double() / fp8.E4M3_MAX).item()
        assert scale.item() == want and scale.item() >= exact


def test_prepare_falls_back_with_a_warning_when_the_kernels_cannot_be_built(monkeypatch):
    """fused=None: inputs the kernels take, but no compiler and no cached build (FA3GEN_NO_JIT):
    torch ops, with a warning that says why; fused=True then fails with the build's error."""
    from fa3gen.build import JitDisabledError

    def no_kernel(x):
        raise JitDisabledError("FA3GEN_NO_JIT is set and kernel fp8prep_d64_fp32 is not in the cache")

    monkeypatch.setattr(fp8_prepare, "unsupported_reason", lambda x: None)
    monkeypatch.setattr(fp8_prepare, "kernel_for", no_kernel)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 100, 2, 64, generator=gen) for _ in range(3))
    with pytest.warns(UserWarning, match="fused kernels are unavailable .*FA3GEN_NO_JIT.*using torch ops"):
        auto = fp8.prepare(q, k, v)
    ops = fp8.prepare(q, k, v, fused=False)
    assert torch.equal(auto.q.data.view(torch.uint8), ops.q.data.view(torch.uint8))
    with pytest.raises(JitDisabledError):
        fp8.prepare(q, k, v, fused=True)


@pytest.mark.parametrize(("granularity", "v_layout"), [("block", False), ("head", True), ("tensor", False)])
def test_launch_plan(granularity, v_layout):
    """The host side of fp8_prepare.quantize (its buffers on the CPU here): the amax blocks, how the
    cast kernels index the scales (strides, rows per block), the output's layout and strides."""
    x = torch.zeros(2, 300, 2, 3, 64)[:, :, 1]  # strided rows, as q of a packed tensor
    signs = torch.ones(64)
    launch = fp8_prepare.plan(x, granularity, 128, True, signs, v_layout)
    reduce, cast, q = launch.reduce, launch.cast, launch.out
    assert reduce.signs == signs.data_ptr() and reduce.x == x.data_ptr()
    assert (reduce.x_batch_stride, reduce.x_row_stride, reduce.x_head_stride) == x.stride()[:3]
    assert (reduce.batch, reduce.seqlen, reduce.nheads, reduce.padded_keys) == (2, 300, 3, 320)
    assert reduce.granularity == abi.FP8_SCALE_GRANULARITY[granularity] and reduce.power_of_two == 1
    amax_rows = 128 if granularity == "block" else fp8_prepare.AMAX_ROWS
    assert reduce.block_rows == amax_rows and launch.amax.shape == (2, -(-300 // amax_rows), 3)
    assert reduce.amax == launch.amax.data_ptr() and reduce.scale == cast.scale == q.scale.data_ptr()
    strides = (cast.scale_batch_stride, cast.scale_block_stride, cast.scale_head_stride)
    if granularity == "block":
        assert q.scale.shape == (2, 3, 3) and strides == q.scale.stride() and cast.block_rows == 128
    elif granularity == "head":
        assert q.scale.shape == (2, 3) and strides == (3, 0, 1) and cast.block_rows == 2**31 - 1
    else:
        assert q.scale.shape == () and strides == (0, 0, 0) and cast.block_rows == 2**31 - 1
    assert cast.out == q.data.data_ptr() and q.data.dtype == torch.float8_e4m3fn
    if v_layout:
        assert launch.cast_entry == "fa3gen_fp8_quantize_v_layout"
        assert q.kernel_v_layout and q.data.shape == (2, 3, 64, 320)
    else:
        assert launch.cast_entry == "fa3gen_fp8_quantize" and q.data.shape == (2, 300, 3, 64)
        assert (cast.out_batch_stride, cast.out_row_stride, cast.out_head_stride) == q.data.stride()[:3]
    assert q.power_of_two and q.block_size == (128 if granularity == "block" else None)
    with pytest.raises(ValueError, match="granularity"):
        fp8_prepare.plan(x, "row", 128, True, None, False)
    with pytest.raises(ValueError, match="block_size must be positive"):
        fp8_prepare.plan(x, "block", 0, True, None, False)
