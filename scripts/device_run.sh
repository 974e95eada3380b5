#!/usr/bin/env bash
# The one script a session runs on the lent H200 (from the repo root there). Every step's output
# is tee'd into a few files under $OUT (they come back): 
#   env.log        setup, nvidia-smi, `fa3gen doctor`, the step summary
#   build.log      scripts/gpu_specs.py --build (fills what the carried cache lacks), the cold-compile probe
#   checks.log     SASS check of every built kernel (HGMMA or fp8 QGMMA, UTMALDG, no LDL/STL), compute-sanitizer, ncu
# (at most 8 files come back from a device call: keep it to these)
#   gpu_tests.log  pytest -m gpu tests/gpu
#   bench.md       `fa3gen bench` output: spot checks and the TFLOP/s table
#   bench-*.json   the bench results as JSON, one file per dtype
#
# Usage: scripts/device_run.sh [STEP ...]      (default: doctor build sass tests bench)
#   steps: doctor build sass tests sanitize bench ablation compare variants bwd profile cold all
#     sanitize  compute-sanitizer ($SANITIZE_TOOLS, default memcheck) on a tiny python run
#               (forward cases, then backward ones unless SANITIZE_BWD=0)
#     ablation  `fa3gen bench --ablation` (FA3 paper's ablation through spec switches)
#     profile   ncu (Speed of Light, compute and memory workload, warp states) of fa3gen and cuDNN on
#               the cases of $PROFILE_CASES (default "128 512;128 512 causal"): checks.log
#     variants  each examples/*.py (fp64 checks) and scripts/bench_variants.py (variant timings): bench.md
#     bwd       scripts/bwd_smoke.py $BWD_ARGS (default --time): backward fp64 checks and TFLOP/s: bench.md
#     compare   scripts/kernel_smoke.py --time on each spec of $COMPARE_SPECS (JSON specs, ';'-separated):
#               fp64 checks, then TFLOP/s beside cuDNN in one process (quick A/B of spec variants)
#     cold      time one spec's cold compile into an empty cache and its warm load (~1-2 min)
#     all       doctor build sass tests sanitize bench cold
# The cache is compiled on the CPU machine and carried packed: `FA3GEN_CACHE_DIR=.devcache python
# scripts/pack_devcache.py --build -j 2 gpu` writes .devcache.tar.xz (only the entries of today's
# specs); carry it (the setup step unpacks it). Kernels missing from it compile on the device.
# Env: OUT (default ./device-out), JOBS (16), FA3GEN_CACHE_DIR (default ./.devcache, carried),
#      BENCH_ARGS (extra `fa3gen bench` args, e.g. "--hdim 128 --seqlens 2k,16k"), BENCH_DTYPES ("bf16 fp16"),
#      PYTEST_ARGS (extra pytest args, e.g. "-k graph"; with TEST_SHARDS: the test paths, default tests/gpu),
#      TEST_SHARDS (';'-separated -k expressions, run as parallel pytest processes, e.g.
#      "d64- or d96-;d128- or d192-;not (d64- or d96- or d128- or d192-)"), TESTS_TIMEOUT (s, 420), BENCH_TIMEOUT (s, 300),
#      COMPARE_SPECS (for compare; built with the build step when it runs first)
# The device allows 600 s per command: `all` may not fit; run subsets across calls.
# A failing step does not stop later ones; the exit status is nonzero if any step failed.

set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
JOBS=${JOBS:-16}
export FA3GEN_CACHE_DIR=${FA3GEN_CACHE_DIR:-$PWD/.devcache}

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(doctor build sass tests bench)
[[ " ${steps[*]} " == *" all "* ]] && steps=(doctor build sass tests sanitize bench cold)

declare -a summary=()
failed=0

# run_step NAME LOGFILE FUNCTION: runs FUNCTION with its output appended to $OUT/LOGFILE.
run_step() {
  local name=$1 log="$OUT/$2" fn=$3 t0 rc
  t0=$(date +%s)
  echo "===== [$name] $(date -u +%FT%TZ) =====" | tee -a "$log"
  "$fn" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  echo "===== [$name] rc=$rc in ${dt}s =====" | tee -a "$log"
  summary+=("$(printf '%-9s rc=%-3s %5ss  -> %s' "$name" "$rc" "$dt" "$2")")
  [[ $rc -ne 0 ]] && failed=1
  return 0
}

step_setup() {
  if [[ -f .devcache.tar.xz ]]; then tar xJf .devcache.tar.xz || return 1; fi  # scripts/pack_devcache.py
  mkdir -p "$FA3GEN_CACHE_DIR"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      || return 1
  else
    echo "warning: no .whl/ here; run ../shared/device/fetch-wheels.sh on the CPU machine and carry .whl"
  fi
  echo "PYTHONPATH=$PYTHONPATH FA3GEN_CACHE_DIR=$FA3GEN_CACHE_DIR steps: ${steps[*]}"
  "$PY" -c "import sys, torch, pydantic; print(sys.version.split()[0], 'torch', torch.__version__, 'pydantic', pydantic.__version__)"
}

step_doctor() {
  local rc=0
  nvidia-smi || rc=1
  "$PY" -m fa3gen.cli doctor || rc=1
  return $rc
}

step_build() {
  # Every spec the session's GPU work runs (scripts/gpu_specs.py: registry, GPU tests, ablation,
  # the sanitizer's pingpong spec) plus $COMPARE_SPECS, in one parallel build; cached ones load.
  local rc=0 extras=()
  mapfile -t extras < <(compare_specs)
  ( r=0; for extra in "${extras[@]}"; do "$PY" -m fa3gen.cli build "$extra" || r=1; done; exit $r ) &
  "$PY" scripts/gpu_specs.py --build -j "$JOBS" || rc=1
  wait $! || rc=1
  return $rc
}

step_sass() {
  local libs bad=0 so sass h t l s
  mapfile -t libs < <(find "$FA3GEN_CACHE_DIR" -name kernel.so -not -path '*/tmp/*' | sort)
  if [[ ${#libs[@]} -eq 0 ]]; then echo "no kernel.so under $FA3GEN_CACHE_DIR"; return 1; fi
  sass=$(mktemp)
  printf '%-44s %7s %8s %5s %5s\n' entry GMMA UTMALDG LDL STL
  for so in "${libs[@]}"; do
    if ! cuobjdump --dump-sass "$so" >"$sass" 2>&1; then echo "cuobjdump failed on $so"; bad=1; continue; fi
    h=$(grep -cE '[HQ]GMMA' "$sass"); t=$(grep -c UTMALDG "$sass"); l=$(grep -c -w LDL "$sass"); s=$(grep -c -w STL "$sass")  # QGMMA: fp8
    printf '%-44s %7s %8s %5s %5s\n' "$(basename "$(dirname "$so")")" "$h" "$t" "$l" "$s"
    if [[ $h -eq 0 || $t -eq 0 || $l -ne 0 || $s -ne 0 ]]; then bad=1; fi
  done
  echo "--- resource usage of the first kernel ---"
  cuobjdump --dump-resource-usage "${libs[0]}" 2>&1 | grep -E 'Function|REG|SHARED|STACK' | head -20
  rm -f "$sass"
  [[ $bad -eq 0 ]] && echo "SASS check: OK (HGMMA and UTMALDG present, no LDL/STL)" \
                   || echo "SASS check: FAILED (see the rows above)"
  return $bad
}

step_tests() {
  local extra=() shards=() i rc=0
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout=300)
  if [[ -z ${TEST_SHARDS:-} ]]; then
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-420}" "$PY" -m pytest -q -m gpu tests/gpu -x -rs -p no:cacheprovider \
      --durations=10 "${extra[@]}" ${PYTEST_ARGS:-}
    return
  fi
  # One pytest per ';'-separated -k expression, all at once: the tests are host-bound (float64
  # references, SDPA baselines), so shards share the GPU well (the 248 backward tests: about 60 s
  # in three shards). Their logs follow one another in this step's log, then a line per shard.
  local logs
  logs=$(mktemp -d)
  mapfile -t shards < <(tr ';' '\n' <<<"$TEST_SHARDS" | sed '/^ *$/d')
  for i in "${!shards[@]}"; do
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-420}" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider "${extra[@]}" \
      -k "${shards[$i]}" ${PYTEST_ARGS:-tests/gpu} >"$logs/$i.log" 2>&1 &
  done
  for i in "${!shards[@]}"; do wait -n || rc=1; done
  for i in "${!shards[@]}"; do echo "--- shard $i: -k ${shards[$i]}"; cat "$logs/$i.log"; done
  for i in "${!shards[@]}"; do
    echo "shard $i: $(grep -E '[0-9]+ (passed|failed|errors?|skipped)' "$logs/$i.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$logs/$i.log" | head -10
  done
  rm -rf "$logs"
  return $rc
}

step_sanitize() {
  local script=/tmp/fa3gen_sanitize.py tool rc=0
  cat >"$script" <<'EOF'
import sys
import torch
import fa3gen
cases = [  # (b, sq, sk, hq, hkv, d, dtype, causal): ragged, GQA, sq != sk, masked rows
    (1, 17, 113, 4, 2, 128, torch.bfloat16, True),
    (2, 113, 17, 2, 1, 64, torch.float16, True),
    (1, 1, 1, 1, 1, 256, torch.bfloat16, False),
    (2, 300, 77, 2, 1, 256, torch.bfloat16, True),  # O staged in the V buffer; tiles without keys stage zeros
    (1, 200, 200, 2, 2, 96, torch.float16, False),
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, False),  # 192 tiles: CTAs chain two (inter-tile overlap)
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, True),
]
pingpong = fa3gen.compile(sys.argv[1])  # pingpong + intra-warpgroup overlap, causal
cases.append((2, 300, 517, 4, 2, 128, torch.bfloat16, pingpong))
for b, sq, sk, hq, hkv, d, dt, causal in cases:
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt)
    if isinstance(causal, bool):
        out, lse = fa3gen.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    else:  # a compiled custom spec
        out = causal(q, k, v)
    torch.cuda.synchronize()
    print("ok", (b, sq, sk, hq, hkv, d, dt, causal), bool(torch.isfinite(out).all()))
EOF
  for tool in ${SANITIZE_TOOLS:-memcheck}; do
    echo "--- compute-sanitizer --tool $tool ---"
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 99 "$PY" "$script" "$PINGPONG_SPEC" || rc=1
    [[ ${SANITIZE_BWD:-1} == 1 ]] || continue
    echo "--- compute-sanitizer --tool $tool (backward) ---"
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 99 "$PY" scripts/sanitize_bwd.py || rc=1
  done
  return $rc
}

step_bench() {
  # One run per dtype of $BENCH_DTYPES (default bf16), each into bench-<dtype>.json.
  local rc=0 dtype
  for dtype in ${BENCH_DTYPES:-bf16}; do
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-300}" "$PY" -m fa3gen.cli bench --dtype "$dtype" --json "$OUT/bench-$dtype.json" ${BENCH_ARGS:-} || rc=1
  done
  return $rc
}

PINGPONG_SPEC='{"head_dim":128,"causal":true,"pingpong":true}'  # sanitized beside the registry kernels (scripts/gpu_specs.py builds it)

compare_specs() { [[ -n ${COMPARE_SPECS:-} ]] && tr ';' '\n' <<<"$COMPARE_SPECS" | sed '/^ *$/d'; }

step_compare() {
  local specs=()
  mapfile -t specs < <(compare_specs)
  [[ ${#specs[@]} -eq 0 ]] && { echo "COMPARE_SPECS is empty"; return 1; }
  timeout "${BENCH_TIMEOUT:-300}" "$PY" scripts/kernel_smoke.py --time "${specs[@]}"
}

step_variants() {
  local rc=0
  local example
  for example in examples/*.py; do
    [[ $(basename "$example") == common.py ]] && continue
    echo "--- $example ---"
    timeout 120 "$PY" "$example" || rc=1
  done
  timeout "${BENCH_TIMEOUT:-300}" "$PY" scripts/bench_variants.py || rc=1
  return $rc
}

step_profile() {
  local rc=0 hdim seqlen causal
  while read -r hdim seqlen causal; do
    [[ -z $hdim ]] && continue
    echo "--- ncu: d$hdim s$seqlen ${causal:-} ---"
    timeout 240 ncu --clock-control none --kernel-name regex:'fwd_kernel|sdpa|fprop|flash' --launch-skip 2 --launch-count 4 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
      "$PY" scripts/profile_case.py --hdim "$hdim" --seqlen "$seqlen" ${causal:+--causal} || rc=1
  done < <(tr ';' '\n' <<<"${PROFILE_CASES:-128 512;128 512 causal}")
  return $rc
}

step_bwd() {
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" "$PY" scripts/bwd_smoke.py ${BWD_ARGS:---time}
}

step_ablation() {
  timeout "${BENCH_TIMEOUT:-300}" "$PY" -m fa3gen.cli bench --ablation
}

step_cold() {
  timeout 300 "$PY" -m fa3gen.cli bench --cold-compile --hdim 128 --seqlens 2k --causal off \
    --no-matmul --no-check --reps 5
}

export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
run_step setup env.log step_setup
for st in "${steps[@]}"; do
  case $st in
    doctor) run_step doctor env.log step_doctor ;;
    build) run_step build build.log step_build ;;
    sass) run_step sass checks.log step_sass ;;
    tests) run_step tests gpu_tests.log step_tests ;;
    sanitize) run_step sanitize checks.log step_sanitize ;;
    bench) run_step bench bench.md step_bench ;;
    cold) run_step cold build.log step_cold ;;
    ablation) run_step ablation bench.md step_ablation ;;
    compare) run_step compare bench.md step_compare ;;
    variants) run_step variants bench.md step_variants ;;
    bwd) run_step bwd bench.md step_bwd ;;
    profile) run_step profile checks.log step_profile ;;
    *) echo "unknown step: $st (doctor build sass tests sanitize bench ablation compare variants bwd profile cold all)" | tee -a "$OUT/env.log"; failed=1 ;;
  esac
done

{
  echo "===== summary ====="
  printf '%s\n' "${summary[@]}"
  echo "overall: $([[ $failed -eq 0 ]] && echo OK || echo FAILED)"
} | tee -a "$OUT/env.log"
exit $failed
