"""Loader and build description of the compiled extension ``dflash_kernels._C`` (C++ CPU ops, CUDA ops, the
native CPU kernels).

The compiled ops live in their own namespaces, apart from the public ``torch.ops.dflash.*`` ops that
``import dflash_kernels`` registers: ``torch.ops.dflash_ext`` (``verify_greedy``, ``commit_round``; the public ops
dispatch there when their backend resolves to ``"ext"``, definitions in ``csrc/include/dflash_kernels.h``) and
``torch.ops.dflash_cpu`` (the native kernels of the ``"cpu"`` backend, ``csrc/cpu/``, called by
``dflash_kernels.cpu``). :func:`sources` and :data:`CXX_FLAGS` are the one description of what is compiled:
setup.py reads them from this file, and the JIT build below uses them. The library comes from, in order:

1. ``dflash_kernels._C``, built by ``pip install --no-build-isolation -e .`` (setup.py);
2. ``DFLASH_KERNELS_LIBRARY=/path/libdflash_torch_ops.so``: a library built by CMake, loaded with
   ``torch.ops.load_library``;
3. only with ``DFLASH_KERNELS_JIT=1`` (or :func:`load` with ``jit=True``): a JIT build from the
   sources in ``csrc/`` with ``torch.utils.cpp_extension.load`` (about 30-60 s the first time,
   cached afterwards in ``TORCH_EXTENSIONS_DIR``; needs a source checkout). The CUDA ops are
   included when torch is a CUDA build and nvcc is found.

``$DFLASH_CPU_SANITIZE`` (e.g. ``address``; ``csrc/tests/asan_cpu.sh``) replaces all three with a JIT build of the
same sources under that sanitizer, into ``TORCH_EXTENSIONS_DIR`` (the process needs the sanitizer's runtime
preloaded).

Nothing is loaded at ``import dflash_kernels`` (a package without ``_C`` imports and falls back to
Triton or the reference); the first :func:`status` / op call loads, once.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import threading
from pathlib import Path

import torch

JIT_ENV = "DFLASH_KERNELS_JIT"
LIBRARY_ENV = "DFLASH_KERNELS_LIBRARY"
SANITIZE_ENV = "DFLASH_CPU_SANITIZE"
ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
# -fopenmp: the native CPU kernels' threads (torch's libgomp). The kernels pick their instruction set per
# translation unit (#pragma GCC target) and at load, so no -march: the library runs on any x86-64.
CXX_FLAGS = ["-O3", "-fopenmp"]
INCLUDE_DIRS = ["csrc/include", "csrc/torch", "csrc/cpu"]


def sources(with_cuda: bool) -> list[str]:
    """The extension's sources, relative to the repository root: the ``dflash_ext`` ops (``csrc/torch/ops.cpp``, with
    CUDA ``ops_cuda.cpp`` and ``csrc/cuda/dflash_kernels.cu``) and, on x86-64, every ``csrc/cpu/*.cpp`` (the native
    CPU kernels, one translation unit per kernel family or instruction set, and their ``dflash_cpu`` bindings;
    elsewhere the "cpu" backend runs its torch formulas)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    native = sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cpu").glob("*.cpp")) if x86 else []
    cuda = ["csrc/torch/ops_cuda.cpp", "csrc/cuda/dflash_kernels.cu"] if with_cuda else []
    return ["csrc/torch/ops.cpp", *native, *cuda]

_lock = threading.Lock()
_loaded: bool | None = None  # None = not tried yet
_how = ""  # how the ops were loaded, or why not


def _ops_registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("dflash_ext::verify_greedy", "CPU")
    except Exception:  # pragma: no cover - private API changed
        return hasattr(torch.ops.dflash_ext, "verify_greedy")


def _has_cuda_kernels() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("dflash_ext::verify_greedy", "CUDA")
    except Exception:  # pragma: no cover
        return False


def _cuda_home() -> str | None:
    """CUDA toolkit root: $CUDA_HOME, else the root of the nvcc on PATH (wrapper scripts resolved)."""
    root = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
        return root
    nvcc = shutil.which("nvcc")
    for _ in range(4):
        if not nvcc:
            return None
        real = os.path.realpath(nvcc)
        try:
            head = open(real, "rb").read(4096)
        except OSError:
            return None
        if not head.startswith(b"#!"):
            return os.path.dirname(os.path.dirname(real))
        m = re.search(rb"(/[^\s\"']*/bin/nvcc)\b", head)
        nvcc = m.group(1).decode() if m else None
    return None


def _jit_build(verbose: bool = False, sanitizer: str | None = None) -> str:
    """Build and load the ops with torch.utils.cpp_extension.load (cached in ``TORCH_EXTENSIONS_DIR``), with
    ``-fsanitize=<sanitizer>`` when given (CPU ops only). Returns a description."""
    if not (CSRC / "torch" / "ops.cpp").exists():
        raise RuntimeError(f"the C++ sources are not at {CSRC} (JIT needs a source checkout)")
    cuda_home = _cuda_home()
    with_cuda = (torch.version.cuda is not None and cuda_home is not None and not sanitizer
                 and os.environ.get("DFLASH_BUILD_CUDA", "auto") != "0")
    if with_cuda and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = cuda_home
    from torch.utils import cpp_extension

    kwargs = {}
    if with_cuda:
        cpp_extension.CUDA_HOME = cuda_home  # torch may have guessed wrong at import
        archs = re.split(r"[;,\s]+", os.environ.get("DFLASH_CUDA_ARCHS", "90").strip())
        kwargs["extra_cuda_cflags"] = ["-O3"] + [
            f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    sanitize = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-g"] if sanitizer else []
    name = "dflash_kernels_C_" + (sanitizer or ("cuda" if with_cuda else "cpu"))
    cpp_extension.load(
        name=name,
        sources=[str(ROOT / s) for s in sources(with_cuda)],
        extra_include_paths=[str(ROOT / d) for d in INCLUDE_DIRS],
        extra_cflags=CXX_FLAGS + sanitize + (["-DDFLASH_WITH_CUDA=1"] if with_cuda else []),
        extra_ldflags=["-fopenmp"] + sanitize,
        is_python_module=False,
        verbose=verbose,
        **kwargs,
    )
    how = "JIT-built from csrc/ with torch.utils.cpp_extension.load"
    return how + (f" under -fsanitize={sanitizer}" if sanitizer else " (with CUDA ops)" if with_cuda else "")


def load(jit: bool | None = None, verbose: bool = False) -> tuple[bool, str]:
    """Load the compiled ops once; returns ``(loaded, how_or_why_not)``.

    ``jit=None`` follows ``DFLASH_KERNELS_JIT``; ``jit=True`` builds now if nothing else is there
    (also after an earlier failed attempt).
    """
    global _loaded, _how
    if _loaded and _ops_registered():
        return True, _how
    with _lock:
        if _loaded is not None and not (jit and not _loaded):
            return _loaded, _how
        why = []
        sanitizer = os.environ.get(SANITIZE_ENV)
        if sanitizer:  # the sanitized build instead of any other
            try:
                _how = _jit_build(verbose=verbose, sanitizer=sanitizer)
                _loaded = True
            except Exception as exc:
                _loaded, _how = False, f"the {SANITIZE_ENV}={sanitizer} JIT build failed: {type(exc).__name__}: {exc}"
            _status_cache.clear()
            return _loaded, _how
        try:
            from dflash_kernels import _C  # noqa: F401  (registers torch.ops.dflash_ext.*)

            _loaded, _how = True, "dflash_kernels._C built by setup.py"
            return _loaded, _how
        except ImportError as exc:
            why.append(f"dflash_kernels._C is not built ({exc})")
        lib = os.environ.get(LIBRARY_ENV)
        if lib:
            try:
                torch.ops.load_library(lib)
                _loaded, _how = True, f"loaded {lib} ({LIBRARY_ENV})"
                return _loaded, _how
            except Exception as exc:
                why.append(f"{LIBRARY_ENV}={lib} failed to load ({exc})")
        if _ops_registered():
            _loaded, _how = True, "torch.ops.dflash_ext registered by a library loaded elsewhere"
            return _loaded, _how
        if jit is None:
            jit = os.environ.get(JIT_ENV, "0") == "1"
        if jit:
            try:
                _how = _jit_build(verbose=verbose)
                _loaded = True
                _status_cache.clear()
                return _loaded, _how
            except Exception as exc:
                why.append(f"the JIT build failed: {type(exc).__name__}: {str(exc)[-2000:]}")
        else:
            why.append("build it with `pip install --no-build-isolation -e .`, or set "
                       f"{JIT_ENV}=1 to JIT-build it on first use")
        _loaded, _how = False, "; ".join(why)
        return _loaded, _how


_status_cache: dict[str, tuple[bool, str]] = {}


def status(device: torch.device) -> tuple[bool, str]:
    """Whether the compiled ops can run on tensors of ``device``, and why not (cached per device type)."""
    dtype = torch.device(device).type
    cached = _status_cache.get(dtype)
    if cached is None:
        cached = _status_cache[dtype] = _status(dtype)
    return cached


@torch.compiler.disable
def _status(device_type: str) -> tuple[bool, str]:
    device = torch.device(device_type)
    ok, how = load()
    if not ok:
        return False, how
    if device.type == "cpu":
        return True, f"C++ CPU ops ({how})"
    if device.type == "cuda":
        if _has_cuda_kernels():
            return True, f"CUDA ops ({how})"
        return False, (f"the compiled ops have no CUDA kernels ({how}): torch "
                       f"{torch.__version__} is {'a CUDA' if torch.version.cuda else 'a CPU-only'} build; "
                       "rebuild on a CUDA machine with `pip install --no-build-isolation -e .`")
    if device.type == "meta":
        return True, f"shape-only Meta kernels ({how})"
    return False, f"no compiled kernels for device type {device.type!r}"


def _require(device: torch.device, op: str) -> None:
    if torch.compiler.is_compiling():  # traced: the Meta kernels decide; checked when it runs
        return
    ok, why = status(device)
    if not ok:
        raise RuntimeError(f"{op}: backend='ext' is unavailable on {device}: {why}")


def verify_greedy(logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash_ext.verify_greedy`` (accepts int32 drafts and non-contiguous logits by copying)."""
    _require(logits.device, "verify_greedy")
    if draft_tokens.dtype == torch.int32:
        draft_tokens = draft_tokens.to(torch.int64)
    return torch.ops.dflash_ext.verify_greedy(logits.contiguous(), draft_tokens.contiguous())


def commit_round(draft_tokens, accepted, bonus, stop_tokens, max_lengths, out_tokens, lengths,
                 positions, anchor, done) -> torch.Tensor:
    """``torch.ops.dflash_ext.commit_round`` (argument order of the schema); returns ``num_new``."""
    _require(draft_tokens.device, "commit_round")
    return torch.ops.dflash_ext.commit_round(draft_tokens, accepted, bonus, stop_tokens, max_lengths,
                                             out_tokens, lengths, positions, anchor, done)
