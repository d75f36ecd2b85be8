#!/usr/bin/env bash
# The one script to run on an H200 (CUDA) machine, from the repository root. It fits a 420 s budget, a cold
# Triton cache included: every step runs under its cap and the caps add up to at most the budget; the summary
# comes last. No package registry is needed there (torch, triton, numpy and transformers as installed).
#   PY=python3 DFLASH_COMMIT=<hash> bash bench/gpu_check.sh
#   PY=.venv/bin/python bash bench/gpu_check.sh --dry-run   (or GPU_CHECK_DRY_RUN=1: the CPU plumbing check)
#
# Order: the most valuable facts first, so a run cut short still answers the first questions.
#   toolchain     bench/toolchain.py: g++ version, Python include dir (Python.h), nvcc vs torch's CUDA version;
#                 the build runs only if all three fit
#   build         the ONE build of the extension: setup.py build_ext --inplace (CPU + CUDA ops, sm_90).
#                 Nothing later builds again: tests/ext runs with -m gpu and without its two build checks
#   prewarm       every later step's workload at one repetition, all at once in parallel processes: compiles every
#                 Triton specialisation (and inductor graph) the later steps use into the shared on-disk caches,
#                 so no timed step pays a compile; reports its wall time and one row per job
#   graphs_e2e    correctness: tests/gpu/test_gpu.py's graph/runtime tests (capture + replay of both steps ==
#                 target greedy == eager, fast == reference, sampling graph == eager, bf16 draft step)
#   ext_gpu       correctness: tests/ext -m gpu (CUDA ops vs references, torch.compile, graph capture)
#   kernels_real  correctness: tests/gpu/test_gpu.py's kernels at Qwen3-8B shapes, lean target vs HF in bf16
#   step_latency  draft and verify step times (qwen3-8b, eager and graph, batch 1/8, ctx 2k/32k) next to
#                 bench/traffic.py's H200 prediction
#   draft_latency draft step times (qwen3-8b, batch 1, ctx 2k/32k, blocks 1/16)
#   e2e           end to end (qwen3-8b oracle-6, block 16, 64 new tokens)
#   kernels       sweeps: every op at real shapes
#   summary       bench/summarize.py: headline tables, every step's status, seconds and rows, the verdict
# No CPU-only tests here: tests/runtime (the graph emulator included) runs on CPU machines.
#
# Caps in seconds (a step's timeout: its cap, clipped to what is left of the budget with the summary's cap kept
# in reserve; a step left less than a third of its cap is SKIPPED, never dropped). The per-step work was
# estimated from CPU timings and compile counts, not timed on a GPU; the caps leave each step about 1.5x that.
#   toolchain      10  one torch import (~3 s cold), nvcc and g++ --version
#   build          60  three translation units side by side (ninja, 16 cores): the slowest, ops.cpp with torch's
#                      headers, took 24 s on the 2-core CPU machine; nvcc -O3 sm_90 of the .cu file 4 s; + link
#   prewarm        75  the slowest job bounds it: step_latency's (qwen3-8b pair made on the GPU ~10 s, 8 meta-tensor
#                      predictions ~10 s, 4 engines, 4 captures) while ~40 specialisations compile at 2.5-3.6 s each
#                      on 16 cores (~10 s of wall time); the 7 jobs hold ~90 GB of the 141 GB at once
#   graphs_e2e     35  pytest start-up ~8 s, tiny models, compiles cached by prewarm
#   ext_gpu        35  62 tests, the two inductor compiles cached by prewarm
#   kernels_real   30  25 tests at real shapes, cached compiles, runs of milliseconds
#   step_latency   50  predictions ~10 s, model ~10 s, 4 engines, 16 medians of <= 20 reps or 0.2 s, 4 captures
#   draft_latency  30  draft + LM head ~5 s, 12 measurements x (warm-up + 0.15 s), 2 captures
#   e2e            55  qwen3-8b pair ~10 s, 4 runtimes with a warm-up each; HF AR 64 tokens ~2 s
#   kernels        25  9 ops x 27 shapes x 2-3 backends, 20 reps or 0.05 s per row, graph replays
#   summary         5  reads the CSVs
#   total         410  of 420
# Output under $OUT (the device tool brings back at most 8 files): gpu_check.log (every step's output in order),
# steps.tsv (status, seconds, rows written as they came), tests.csv (one row per test), the four benchmark CSVs
# (a <name>.partial.csv instead for a benchmark stopped at its cap), draft_latency's PNG.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
[[ "${1:-}" == --dry-run ]] && DRY=1
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.tsv"
TESTS="$OUT/tests.csv"
: > "$LOG"
: > "$STEPS"
rm -f "$TESTS"
BUDGET=${GPU_CHECK_BUDGET_S:-420}
WORK=$(mktemp -d /tmp/gpu_check_work.XXXX)  # prewarm outputs and the rows journal: not brought back
export DFLASH_ROWS_JOURNAL="$WORK/rows.journal"
: > "$DFLASH_ROWS_JOURNAL"
T0=$(date +%s)
# the checkout's packages (and the extension built in place) win over anything installed; bench/ for -p pytest_rows
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export DFLASH_COMMIT=${DFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown: no .git here and no DFLASH_COMMIT")}

ORDER=(toolchain build prewarm graphs_e2e ext_gpu kernels_real step_latency draft_latency e2e kernels summary)
declare -A CAP=([toolchain]=10 [build]=60 [prewarm]=75 [graphs_e2e]=35 [ext_gpu]=35 [kernels_real]=30
                [step_latency]=50 [draft_latency]=30 [e2e]=55 [kernels]=25 [summary]=5)
# The dry run runs on a shared 2-core CPU: timeouts (not the caps' sum) get this much slack there.
SLACK=1
[[ "$DRY" == 1 ]] && SLACK=${GPU_CHECK_DRY_SLACK:-6}

record() {  # record NAME STATUS SECONDS NOTE
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEPS"
  echo "== $1: $2${4:+ ($4)}" | tee -a "$LOG"
}

rows_written() {  # rows_written FILE_NAME: the most rows the journal saw in that partial file (0: none)
  awk -F'\t' -v f="$1" '$1 == f && $2 > n {n = $2} END {print n + 0}' "$DFLASH_ROWS_JOURNAL"
}

timeout_for() {  # timeout_for NAME: the step's timeout, or nothing when too little of the budget is left
  local cap=$(( CAP[$1] * SLACK )) left=$(( (BUDGET - CAP[summary]) * SLACK - ($(date +%s) - T0) ))
  local t=$(( cap < left ? cap : left ))
  (( t * 3 >= cap )) && echo "$t"
}

# step NAME PARTIAL CMD...: CMD under the step's timeout, output appended to $LOG; PARTIAL: the file name the step
# writes its rows to as it goes (checked through the journal: a step with no row is a problem)
step() {
  local name=$1 partial=$2; shift 2
  local t
  t=$(timeout_for "$name") || { record "$name" SKIPPED 0 "only $(( BUDGET - ($(date +%s) - T0) ))s of the ${BUDGET}s budget left"; return 0; }
  echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
  local from=$(( $(wc -l < "$LOG") + 1 )) s=$(date +%s) rc
  timeout --kill-after=10 "$t" "$@" >> "$LOG" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - s )) status=ok note rows
  rows=$(rows_written "$partial")
  note=$(tail -n +"$from" "$LOG" | grep -E "^([0-9]+ (passed|failed|skipped|deselected|errors?)|# wrote )" | tail -1 | cut -c1-80)
  if (( rc == 124 || rc == 137 )); then status=TIMEOUT
  elif (( rc == 5 )); then status=EMPTY; note="no tests selected"
  elif (( rc != 0 )); then status="FAILED(rc=$rc)"
  elif (( rows == 0 )); then status=NO-ROWS; note="no row reached $partial while it ran"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "rows ${rows}${note:+; $note}" >> "$STEPS"
  tail -n +"$from" "$LOG" | tail -n 4 | sed 's/^/   | /'
}

# test_step NAME PYTEST_ARGS...: a pytest step; its rows (one per test) are folded into tests.csv afterwards
test_step() {
  local name=$1; shift
  GPU_CHECK_ROWS="$OUT/$name.partial.csv" step "$name" "$name.partial.csv" "${PYTEST[@]}" "$@"
  if [[ -f "$OUT/$name.partial.csv" ]]; then
    [[ -f "$TESTS" ]] || echo "step,test,phase,outcome,seconds" > "$TESTS"
    awk -v s="$name" 'NR > 1 {print s "," $0}' "$OUT/$name.partial.csv" >> "$TESTS"
    rm -f "$OUT/$name.partial.csv"
  fi
}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')  commit: $DFLASH_COMMIT"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
} 2>&1 | tee -a "$LOG"

total=0
for s in "${ORDER[@]}"; do total=$(( total + CAP[$s] )); done
if (( total <= BUDGET )); then record caps ok 0 "the caps add up to ${total}s of the ${BUDGET}s budget"
else record caps OVER-BUDGET 0 "the caps add up to ${total}s, over the ${BUDGET}s budget"; fi

PYTEST=($PY -m pytest -q -rs -p no:cacheprovider -p pytest_rows)
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
EXT_SEL=(-m gpu tests/ext -k "not nvcc_compiles and not cmake_build")
ONCE=(--warmup 1 --reps 1 --budget 0)  # prewarm: the same work, timed once

# 1. g++, Python.h, nvcc vs torch's CUDA (the nvcc found is exported as CUDA_HOME for the build)
s=$(date +%s)
TC_OUT=$(timeout "$(( CAP[toolchain] * SLACK ))" $PY bench/toolchain.py 2>&1)
TC_RC=$?
echo "$TC_OUT" | grep -v '^toolchain: ' | tee -a "$LOG"
TOOLCHAIN=$(grep '^toolchain: ' <<< "$TC_OUT" || echo "toolchain: bench/toolchain.py failed: $(tail -n 1 <<< "$TC_OUT")")
home=$(sed -n 's/^cuda_home: //p' <<< "$TC_OUT")
[[ -n "$home" ]] && export CUDA_HOME=$home
case $TC_RC in 0) TC_STATUS=ok ;; 2) TC_STATUS=MISMATCH ;; 3) TC_STATUS=NO-HOST-TOOLS ;; *) TC_STATUS=NO-CUDA ;; esac
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
  t=$(timeout_for build) || t=0
  s=$(date +%s)
  echo "== build (timeout ${t}s): ${BUILD[*]}" | tee -a "$LOG"
  if (( t > 0 )) && timeout --kill-after=10 "$t" "${BUILD[@]}" >> "$LOG" 2>&1; then
    record build ok $(( $(date +%s) - s )) "the extension is built in place"
  else
    record build "FAILED" $(( $(date +%s) - s )) "see gpu_check.log; the ext backend stays unavailable"
  fi
fi
$PY -c "import torch, dflash_kernels as d; dev = 'cuda' if torch.cuda.is_available() else 'cpu'; print('backends on', dev, d.available_backends(dev))" 2>&1 | tee -a "$LOG"

# 3. prewarm: the later steps' work at one repetition, every job at once; a row per job as it ends
prewarm() {
  local t=$1 job pids=()
  local -A JOBS=(
    [tests_graphs]="${PYTEST[*]} tests/gpu/test_gpu.py ${GRAPH_SEL[*]@Q}"
    [tests_kernels]="${PYTEST[*]} tests/gpu/test_gpu.py ${KERNEL_SEL[*]@Q}"
    [tests_ext]="${PYTEST[*]} ${EXT_SEL[*]@Q}"
    [step_latency]="$PY bench/step_latency.py ${SL[*]} ${ONCE[*]} --out $WORK --tag step_latency-warm"
    [draft_latency]="$PY bench/draft_latency.py ${DL[*]} ${ONCE[*]} --out $WORK --tag draft_latency-warm"
    [e2e]="$PY bench/e2e.py ${E2E[*]} --runtimes ar-fast,fast --out $WORK --tag e2e-warm"
    [kernels]="$PY bench/kernels.py ${KER[*]} ${ONCE[*]} --out $WORK --tag kernels-warm"
  )
  echo "job,status,seconds" > "$OUT/prewarm.partial.csv"
  for job in "${!JOBS[@]}"; do
    (
      s=$(date +%s)
      DFLASH_ROWS_JOURNAL= GPU_CHECK_ROWS= timeout --kill-after=5 "$t" bash -c "${JOBS[$job]}" > "$WORK/$job.log" 2>&1
      rc=$?
      case $rc in 0) st=ok ;; 124|137) st=TIMEOUT ;; *) st="FAILED(rc=$rc)" ;; esac
      echo "$job,$st,$(( $(date +%s) - s ))" >> "$OUT/prewarm.partial.csv"
      printf 'prewarm.partial.csv\t%s\n' "$(( $(wc -l < "$OUT/prewarm.partial.csv") - 1 ))" >> "$DFLASH_ROWS_JOURNAL"
    ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for job in "${!JOBS[@]}"; do
    echo "-- prewarm job $job: ${JOBS[$job]}"
    tail -n 6 "$WORK/$job.log" | sed 's/^/   | /'
  done
  awk -F, 'NR > 1 && $2 != "ok" {bad = 1} END {exit bad}' "$OUT/prewarm.partial.csv"
}
if t=$(timeout_for prewarm); then
  echo "== prewarm (timeout ${t}s): 7 jobs in parallel" | tee -a "$LOG"
  s=$(date +%s)
  prewarm "$t" >> "$LOG" 2>&1
  rc=$?
  rows=$(rows_written prewarm.partial.csv)
  if (( rows == 0 )); then st=NO-ROWS; elif (( rc != 0 )); then st="FAILED(a job)"; else st=ok; fi
  record prewarm "$st" $(( $(date +%s) - s )) "rows $rows; $(( $(date +%s) - s ))s of wall time for every compile"
  awk -F, 'NR > 1 {printf "prewarm/%s\t%s\t%s\t\n", $1, $2, $3}' "$OUT/prewarm.partial.csv" >> "$STEPS"
  rm -f "$OUT/prewarm.partial.csv"
else
  record prewarm SKIPPED 0 "only $(( BUDGET - ($(date +%s) - T0) ))s of the ${BUDGET}s budget left"
fi

# 4. correctness at real shapes
test_step graphs_e2e tests/gpu/test_gpu.py "${GRAPH_SEL[@]}"
test_step ext_gpu "${EXT_SEL[@]}"
test_step kernels_real tests/gpu/test_gpu.py "${KERNEL_SEL[@]}"

# 5. draft/verify step times, then end to end, then the sweeps
step step_latency step_latency-gpu_check.partial.csv \
  $PY bench/step_latency.py "${SL[@]}" --out "$OUT" --tag step_latency-gpu_check
step draft_latency draft_latency-gpu_check.partial.csv \
  $PY bench/draft_latency.py "${DL[@]}" --out "$OUT" --tag draft_latency-gpu_check
step e2e e2e-gpu_check.partial.csv $PY bench/e2e.py "${E2E[@]}" --out "$OUT" --tag e2e-gpu_check
step kernels kernels-gpu_check.partial.csv $PY bench/kernels.py "${KER[@]}" --out "$OUT" --tag kernels-gpu_check
rm -f "$OUT"/*.tmp  # a write cut by a timeout; the partial file beside it holds every finished row

# 6. summary, last: the device tool returns the tail of the output
echo
echo "################ summary ($(( $(date +%s) - T0 )) s of a ${BUDGET} s budget; log and CSVs in $OUT; commit $DFLASH_COMMIT)"
timeout "$(( CAP[summary] * SLACK ))" $PY bench/summarize.py "$OUT" --steps "$STEPS"
echo "$TOOLCHAIN"
awk -F'\t' '$1 !~ /^prewarm\// {n[$2 ~ /^(ok|SKIPPED)$/ ? $2 : "problem"]++} END {printf "gpu_check: %d ok, %d skipped, %d with a problem (TIMEOUT, FAILED, EMPTY, NO-ROWS, OVER-BUDGET, MISMATCH, NO-HOST-TOOLS, NO-CUDA)\n", n["ok"], n["SKIPPED"], n["problem"]}' "$STEPS"
rm -rf "$WORK"
