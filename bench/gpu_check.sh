#!/usr/bin/env bash
# The one script to run on an H200 (CUDA) machine, from the repository root; it ends in <= 8 minutes
# with a summary printed last. No package registry is needed there.
#   PY=python3 DFLASH_COMMIT=<hash> bash bench/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 PY=.venv/bin/python bash bench/gpu_check.sh   (CPU plumbing check, tests/bench runs it)
#
# Order: correctness before timings, so a run that is cut short still answers "is it right".
#   toolchain      nvcc's CUDA version vs torch's (bench/toolchain.py); a major mismatch skips the build
#   build          the ONE build of the extension: setup.py build_ext --inplace (CPU + CUDA ops, sm_90).
#                  Nothing later builds again: tests/ext runs with -m gpu and without its two build
#                  checks (per-.cu nvcc compile, CMake + ctest), which CPU machines with nvcc run.
#   graphs_runtime tests/runtime/test_graphs.py, all of it (CUDA-graph replay tests; skipped while absent)
#   graphs_e2e     bench/gpu_tests.py: graph capture/replay of both steps == target greedy == eager,
#                  fast == reference runtime, sampling graph == eager, bf16 draft step == reference draft
#   ext_gpu        tests/ext -m gpu: CUDA ops vs references, torch.compile, graph capture of the ops
#   kernels_real   bench/gpu_tests.py: every compiled backend vs its reference at Qwen3-8B shapes, and the
#                  verify step's lean target vs HF's bf16 forward (Qwen3 and LLaMA)
#   step_latency   bench/step_latency.py: both decode steps of qwen3-8b, eager and graph, batch 1/8, ctx 2k/32k,
#                  next to bench/traffic.py's H200 prediction
#   draft_latency, e2e, kernels: the other benchmarks at a small sweep
#   summary        bench/summarize.py: headline tables and every step's status and seconds
#
# Budget per step (seconds; the cap is the step's timeout, clipped to what is left of
# GPU_CHECK_BUDGET_S=450; a step that cannot get its minimum is reported SKIPPED, never dropped):
#   step            expect  cap  how the estimate was made
#   toolchain           5     -  one torch import (~3 s cold) + nvcc --version; CPU dry run: 4 s
#   build              35   150  the three translation units, timed on the shared 2-core CPU machine:
#                                nvcc 13.0 -O3 sm_90 of csrc/cuda/dflash_kernels.cu 4 s; the same
#                                `setup.py build_ext --inplace` with CPU ops only (ops.cpp with torch's
#                                headers, C++20, -g) 24 s wall, 15 s CPU; ops_cuda.cpp is alike. ninja
#                                compiles the three side by side on 16 cores: the slowest one + link
#   graphs_runtime     30   120  not written yet; pytest start-up 8 s + the cold Triton compiles
#   graphs_e2e         60   150  CPU dry run of these 5 tests: 37 s of eager work on tiny models, which is
#                                milliseconds on the GPU; the cost there is the cold Triton cache: ~6
#                                kernels x 2-3 specialisations x ~1.5 s compile + graph capture + 8 s start
#   ext_gpu            40    90  62 tests (tests/ext's 113 CPU twins: 7 s here); the two inductor
#                                compiles on CUDA with cold caches dominate (~10-15 s each)
#   kernels_real       65   100  25 tests; compiles not already cached by graphs_e2e (head_dim 128,
#                                vocab 151936 shapes) ~1.5 s each; runs are milliseconds. The 8 new ones
#                                (verify_attention x2, add_rms_norm x2, silu_mul x2 at Qwen3-8B shapes:
#                                ~4 new specialisations, ~8 s; lean target vs HF x2 (4 layers, hidden 256,
#                                head_dim 64): ~12 specialisations of both steps' kernels ~18 s, one graph
#                                capture per step, 40-token decodes) were estimated, not timed: CPU dry
#                                run of the 8 with the torch backend 100 s, all of it bf16 CPU math
#   step_latency       45    75  imports ~8 s; the accountant's 8 predictions (2 batches x 2 contexts x
#                                eager/graph, meta tensors: 8 s for the first on the shared 2-core CPU,
#                                0.35 s each after); qwen3-8b pair (18 GB bf16, random on the GPU) ~10 s;
#                                4 engines (batch x mode; batch 8 holds 44 GB of caches at 32k), state
#                                drawn on the device; 16 medians of <= 20 reps or 0.2 s (steps 1-14 ms
#                                predicted); 4 graph captures; compiles mostly cached by kernels_real.
#                                A timeout keeps the finished engines' rows (.partial.csv)
#   draft_latency      35    60  qwen3-8b draft + embedding/LM head (4.6 GB bf16, made on the GPU), batch 1, ctx 2k/32k,
#                                blocks 1/16 x 3 providers = 12 measurements x (warm-up + 0.15 s) +
#                                compiles and one graph capture per block; was blocks 1/4/16 (45 s, with the
#                                context drawn on the host: ~2 s per 32k fill, now on the device); block 16
#                                is also in step_latency
#   e2e                60    90  qwen3-8b pair (19 GB bf16, random on the GPU: ~10 s), oracle-6, block 16,
#                                512-token prompt, 64 new tokens, 4 runtimes each with a warm-up; the
#                                eager HF AR baseline (~25 ms/token, 100 tokens) is the slowest part
#   kernels            40    60  real shapes, 20 reps or 0.05 s per row, torch/triton/ext per op: 9 ops,
#                                27 shapes (8 new: verify_attention, add_rms_norm, silu_mul); the 30 s of
#                                the 6 older ops' 19 shapes scaled, fewer reps
#   summary             3     -  reads the CSVs
#   total             ~418  450  + summary: <= 8 minutes
# Output under $OUT (the device tool returns at most 8 files): gpu_check.log (every step's output in
# order), steps.tsv, the four CSVs and draft_latency's PNG.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.tsv"
: > "$LOG"
: > "$STEPS"
BUDGET=${GPU_CHECK_BUDGET_S:-450}
T0=$(date +%s)
DRY=${GPU_CHECK_DRY_RUN:-0}
# the checkout's packages (and the extension built in place) win over anything installed
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

record() {  # record NAME STATUS SECONDS NOTE
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEPS"
  echo "== $1: $2${4:+ ($4)}" | tee -a "$LOG"
}

# step NAME CAP_S MIN_S CMD...: CMD under a timeout clipped to the budget left, output appended to $LOG
step() {
  local name=$1 cap=$2 min=$3; shift 3
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  local t=$(( cap < left - 5 ? cap : left - 5 ))
  if (( t < min )); then
    record "$name" SKIPPED 0 "only ${left}s of the ${BUDGET}s budget left"
    return 0
  fi
  echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
  local from=$(( $(wc -l < "$LOG") + 1 )) s=$(date +%s) rc
  timeout --kill-after=10 "$t" "$@" >> "$LOG" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - s )) status=ok note
  note=$(tail -n +"$from" "$LOG" | grep -E "^([0-9]+ (passed|failed|skipped|deselected|errors?)|# wrote )" | tail -1 | cut -c1-90)
  if (( rc == 124 || rc == 137 )); then status=TIMEOUT
  elif (( rc == 5 )); then status=EMPTY; note="no tests selected"
  elif (( rc != 0 )); then status="FAILED(rc=$rc)"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "${note:-}" >> "$STEPS"
  tail -n +"$from" "$LOG" | tail -n 4 | sed 's/^/   | /'
}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')  commit: $(git rev-parse --short HEAD 2>/dev/null || echo "${DFLASH_COMMIT:-unknown: no .git here, pass DFLASH_COMMIT=<hash>}")"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
} 2>&1 | tee -a "$LOG"

PYTEST=($PY -m pytest -q -rs -p no:cacheprovider)
GRAPH_K="graph or runtime or draft_step"
if [[ "$DRY" == 1 ]]; then  # plumbing check on a CPU machine: no build, tiny shapes, the cheapest tests
  export DFLASH_GPU_TESTS_DEVICE=cpu
  GRAPH_SEL=(-k sampling_graph)
  KERNEL_SEL=(-k commit_round)
  DL=(--models tiny --batch 1 --contexts 48 --blocks 4 --warmup 1 --reps 3 --budget 0.05)
  E2E=(--model smoke --pairs oracle-3 --block 4 --prompt-len 8 --max-new 8)
  KER=(--size tiny --ops verify_greedy,commit_round --warmup 1 --reps 3 --budget 0.05)
  SL=(--model tiny --batch 1 --contexts 48 --warmup 1 --reps 3 --budget 0.05)
else
  GRAPH_SEL=(-k "$GRAPH_K")
  KERNEL_SEL=(-k "not ($GRAPH_K)")
  DL=(--models qwen3-8b --batch 1 --contexts 2k,32k --blocks 1,16 --warmup 2 --reps 20 --budget 0.15)
  E2E=(--model qwen3-8b --pairs oracle-6 --block 16 --prompt-len 512 --max-new 64)
  KER=(--size real --reps 20 --budget 0.05)
  SL=(--model qwen3-8b --batch 1,8 --contexts 2k,32k --warmup 3 --reps 20 --budget 0.2)
fi

# 1. versions, and the nvcc the build will use (exported as CUDA_HOME) against torch's CUDA version
s=$(date +%s)
TC_OUT=$($PY bench/toolchain.py 2>&1)
TC_RC=$?
echo "$TC_OUT" | grep -v '^toolchain: ' | tee -a "$LOG"
TOOLCHAIN=$(grep '^toolchain: ' <<< "$TC_OUT" || echo "toolchain: bench/toolchain.py failed: $(tail -n 1 <<< "$TC_OUT")")
home=$(sed -n 's/^cuda_home: //p' <<< "$TC_OUT")
[[ -n "$home" ]] && export CUDA_HOME=$home
case $TC_RC in 0) TC_STATUS=ok ;; 2) TC_STATUS=MISMATCH ;; *) TC_STATUS=NO-CUDA ;; esac
record toolchain "$TC_STATUS" $(( $(date +%s) - s )) "${TOOLCHAIN#toolchain: }"

# 2. the one build of the extension
BUILD=(env DFLASH_BUILD_CUDA=1 DFLASH_CUDA_ARCHS="${DFLASH_CUDA_ARCHS:-90}" $PY setup.py build_ext --inplace)
if [[ "$DRY" == 1 ]]; then
  record build SKIPPED 0 "dry run: on the GPU it runs ${BUILD[*]}"
elif [[ "${GPU_CHECK_BUILD:-1}" == skip ]]; then
  record build SKIPPED 0 "GPU_CHECK_BUILD=skip: the extension already built in place is used"
elif (( TC_RC != 0 )); then
  record build SKIPPED 0 "toolchain $TC_STATUS: the ext backend stays unavailable, Triton and torch run"
else
  step build 150 30 "${BUILD[@]}"
fi
$PY -c "import torch, dflash_kernels as d; dev = 'cuda' if torch.cuda.is_available() else 'cpu'; print('backends on', dev, d.available_backends(dev))" 2>&1 | tee -a "$LOG"

# 3. correctness: CUDA-graph replay and end-to-end equality first, then the ops
if [[ -f tests/runtime/test_graphs.py ]]; then
  step graphs_runtime 120 20 "${PYTEST[@]}" tests/runtime/test_graphs.py
else
  record graphs_runtime SKIPPED 0 "tests/runtime/test_graphs.py is not there yet"
fi
step graphs_e2e 150 30 "${PYTEST[@]}" bench/gpu_tests.py "${GRAPH_SEL[@]}"
step ext_gpu 90 20 "${PYTEST[@]}" -m gpu tests/ext -k "not nvcc_compiles and not cmake_build"
step kernels_real 100 20 "${PYTEST[@]}" bench/gpu_tests.py "${KERNEL_SEL[@]}"

# 4. benchmarks, small sweeps: the decode steps against the accountant's prediction first
step step_latency 75 25 $PY bench/step_latency.py "${SL[@]}" --out "$OUT" --tag step_latency-gpu_check
step draft_latency 60 25 $PY bench/draft_latency.py "${DL[@]}" --out "$OUT" --tag draft_latency-gpu_check
step e2e 90 30 $PY bench/e2e.py "${E2E[@]}" --out "$OUT" --tag e2e-gpu_check
step kernels 60 15 $PY bench/kernels.py "${KER[@]}" --out "$OUT" --tag kernels-gpu_check

# 5. summary, last: the device tool returns the tail of the output
echo
echo "################ summary ($(( $(date +%s) - T0 )) s of a ${BUDGET} s budget; log, CSV and PNG in $OUT)"
$PY bench/summarize.py "$OUT" --steps "$STEPS"
echo "$TOOLCHAIN"
awk -F'\t' '{n[$2 ~ /^(ok|SKIPPED)$/ ? $2 : "problem"]++} END {printf "gpu_check: %d ok, %d skipped, %d with a problem (TIMEOUT, FAILED, EMPTY, MISMATCH, NO-CUDA)\n", n["ok"], n["SKIPPED"], n["problem"]}' "$STEPS"
