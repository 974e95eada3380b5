"""scripts/gpu_specs.py, the list a device call prebuilds (and device_run.sh's build step compiles):
it must import on the CPU machine and hold every spec the GPU test modules and the examples run, or
a device call compiles the missing kernels on its clock (or, as when examples/variants.py was split
up, its build step fails outright)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

import gpu_specs  # noqa: E402


def test_gpu_specs_hold_every_gpu_test_modules_specs():
    specs = gpu_specs.gpu_specs()
    assert len(specs) == len(set(specs)) and len(specs) > 100
    import custom_mask_mod
    import test_bias_grad_gpu
    import test_block_sparse_gpu
    import test_multicast_gpu
    import test_switches_gpu
    import test_tensor_built_ins_gpu

    wanted = [*test_bias_grad_gpu._specs(), *test_block_sparse_gpu.SPECS, *test_tensor_built_ins_gpu.SPECS,
              *test_switches_gpu.SPECS, *test_multicast_gpu.SPECS, *test_multicast_gpu.FP8_SPECS,
              custom_mask_mod.PREFIX_LM.backward_spec()]
    missing = [spec.name for spec in wanted if spec not in specs]
    assert not missing, missing
    assert any(spec.kind == "bwd" and spec.bias_grad for spec in specs)
