"""Calls compiled kernel libraries directly through the C ABI and checks them against float64.

A debugging tool for kernel authors: no cache, no custom op, just `.so` files and torch.
Usage: python scripts/kernel_smoke.py [--time] LIB.so|SPEC_JSON [...]
(a spec given as JSON is compiled through the cache first).
With --time, also times each library on the FA3 benchmark setup (16k tokens, hidden 2048) beside
torch SDPA's cuDNN backend, in this process with CUDA events: a quick ablation between variants.
"""

from __future__ import annotations

import ctypes
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fa3gen import abi  # noqa: E402
from fa3gen.bench import attn_fwd_flops, time_cuda_ms  # noqa: E402
from fa3gen.ops import _launch_params  # noqa: E402
from fa3gen.reference import attention_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def params_for(lib, q, k, v, out, lse, scale):
    """FwdParams plus the scratch tensor the library asks for (keep it alive while the params are used)."""
    return _launch_params(lib.fa3gen_fwd_workspace_bytes(), q, k, v, out, lse, scale)


def run(lib, q, k, v, scale):
    b, sq, hq, _ = q.shape
    out = torch.full((b, sq, hq, v.shape[3]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    p, _workspace_alive = params_for(lib, q, k, v, out, lse, scale)
    err = lib.fa3gen_fwd(ctypes.byref(p), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    assert err == 0, f"fa3gen_fwd returned CUDA error {err}"
    return out, lse


def time_lib(lib, spec, seqlens=(512, 2048, 8192, 16384)) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt, d, causal = DTYPES[spec["dtype"]], spec["head_dim"], spec["causal"]
    for s in seqlens:
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
        p, _workspace_alive = params_for(lib, q, k, v, out, lse, 1 / math.sqrt(d))
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ms = time_cuda_ms(lambda: lib.fa3gen_fwd(ctypes.byref(p), stream), 5, 30, 2.0)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms_cudnn = time_cuda_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), 5, 30, 2.0)
        flops = attn_fwd_flops(b, h, s, s, d, causal)
        print(f"TIME {spec['head_dim']} causal={causal} s={s}: fa3gen {flops / ms / 1e9:.0f} TFLOP/s, "
              f"cuDNN {flops / ms_cudnn / 1e9:.0f} TFLOP/s", flush=True)


def main(paths: list[str]) -> int:
    timing = "--time" in paths
    paths = [p for p in paths if p != "--time"]
    torch.manual_seed(0)
    failures = 0
    for path in paths:
        if path.lstrip().startswith("{"):
            import fa3gen

            path = str(fa3gen.compile(path).library_path)
        lib = abi.bind(ctypes.CDLL(path))
        spec = json.loads(lib.fa3gen_spec_json().decode())
        dt, d, dv, causal = DTYPES[spec["dtype"]], spec["head_dim"], spec["head_dim_v"], spec["causal"]
        for b, sq, sk, hq, hkv in [(2, 1000, 1000, 4, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 4, 4),
                                   (3, 1, 2049, 2, 1), (1, 17, 17, 2, 2), (2, 2049, 2049, 4, 4), (4, 512, 512, 16, 16)]:
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
            kv = torch.randn(b, sk, 2, hkv, max(d, dv), device="cuda", dtype=dt)  # packed: strided views
            k, v = kv[:, :, 0, :, :d], kv[:, :, 1, :, :dv]
            scale = 1 / math.sqrt(d)
            out, lse = run(lib, q, k, v, scale)
            ref, ref_lse = attention_reference(q, k, v, scale, causal)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
            lse_inf_ok = bool((lse[~finite] == float("-inf")).all())
            nan = int(out.isnan().sum())
            ok = rel < 2e-2 and lse_err < 1e-2 and lse_inf_ok and nan == 0
            failures += not ok
            print(f"{Path(path).stem:8s} b{b} sq{sq} sk{sk} h{hq}/{hkv}: rel {rel:.2e} lse {lse_err:.1e} "
                  f"nan {nan} empty-rows-ok {lse_inf_ok} {'OK' if ok else 'FAIL'}", flush=True)
        if timing:
            print(f"== {Path(path).stem}: {json.dumps(spec)}")
            time_lib(lib, spec)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
