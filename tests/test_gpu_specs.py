"""scripts/gpu_specs.py, the list a device call prebuilds (and device_run.sh's build step compiles):
it must import on the CPU machine and hold every spec the GPU test modules and the examples run, or
a device call compiles the missing kernels on its clock (or, as when examples/variants.py was split
up, its build step fails outright)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts")]

import gpu_specs  # noqa: E402

from fa3gen import registry  # noqa: E402


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


def test_grid_specs_hold_what_the_dispatch_runs_on_the_fa3_grid(monkeypatch):
    """What a device kit packs for `fa3gen bench` (pack_devcache.py grid): each FA3-grid case's
    kernel as the op picks it (registry tiles by query length, then the split twin where the rule
    splits on a 132-SM GPU), through ops' own dispatch with compilation swapped for a recorder."""
    import torch

    from fa3gen import ops
    from fa3gen.bench import DEFAULT_HDIMS, DEFAULT_SEQLENS, bench_cases

    monkeypatch.setattr(ops, "_sm_count", lambda device: gpu_specs.HOPPER_SMS)
    monkeypatch.setattr(ops, "_KERNELS", {})
    ran: list = []
    monkeypatch.setattr(ops, "_compile_fn", lambda: lambda spec: ran.append(spec) or SimpleNamespace(spec=spec))
    for d, seqlen, batch, nheads, causal in bench_cases(DEFAULT_HDIMS, DEFAULT_SEQLENS, [False, True]):
        for dtype in ("bf16", "fp16"):
            kernel = ops._kernel_for(d, d, dtype, causal, seqlen_q=seqlen)
            ops._split_twin_for(kernel, batch, seqlen, nheads, seqlen, torch.device("cuda", 0))
    specs = gpu_specs.grid_specs()
    assert len(specs) == len(set(specs))
    missing = [spec.name for spec in ran if spec not in specs]
    assert not missing, missing
    # the grid's 8k-16k tails at hdim 128 run the 192-row twin (its low rule): the kit must hold it
    assert registry.REGISTRY["fwd_d128_bf16_long_split"] in ran
