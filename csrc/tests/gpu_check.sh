#!/usr/bin/env bash
# GPU check of the C++/CUDA extension (run from the repository root on a CUDA machine):
# builds the CUDA ops, runs tests/ext (incl. the gpu-marked ones; its test_cmake_build_and_ctest
# builds the C ABI with CMake and runs ctest, device checks included), then times the ops.
# bench/gpu_check.sh does not call this script: it builds once and skips tests/ext's build checks.
#   PY=python bash csrc/tests/gpu_check.sh
set -euo pipefail
PY=${PY:-python}
export MAX_JOBS=${MAX_JOBS:-8}
echo "== build (DFLASH_BUILD_CUDA=1)"
start=$(date +%s)
DFLASH_BUILD_CUDA=1 $PY -m pip install -q --no-build-isolation --no-deps -e .
echo "build: $(( $(date +%s) - start )) s"
$PY -c "import dflash_kernels as d; print('ext cuda:', d.available_backends('cuda')['ext'])"
echo "== tests/ext"
$PY -m pytest -q -rs tests/ext
echo "== timing"
PYTHONPATH=. $PY csrc/tests/gpu_timing.py
