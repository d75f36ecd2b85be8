#!/usr/bin/env bash
# The one script to run on an H200 (CUDA) machine, from the repository root, in <= 8 minutes:
#   1. csrc/tests/gpu_check.sh: builds the CUDA extension (pip install --no-build-isolation --no-deps -e .),
#      runs tests/ext incl. the gpu ones, CMake + ctest device checks, ext timing;
#   2. GPU tests: bench/gpu_tests.py (kernels vs references at real shapes on CUDA, CUDA-graph capture and
#      replay of both steps, fast == reference == target greedy) and tests/ -m gpu;
#   3. the three benchmarks at a reduced sweep (draft_latency, e2e in oracle mode, kernels);
#   4. a short summary table, printed last.
# Logs and CSV/PNG go to $OUT when set (the device tool fetches it), else to a fresh temp folder.
# Every step has a timeout inside an overall budget (GPU_CHECK_BUDGET_S, default 470 s): a step that
# would start with too little time left is reported as skipped, never silently dropped.
#   PY=python3 bash bench/gpu_check.sh          (no package registry is needed on that machine)
#   GPU_CHECK_EXT=build PY=python3 bash bench/gpu_check.sh    (faster: skips the CMake/ctest half of step 1)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}
mkdir -p "$OUT/logs"
BUDGET=${GPU_CHECK_BUDGET_S:-470}
T0=$(date +%s)
STEPS="$OUT/steps.tsv"
: > "$STEPS"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
unset TRITON_INTERPRET

# step NAME TIMEOUT_S MIN_S CMD...: run CMD with a timeout clipped to the budget left; log to $OUT/logs/NAME.log
step() {
  local name=$1 limit=$2 min=$3; shift 3
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  local t=$(( limit < left - 5 ? limit : left - 5 ))
  if (( t < min )); then
    printf '%s\tSKIPPED\t0\tonly %ss of the %ss budget left\n' "$name" "$left" "$BUDGET" >> "$STEPS"
    echo "== $name: SKIPPED (only ${left}s left of ${BUDGET}s)"
    return 0
  fi
  echo "== $name (timeout ${t}s): $*"
  local s=$(date +%s) rc
  timeout --kill-after=10 "$t" "$@" > "$OUT/logs/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - s )) status=ok note
  note=$(grep -E "passed|failed|error" "$OUT/logs/$name.log" | tail -1 | cut -c1-90)
  if (( rc == 124 || rc == 137 )); then status=TIMEOUT; elif (( rc != 0 )); then status="FAILED(rc=$rc)"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$dt" "${note:-}" >> "$STEPS"
  tail -n 4 "$OUT/logs/$name.log" | sed 's/^/   | /'
}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')  commit: $(git rev-parse --short HEAD 2>/dev/null || echo "${DFLASH_COMMIT:-unknown: no .git here, pass DFLASH_COMMIT=<hash>}")"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  $PY -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/logs/env.log"

# GPU_CHECK_DRY_RUN=1: plumbing check on a CPU machine (no build, tiny shapes, CPU dry run of the tests)
if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 ]]; then
  export DFLASH_GPU_TESTS_DEVICE=cpu
  TESTS_K=(-k "commit or sampling")
  DL=(--models tiny --batch 1 --contexts 64 --blocks 1,4)
  E2E=(--model smoke --pairs oracle-3 --block 4 --prompt-len 16 --max-new 16)
  KER=(--size tiny --reps 10)
else
  TESTS_K=()
  DL=(--models qwen3-8b --batch 1,4 --contexts 2k,32k --blocks 1,4,16,32 --reps 30 --budget 0.3)
  E2E=(--model qwen3-8b --pairs oracle-6 --block 16 --prompt-len 512 --max-new 128)
  KER=(--size real --reps 50 --budget 0.2)
fi

# 1. extension. GPU_CHECK_EXT=full (default): the extension engineer's script (build with pip, tests/ext,
#    CMake + ctest device checks, ext timing; ~3-4 min); =build: only the same pip build + tests/ext
#    (saves the second nvcc compile of CMake/ctest, leaves more of the budget to the benchmarks); =skip.
EXT_MODE=${GPU_CHECK_EXT:-full}
if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 || "$EXT_MODE" == skip ]]; then
  printf 'ext_check\tSKIPPED\t0\t%s\n' "$([[ $EXT_MODE == skip ]] && echo 'GPU_CHECK_EXT=skip' || echo 'dry run (no CUDA build)')" >> "$STEPS"
elif [[ "$EXT_MODE" == build ]]; then
  step ext_build 200 60 env DFLASH_BUILD_CUDA=1 $PY -m pip install -q --no-build-isolation --no-deps -e .
  step ext_tests 60 20 $PY -m pytest -q -rs -p no:cacheprovider tests/ext
else
  step ext_check 240 60 env PY="$PY" bash csrc/tests/gpu_check.sh
fi
$PY -c "import torch, dflash_kernels as d; dev = 'cuda' if torch.cuda.is_available() else 'cpu'; print('backends on', dev, d.available_backends(dev))" 2>&1 | tee -a "$OUT/logs/env.log"

# 2. GPU tests (tests/ext, incl. its gpu-marked tests, already ran inside ext_check)
step gpu_tests 150 40 $PY -m pytest -q -rs -p no:cacheprovider bench/gpu_tests.py "${TESTS_K[@]}"

# 3. benchmarks, reduced sweep
step draft_latency 120 40 $PY bench/draft_latency.py "${DL[@]}" --out "$OUT" --tag draft_latency-gpu_check
step e2e 110 40 $PY bench/e2e.py "${E2E[@]}" --out "$OUT" --tag e2e-gpu_check
step kernels 90 30 $PY bench/kernels.py "${KER[@]}" --out "$OUT" --tag kernels-gpu_check

# 4. summary (last: the device tool returns the tail of the output)
echo
echo "################ summary ($(( $(date +%s) - T0 )) s; logs and CSV in $OUT)"
$PY bench/summarize.py "$OUT" --steps "$STEPS"
