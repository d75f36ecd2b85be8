#!/usr/bin/env bash
# GPU check of the C++/CUDA extension (run from the repository root on a CUDA machine):
# builds the CUDA ops, runs tests/ext (incl. the gpu-marked ones), builds the C ABI with CMake and
# runs ctest (device checks included), then times the ops. About 3-4 minutes on 16 cores.
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
echo "== CMake + ctest (C ABI, device checks)"
NVCC=$($PY -c "from dflash_kernels._ext import _cuda_home; print(_cuda_home() + '/bin/nvcc')")
B=$(mktemp -d)
cmake -S . -B "$B" -DDFLASH_TORCH=OFF -DCMAKE_CUDA_COMPILER="$NVCC" -DDFLASH_CUDA_ARCHS="${DFLASH_CUDA_ARCHS:-90}" > "$B/configure.log"
cmake --build "$B" -j "$MAX_JOBS" > "$B/build.log"
ctest --test-dir "$B" --output-on-failure -V | grep -E "CUDA:|passed|FAIL|tests"
echo "== timing"
PYTHONPATH=. $PY csrc/tests/gpu_timing.py
