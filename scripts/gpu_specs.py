"""Every kernel spec the GPU work of a device session needs: the registry (forward and backward,
plus the deterministic backward specs), the GPU tests' own specs, the variant examples', the
learned-bias rows of bench_variants, the ablation's variants, the sanitizer's pingpong spec and
the fused fp8 prepare kernels.

Usage: python scripts/gpu_specs.py            # one JSON spec per line
       python scripts/gpu_specs.py --grid     # only the FA3 grid's forward kernels and their split twins
       python scripts/gpu_specs.py --build -j 16   # compile them all into the cache, in parallel
Run it on the CPU machine with FA3GEN_CACHE_DIR=.devcache to prebuild what a device call carries.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu"), str(ROOT / "examples")]

import fa3gen  # noqa: E402
from fa3gen import REGISTRY, KernelSpec, ablation, registry  # noqa: E402
from fa3gen.prepare_spec import Fp8PrepareSpec  # noqa: E402

PINGPONG_SPEC = KernelSpec(head_dim=128, causal=True, pingpong=True)  # device_run.sh sanitizes it


def gpu_specs() -> list[KernelSpec | Fp8PrepareSpec]:
    import custom_mask_mod
    import custom_score_mod
    import documents_and_prefix_lm
    import test_bias_grad_gpu
    import test_block_sparse_gpu
    import test_bwd_gpu
    import test_fp8_gpu
    import test_multicast_gpu
    import test_switches_gpu
    import test_tensor_built_ins_gpu
    import test_variants_bwd_gpu
    import test_variants_gpu

    specs = list(REGISTRY.values())
    specs += [KernelSpec(**{**s.model_dump(), "deterministic": True}) for s in REGISTRY.values() if s.kind == "bwd"]
    specs += [KernelSpec(head_dim=192, head_dim_v=128, causal=c) for c in (False, True)]  # test_fwd_gpu
    specs += list(test_switches_gpu.SPECS) + [test_switches_gpu.CUSTOM_SPEC]
    specs += list(test_variants_gpu.SPECS) + list(test_variants_bwd_gpu.SPECS)
    specs += list(test_fp8_gpu.SPECS)
    specs += list(test_multicast_gpu.SPECS) + list(test_multicast_gpu.FP8_SPECS)
    # test_bwd_gpu's kernel pairs that must agree bit for bit.
    specs += [test_bwd_gpu.agreement_spec(field, value, *case[:4])
              for field, (values, cases) in test_bwd_gpu.AGREEMENTS.items() for case in cases for value in values]
    specs += list(test_block_sparse_gpu.SPECS) + list(test_tensor_built_ins_gpu.SPECS) + test_bias_grad_gpu._specs()
    # The examples' own specs (forward and backward: each differentiates through flash_attn_func).
    for fwd in (custom_mask_mod.DOCUMENTS_IN_A_WINDOW, custom_mask_mod.PREFIX_LM, custom_score_mod.RELATIVE_BIAS,
                documents_and_prefix_lm.DOCUMENTS, documents_and_prefix_lm.PREFIX_LM):
        specs += [fwd, fwd.backward_spec()]
    # examples/softcap.py differentiates a causal window + softcap through flash_attn_func.
    specs += [registry.default_spec(128, 128, "bf16", True, window=True, softcap=True),
              registry.default_bwd_spec(128, 128, "bf16", True, window=True, softcap=True)]
    specs += [s for s in ablation.variants().values() if s is not None]
    # scripts/bench_variants.py's learned-bias rows: an fp32 and a bf16 (1, h, s, s) bias that
    # requires grad, hdim 128 bf16, its forward as the default for aligned rows (staged: bias_staging)
    # and as the register path.
    for bias_dtype in ("float32", "bfloat16"):
        fwd = registry.default_spec(128, 128, "bf16", False, bias=True, bias_dtype=bias_dtype, bias_rows_aligned=True)
        specs += [fwd, fwd.backward_spec(bias_grad=True), KernelSpec(head_dim=128, bias=True, bias_dtype=bias_dtype)]
    specs.append(PINGPONG_SPEC)
    # fp8.prepare's fused kernels: test_fp8_prepare_gpu covers every input dtype of these head dims.
    import test_fp8_prepare_gpu

    specs += list(test_fp8_prepare_gpu.SPECS)
    unique: list[KernelSpec | Fp8PrepareSpec] = []
    for spec in specs:
        if spec not in unique:
            unique.append(spec)
    return unique


# The SM count the device kits are built for: the lent H100s and H200s (SXM) both have 132.
HOPPER_SMS = 132


def grid_specs(sms: int = HOPPER_SMS) -> list[KernelSpec]:
    """The forward kernels `fa3gen bench` and `scripts/bench_fp8.py` run on the FA3 grid (bf16 and
    fp16, hdim 64/128/256, seqlen 512-16k, causal and not; e4m3 at hdim 128/256 s16k on
    fa3gen.fp8.prepare's default inputs) on a GPU of `sms` SMs: each case's registry kernel and
    the split twin the dispatch takes for it (registry.split_twin_for)."""
    from fa3gen.bench import DEFAULT_HDIMS, DEFAULT_SEQLENS, bench_cases

    specs: list[KernelSpec] = []

    def add(spec: KernelSpec, batch: int, seqlen: int, nheads: int) -> None:
        twin = registry.split_twin_for(spec, batch, seqlen, nheads, seqlen, sms)
        specs.extend(s for s in (spec, twin) if s is not None and s not in specs)

    for d, seqlen, batch, nheads, causal in bench_cases(DEFAULT_HDIMS, DEFAULT_SEQLENS, [False, True]):
        for dtype in ("bf16", "fp16"):
            add(registry.default_spec(d, d, dtype, causal, seqlen_q=seqlen), batch, seqlen, nheads)
    for d, seqlen, batch, nheads, causal in bench_cases([128, 256], [16384], [False, True]):
        add(registry.default_fp8_spec(d, d, "bf16", causal, seqlen_q=seqlen), batch, seqlen, nheads)
    return specs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--grid", action="store_true", help="only the FA3 grid's forward kernels (grid_specs)")
    args = ap.parse_args()
    specs = grid_specs() if args.grid else gpu_specs()
    if not args.build:
        for spec in specs:
            print(spec.canonical_json())
        return 0
    fa3gen.build_many(specs, jobs=args.jobs, progress=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
