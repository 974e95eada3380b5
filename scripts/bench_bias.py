"""Times the learned-bias kernels (flash_attn_func with attn_bias) forward and backward, for A/Bs of
template trees: run once per FA3GEN_TEMPLATES_DIR, in alternating processes, and compare.

bf16 q, k, v (batch, seqlen, heads, hdim); biases (1, h, s, s) fp32 and bf16, (b, 1, s, s) and
(b, h, s, s) fp32; the backward differentiates q, k, v and the bias. CUDA events, warm-up, median
(fa3gen.bench.time_cuda_ms_interleaved).

Usage: python scripts/bench_bias.py [fwd|bwd|all] [--hdim 128] [--heads 16] [--batch 4] [--seqlen 4096]
                                    [--biases 1h-fp32,1h-bf16,b1-fp32,bh-fp32] [--causal both|yes|no]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fa3gen  # noqa: E402
from fa3gen.bench import attn_bwd_flops, attn_fwd_flops, time_cuda_ms_interleaved  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="?", default="all", choices=("fwd", "bwd", "all"))
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--biases", default="1h-fp32,1h-bf16,b1-fp32,bh-fp32")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    args = parser.parse_args()
    torch.manual_seed(0)
    b, s, h, d = args.batch, args.seqlen, args.heads, args.hdim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for name in args.biases.split(","):
        dims, dtype = name.split("-")
        shape = {"1h": (1, h), "b1": (b, 1), "bh": (b, h)}[dims] + (s, s)
        bias = torch.randn(shape, device="cuda").to(DTYPES[dtype])
        for causal in causals:
            if args.which in ("fwd", "all"):
                with torch.no_grad():
                    ms = time_cuda_ms_interleaved(
                        {"fwd": lambda: fa3gen.flash_attn_func(q, k, v, attn_bias=bias, causal=causal)}, 3, 15, 20.0)["fwd"]
                print(f"fwd bias {dims} {dtype} causal={causal}: {ms:.3f} ms "
                      f"{attn_fwd_flops(b, h, s, s, d, causal) / ms / 1e9:.1f} TFLOP/s", flush=True)
            if args.which in ("bwd", "all"):
                grad_bias = bias.detach().requires_grad_()
                out = fa3gen.flash_attn_func(q, k, v, attn_bias=grad_bias, causal=causal)
                dout = torch.randn_like(out)
                ms = time_cuda_ms_interleaved(
                    {"bwd": lambda: torch.autograd.grad(out, (q, k, v, grad_bias), dout, retain_graph=True)},
                    3, 15, 20.0)["bwd"]
                print(f"bwd bias {dims} {dtype} causal={causal}: {ms:.3f} ms "
                      f"{attn_bwd_flops(b, h, s, s, d, causal) / ms / 1e9:.1f} TFLOP/s", flush=True)
                del grad_bias, out, dout
        del bias
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
