"""`fa3gen bench`: fa3gen's forward or backward beside torch SDPA (cuDNN and flash backends), one process.

The FlashAttention-3 paper's setup: 16k tokens in total (batch = 16384 // seqlen), hidden size
2048 (nheads = 2048 // head_dim), head dims 64/128/256, seqlen 512..16k, causal and not. Every
implementation runs on the same inputs, timed with CUDA events after a warm-up; the median of
the repetitions counts. FLOPs of the forward: 4 * batch * nheads * seqlen_q * seqlen_k * head_dim,
halved when causal (the FA convention).

`--pass bwd` (or `both`) times the backward instead (or as well): fa3gen's op-level backward (validation,
allocation and the backward kernels, given q, k, v, dout and the out and lse of one forward done
beforehand) against ``torch.autograd.grad`` of an SDPA output computed once with the same backend.
FLOPs of the backward: 2.5 times the forward's (FA's convention: 5 matmuls to the forward's 2).

SDPA takes (batch, nheads, seqlen, head_dim): it gets transposed views of the same tensors. Its
causal mask is top-left aligned, fa3gen's bottom-right; with seqlen_q == seqlen_k they coincide.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HDIMS = (64, 128, 256)
PASSES = {"fwd": ("fwd",), "bwd": ("bwd",), "both": ("fwd", "bwd")}
PEERS = ("cudnn", "flash")
PEER_TITLES = {"fa3gen": "fa3gen", "cudnn": "cuDNN", "flash": "FA2"}


def attn_fwd_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   causal: bool, head_dim_v: int | None = None) -> float:
    """Forward FLOPs: 2·b·h·sq·sk·(d + dv) (= 4·b·h·sq·sk·d when dv == d), halved when causal."""
    dv = head_dim if head_dim_v is None else head_dim_v
    flops = 2.0 * batch * nheads * seqlen_q * seqlen_k * (head_dim + dv)
    return flops / 2 if causal else flops


def attn_bwd_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   causal: bool, head_dim_v: int | None = None) -> float:
    """Backward FLOPs: 2.5 times the forward's (halved when causal, like it)."""
    return 2.5 * attn_fwd_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, head_dim_v)


def bench_cases(hdims, seqlens, causals, total_tokens: int = 16384, hidden: int = 2048):
    """(head_dim, seqlen, batch, nheads, causal) of each case, in table order."""
    cases = []
    for d in hdims:
        for s in seqlens:
            for c in causals:
                cases.append((d, s, max(1, total_tokens // s), max(1, hidden // d), c))
    return cases


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.replace(",", " ").split():
        part = part.strip().lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(part) * mult)
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fa3gen bench", description=__doc__.splitlines()[0])
    ap.add_argument("--hdim", default=",".join(map(str, DEFAULT_HDIMS)), help="head dims, comma list")
    ap.add_argument("--pass", dest="passes", choices=tuple(PASSES), default="fwd",
                    help="time the forward (default), the backward, or both")
    ap.add_argument("--seqlens", default="512,1k,2k,4k,8k,16k", help="seqlens, comma list (k = 1024)")
    ap.add_argument("--causal", choices=("both", "on", "off"), default="both")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--total-tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions; the median counts")
    ap.add_argument("--min-rep-ms", type=float, default=2.0,
                    help="calls per repetition are batched until one repetition takes about this long")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 4,
                    help="parallel kernel builds before timing")
    ap.add_argument("--cold-compile", action="store_true",
                    help="also time a cold compile of one spec into an empty cache (a subprocess)")
    ap.add_argument("--no-check", action="store_true", help="skip the spot check against cuDNN SDPA")
    ap.add_argument("--no-matmul", action="store_true", help="skip the bf16 8192^3 matmul ceiling")
    ap.add_argument("--matmul-n", type=int, default=8192, help=argparse.SUPPRESS)  # tests: a small ceiling on cpu
    ap.add_argument("--ablation", action="store_true",
                    help="the FA3 paper's ablation instead of the grid: hdim 128, b=4, s=8448, h=16, "
                         "one spec switch off at a time")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table to this file")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests: a dry run on cpu
    args = ap.parse_args(argv)
    args.passes = PASSES[args.passes]
    return args


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def error_line(e: BaseException) -> str:
    """An exception as one table-safe line: its type and the first line of its message."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


CALLS_PER_GRAPH = 10  # what cuda_graph_of captures by default: enough to hide a replay's own launch


def cuda_graph_of(fn: Callable[[], Any], calls: int = CALLS_PER_GRAPH) -> Callable[[], None]:
    """A CUDA graph of `calls` back-to-back calls of fn, as a function that replays it: timed
    against eager calls, it takes the host's per-call cost out (a replay launches them all)."""
    import torch

    fn()  # compile/load before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def time_cuda_ms(fn: Callable[[], Any], warmup: int, reps: int, min_rep_ms: float) -> float:
    """Median milliseconds per call of fn, CUDA events around batches of back-to-back calls."""
    ms = time_cuda_ms_interleaved({"fn": fn}, warmup, reps, min_rep_ms)["fn"]
    if isinstance(ms, Exception):
        raise ms
    return ms


def time_cuda_ms_interleaved(fns: dict[str, Callable[[], Any]], warmup: int, reps: int,
                             min_rep_ms: float) -> dict[str, float | Exception]:
    """Median milliseconds per call of each fn, timed in interleaved rounds: every round runs one
    batch of each fn, in an order rotated round to round. Timed one after another, the first
    implementation ran at clocks the later ones no longer got (up to 8-12% apart on the H200);
    interleaving gives every implementation the same share of the GPU's clock and thermal drift.
    A fn that raises gets its exception instead of a time."""
    import torch

    inner: dict[str, int] = {}
    result: dict[str, float | Exception] = {}
    for name, fn in fns.items():
        try:
            for _ in range(max(1, warmup)):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            inner[name] = max(1, min(100, math.ceil(min_rep_ms / max(start.elapsed_time(end), 1e-3))))
        except Exception as e:  # noqa: BLE001 - reported per implementation by the caller
            result[name] = e
            torch.cuda.synchronize()
    names = list(inner)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # An untimed call first keeps the GPU busy while the host prepares the first timed one:
            # from an idle GPU, a batch of one call (a kernel of 2 ms or more) timed that call's host
            # work too (the attn_bias path's 0.5-1 ms of Python doubled as kernel time).
            fns[name]()
            start.record()
            for _ in range(inner[name]):
                fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / inner[name])
    result.update({name: statistics.median(t) for name, t in times.items()})
    return {name: result[name] for name in fns}


class MatmulCeiling:
    """The ceiling line: a bf16 n³ torch.matmul on one device, called like the implementations it
    is timed beside."""

    def __init__(self, device, n: int = 8192):
        import torch

        self.n = n
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def __call__(self) -> Any:
        import torch

        return torch.matmul(self.a, self.b)

    def tflops(self, ms: float) -> float:
        return 2 * self.n**3 / (ms * 1e-3) / 1e12

    def tflops_alone(self, warmup: int, reps: int, min_rep_ms: float) -> float:
        return self.tflops(time_cuda_ms(self, warmup, reps, min_rep_ms))


def matmul_bf16_tflops(device, warmup: int, reps: int, min_rep_ms: float, n: int = 8192) -> float:
    """TFLOP/s of a bf16 n³ torch.matmul on `device`, timed alone."""
    return MatmulCeiling(device, n).tflops_alone(warmup, reps, min_rep_ms)


# ---------------------------------------------------------------------------------------------
# kernels: build up front, cold/warm compile timing
# ---------------------------------------------------------------------------------------------

def _prepare_kernels(keys: list[tuple[Any, ...]], jobs: int,
                     bwd_keys: list[tuple[int, int, str, bool]] = ()) -> dict[str, Any]:
    """Build (or load from the cache) every kernel the bench needs, in parallel: the forward kernels
    of `keys`, the backward kernels of `bwd_keys`. Returns timings."""
    import fa3gen
    from fa3gen import ops, registry

    specs = [registry.default_spec(*k) for k in keys] + [registry.default_bwd_spec(*k) for k in bwd_keys]
    info: dict[str, Any] = {"specs": [s.name for s in specs]}
    t0 = time.perf_counter()
    build_many = getattr(fa3gen, "build_many", None)
    if callable(build_many):  # one parallel build of everything missing
        results = build_many(specs, jobs=jobs, progress=lambda line: print(f"  {line}", flush=True))
        info["builds"] = {r.spec.name: ("cached" if r.cached else round(r.seconds, 2)) for r in results}
        info["build_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    loads = [(ops._kernel_for, key) for key in keys] + [(ops._bwd_kernel_for, key) for key in bwd_keys]
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(loads)))) as pool:
        list(pool.map(lambda load: load[0](*load[1]), loads))
    info["load_s"] = time.perf_counter() - t1
    info["total_s"] = time.perf_counter() - t0
    return info


_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import fa3gen
from fa3gen import registry
t1 = time.perf_counter()
spec = registry.default_spec(*json.loads(sys.argv[1]))
t2 = time.perf_counter()
c = getattr(fa3gen, "compile")
c = c if callable(c) else c.compile
k = c(spec)
t3 = time.perf_counter()
r = {"spec": spec.name, "import_s": t1 - t0, "compile_s": t3 - t2}
br = getattr(k, "build_result", None)
if br is not None:
    r["cached"] = bool(getattr(br, "cached", False))
    r["nvcc_s"] = float(getattr(br, "seconds", 0.0))
print(json.dumps(r))
"""


def _probe_compile(key: tuple[Any, ...], cache_dir: str | None) -> dict[str, Any]:
    """Time fa3gen.compile(spec) in a fresh process (so no in-process memo helps)."""
    env = dict(os.environ)
    if cache_dir is not None:  # a cold compile: empty cache, JIT allowed
        env["FA3GEN_CACHE_DIR"] = cache_dir
        env.pop("FA3GEN_NO_JIT", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(key))], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the implementations timed on one case
# ---------------------------------------------------------------------------------------------

def _failing(exc: Exception) -> Callable[[], Any]:
    def run():
        raise exc
    return run


def _fwd_fns(q, k, v, scale: float, causal: bool):
    """{impl: fn} timing the forward, and {impl: fn -> outputs in (b, s, h, d)} for the check."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa3gen import ops

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    fns: dict[str, Callable[[], Any]] = {
        "fa3gen": lambda: ops.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal),
    }

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
        return run

    fns["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    fns["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    outputs = {"fa3gen": lambda: (fns["fa3gen"](),)}
    outputs.update({p: (lambda p=p: (fns[p]().transpose(1, 2),)) for p in PEERS})
    return fns, outputs


def _bwd_fns(q, k, v, scale: float, causal: bool, gen, kernel: Any = None, variant: Any = None):
    """The backward's {impl: fn} (the forward done once beforehand, outside the timing) and
    {impl: fn -> (dq, dk, dv) in (b, s, h, d)} for the check. fa3gen runs `kernel` (a compiled
    backward spec, with its deterministic switch) when given, else the registry's; `variant`
    (fa3gen.variant_args.VariantArgs) gives fa3gen's forward and backward the built-in variants'
    values (the peers run without them)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa3gen import ops

    dout = torch.randn(q.shape[:3] + v.shape[-1:], device=q.device, dtype=q.dtype, generator=gen)
    fns: dict[str, Callable[[], Any]] = {}
    try:
        values = {} if variant is None else {"variant": variant}
        out, lse = ops._forward_impl(q, k, v, scale, causal, **values)
        deterministic = kernel.spec.deterministic if kernel is not None else False
        fns["fa3gen"] = lambda: ops._backward_impl(dout, q, k, v, out, lse, scale, causal, deterministic, kernel,
                                                   **values)
    except Exception as e:  # reported as this implementation's error
        fns["fa3gen"] = _failing(e)

    def sdpa(backend):
        try:
            leaves = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
            with torch.enable_grad(), sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
        except Exception as e:
            return _failing(e)
        dot = dout.transpose(1, 2)
        return lambda: torch.autograd.grad(o, leaves, dot, retain_graph=True)

    fns["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    fns["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    outputs = {"fa3gen": fns["fa3gen"]}
    outputs.update({p: (lambda p=p: tuple(g.transpose(1, 2) for g in fns[p]())) for p in PEERS})
    return fns, outputs


def _check(entry: dict[str, Any], outputs: dict[str, Callable[[], Any]]) -> str:
    """fa3gen's outputs vs the first peer that runs: max abs difference, and all finite."""
    import torch

    try:
        mine = outputs["fa3gen"]()
        peer = None
        for p in PEERS:
            try:
                peer = outputs[p]()
                entry["check_peer"] = p
                break
            except Exception:
                continue
        finite = all(bool(torch.isfinite(t).all()) for t in mine)
        entry["check_finite"] = finite
        if peer is not None:
            entry["check_max_abs_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(mine, peer))
        return (f"max|fa3gen-{entry.get('check_peer', 'none')}| = "
                f"{entry.get('check_max_abs_diff', float('nan')):.3e}, finite={finite}")
    except Exception as e:
        entry["check_error"] = f"{type(e).__name__}: {e}"
        return f"check failed: {entry['check_error']}"


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _run_case(args: argparse.Namespace, dev, dtype, d: int, s: int, b: int, h: int, causal: bool, pass_: str,
              ceiling: MatmulCeiling | None) -> tuple[dict[str, Any], str]:
    """Check and time one case of one pass: (its JSON entry, its table row). The matmul ceiling
    runs in the same interleaved rounds as the attention implementations, so fa3gen/matmul
    compares the two at the same clocks (timed alone before the cases, the same matmul read
    733 and 804 TFLOP/s in two processes on one H200 while the attention kernels moved 1%)."""
    import torch

    name = f"d{d} s{s} b{b} h{h}" + (" causal" if causal else "")
    if args.passes != ("fwd",):
        name += f" {pass_}"
    flops = (attn_fwd_flops if pass_ == "fwd" else attn_bwd_flops)(b, h, s, s, d, causal)
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dtype, generator=gen) for _ in range(3))
    fns, outputs = _fwd_fns(q, k, v, scale, causal) if pass_ == "fwd" else _bwd_fns(q, k, v, scale, causal, gen)
    entry: dict[str, Any] = {"case": name, "pass": pass_, "head_dim": d, "seqlen": s, "batch": b, "nheads": h,
                             "causal": causal, "flops": flops, "results": {}}
    if not args.no_check:
        print(f"check {name}: {_check(entry, outputs)}", flush=True)
    timed: dict[str, Callable[[], Any]] = {**fns, **({"matmul": ceiling} if ceiling is not None else {})}
    times = time_cuda_ms_interleaved(timed, args.warmup, args.reps, args.min_rep_ms)
    matmul_tflops = None
    if ceiling is not None:
        matmul_ms = times.pop("matmul")
        if isinstance(matmul_ms, Exception):
            raise matmul_ms
        matmul_tflops = entry["matmul_tflops"] = ceiling.tflops(matmul_ms)
    for impl, ms in times.items():
        if isinstance(ms, Exception):
            entry["results"][impl] = {"error": error_line(ms)}
        else:
            entry["results"][impl] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
    res = entry["results"]
    tf = {k: r.get("tflops") for k, r in res.items()}
    best_peer = max((tf[p] for p in PEERS if tf.get(p) is not None), default=None)
    ratio = tf["fa3gen"] / best_peer if tf.get("fa3gen") is not None and best_peer else None
    entry["fa3gen_over_best_peer"] = ratio
    of_matmul = tf["fa3gen"] / matmul_tflops if tf.get("fa3gen") is not None and matmul_tflops else None
    entry["fa3gen_over_matmul"] = of_matmul
    row = (f"| {name} | {_fmt(tf.get('fa3gen'))} | {_fmt(tf.get('cudnn'))} | "
           f"{_fmt(tf.get('flash'))} | {'n/a' if ratio is None else f'{ratio:.2f}x'} | "
           f"{'n/a' if of_matmul is None else f'{of_matmul:.2f}'} |")
    print(row + "   " + "  ".join(f"{k}: {r['error']}" for k, r in res.items() if "error" in r), flush=True)
    del q, k, v, fns, outputs
    torch.cuda.empty_cache()
    return entry, row


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("fa3gen bench: no CUDA device; the benchmark needs a Hopper GPU", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
        gpu = torch.cuda.get_device_name(dev)
        cap = torch.cuda.get_device_capability(dev)
        if tuple(cap) != (9, 0):
            print(f"fa3gen bench: {gpu} has capability {cap[0]}.{cap[1]}; fa3gen needs sm_90", file=sys.stderr)
            return 2
    else:
        dev, gpu = torch.device(args.device), f"{args.device} (dry run)"

    if args.ablation:
        from fa3gen import ablation

        print(f"# fa3gen bench --ablation: {gpu}, torch {torch.__version__}", flush=True)
        return ablation.run(args, lambda fns: time_cuda_ms_interleaved(fns, args.warmup, args.reps, args.min_rep_ms))

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    hdims, seqlens = _int_list(args.hdim), _int_list(args.seqlens)
    causals = {"both": (False, True), "on": (True,), "off": (False,)}[args.causal]
    cases = bench_cases(hdims, seqlens, causals, args.total_tokens, args.hidden)
    from fa3gen.registry import seqlen_bucket

    # The forward kernel of each case: (d, dv, dtype, causal, no variants, its query-length bucket).
    keys = sorted({(d, d, args.dtype, c, False, False, False, seqlen_bucket(d, c, s)) for d, s, _, _, c in cases},
                  key=str)
    bwd_keys = sorted({k[:4] for k in keys}) if "bwd" in args.passes else []
    result: dict[str, Any] = {
        "meta": {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version(), "dtype": args.dtype,
                 "total_tokens": args.total_tokens, "hidden": args.hidden,
                 "warmup": args.warmup, "reps": args.reps, "passes": list(args.passes)},
        "cases": [],
    }
    print(f"# fa3gen bench: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{args.dtype}, {args.total_tokens} tokens, hidden {args.hidden}", flush=True)

    # --- kernels up front: one parallel build, then cold/warm compile probes ---
    try:
        comp = _prepare_kernels(keys, args.jobs, bwd_keys)
    except Exception as e:  # report, keep going: fa3gen columns become n/a
        comp = {"error": f"{type(e).__name__}: {e}"}
    if "error" in comp:
        print(f"kernels: ERROR {comp['error']}", flush=True)
    else:
        print(f"kernels: {len(keys) + len(bwd_keys)} specs ready in {comp['total_s']:.2f} s (parallel build "
              f"{comp.get('build_s', float('nan')):.2f} s, in-process load {comp['load_s']:.2f} s)", flush=True)
    long_d128 = (128, 128, args.dtype, False, False, False, False, None)
    probe_key = long_d128 if long_d128 in keys else keys[0]
    warm = _probe_compile(probe_key, None)
    comp["warm_load"] = warm
    print(f"warm load (fresh process, from cache): {json.dumps(warm)}", flush=True)
    if args.cold_compile:
        with tempfile.TemporaryDirectory(prefix="fa3gen-cold-") as tmp:
            cold = _probe_compile(probe_key, tmp)
        comp["cold_compile"] = cold
        print(f"cold compile (fresh process, empty cache): {json.dumps(cold)}", flush=True)
    result["compile"] = comp

    # --- ceiling: once alone, then beside every case ---
    ceiling = None
    if not args.no_matmul:
        ceiling = MatmulCeiling(dev, args.matmul_n)
        result["matmul_n"] = ceiling.n
        result["matmul_bf16_8192_tflops"] = ceiling.tflops_alone(args.warmup, args.reps, args.min_rep_ms)
        print(f"ceiling: bf16 matmul {ceiling.n}^3 = {result['matmul_bf16_8192_tflops']:.1f} TFLOP/s alone; "
              "each case times it again beside its implementations (fa3gen/matmul uses that)", flush=True)

    # --- cases ---
    rows = []
    for d, s, b, h, causal in cases:
        for pass_ in args.passes:
            entry, row = _run_case(args, dev, dtype, d, s, b, h, causal, pass_, ceiling)
            rows.append(row)
            result["cases"].append(entry)

    header = [
        f"{'+'.join(args.passes)}, {args.dtype}, TFLOP/s ({gpu}, torch {torch.__version__}); median of {args.reps} reps",
        "",
        "| case | fa3gen | cuDNN | FA2 | fa3gen/best-peer | fa3gen/matmul |",
        "|---|---|---|---|---|---|",
    ]
    footer = []
    if "matmul_bf16_8192_tflops" in result:
        beside = sorted(e["matmul_tflops"] for e in result["cases"] if "matmul_tflops" in e)
        footer.append(f"\nCeiling: bf16 matmul {result['matmul_n']}³ = {result['matmul_bf16_8192_tflops']:.1f} TFLOP/s alone"
                      + (f"; beside the cases (fa3gen/matmul) median {statistics.median(beside):.1f}, "
                         f"{beside[0]:.1f}-{beside[-1]:.1f}" if beside else ""))
    table = "\n".join(header + rows + footer)
    print("\n" + table, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    failed = any("error" in e["results"].get("fa3gen", {}) or e.get("check_finite") is False
                 for e in result["cases"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
