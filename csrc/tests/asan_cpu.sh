#!/usr/bin/env bash
# The native CPU kernels (csrc/cpu/, reached through dflash_kernels.cpu.native and dflash_kernels.cpu.linear) built
# with AddressSanitizer and run over the op tests that reach them; fails on any ASan report. Run from the
# repository root:
#   PY=.venv/bin/python bash csrc/tests/asan_cpu.sh [extra pytest args]
# DFLASH_CPU_SANITIZE=address makes dflash_kernels._ext JIT-build the extension's sources under ASan (instead of
# loading dflash_kernels._C) into a fresh private TORCH_EXTENSIONS_DIR; libasan (and libstdc++, so that ASan
# intercepts the C++ exceptions torch throws) are preloaded into Python. Leak checks are off (the interpreter's own
# allocations).
set -euo pipefail
PY=${PY:-python}
CXX_=${CXX:-g++}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
export TORCH_EXTENSIONS_DIR=$build DFLASH_CPU_SANITIZE=address TRITON_INTERPRET=1
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=4096:log_path=$build/asan
export LD_PRELOAD="$($CXX_ -print-file-name=libasan.so) $($CXX_ -print-file-name=libstdc++.so.6)"
# Build once before the tests (their workers would each wait on the build lock), and fail here if it fails.
$PY -c "from dflash_kernels import _ext; ok, how = _ext.load(); print(how); raise SystemExit(0 if ok else 1)"
status=0
$PY -m pytest -q -p no:warnings tests/kernels/test_cpu_native.py tests/kernels/test_verify_attention.py \
    tests/kernels/test_draft_attention.py tests/kernels/test_inject_context_kv.py tests/kernels/test_tree.py \
    tests/kernels/test_layer_ops.py tests/kernels/test_ops_registered.py tests/runtime/test_cpu_linear.py \
    tests/runtime/test_native_forward.py "$@" || status=$?
# Refused huge allocations (allocator_may_return_null: the MemoryError tests) only log a WARNING; errors fail.
if compgen -G "$build/asan*" > /dev/null; then
    cat "$build"/asan*
    if grep -q "ERROR: AddressSanitizer" "$build"/asan*; then
        echo "AddressSanitizer reported errors (above)"
        exit 1
    fi
fi
exit $status
