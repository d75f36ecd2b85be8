"""``linear(x, weight, bias)``: fp32 CPU linear layer for the 2-16 rows of a verify block.

Why: torch's CPU ``F.linear`` (MKL) streams the weight once for one row (GEMV), but for 2-16 rows it
takes the GEMM path, which costs up to ~2x per weight byte (the LM head at 8 rows: more). A verify
forward at B = 8 then costs ~1.85x a one-token step instead of the ~1.1x that weight streaming allows.
Measurements: ``bench/cpu_gemm.py``, results in ``bench/results/*-cpu-gemm.md``.

How: a small AVX-512 kernel (``_SOURCE``) reads the weight in place, in its own ``[N, K]`` layout.
One tile is up to 8 input rows x 2 weight rows; the x rows stay in L1, each weight row is read from
memory once per call (prefetched two tiles ahead) and multiplied against every x row, with 16-lane
partial sums along K reduced at the end (as accurate as MKL's fp32). OpenMP splits the output columns
over ``torch.get_num_threads()`` threads, in torch's own libgomp (one thread pool per process).

Memory: nothing is packed or cached, so no weight copy (0 extra bytes for SmolLM2) and a weight changed
in place is seen by the next call: there is nothing to repack or invalidate.

Build: compiled on first use with ``$CXX`` (else ``c++``) ``-O3 -march=native -fopenmp`` into
``$DFLASH_CACHE/cpu_linear/<hash>.so`` (about 1 s; the hash covers the source, flags, compiler and CPU
flags), then loaded with ctypes. Without Linux, AVX-512F or a working compiler, :func:`linear` is
``F.linear`` (one warning says why; :func:`unavailable_reason` too).

Falls back to ``F.linear`` (same result up to fp32 rounding order) for: fewer than :data:`MIN_ROWS` or
more than :data:`MAX_ROWS` rows (``F.linear`` is as fast at 1 row and faster for many), non-CPU or
non-fp32 tensors, a weight or bias whose last dimension is not contiguous, autograd (grad enabled and
a ``requires_grad`` input), and tracing under ``torch.compile``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings

import torch
import torch.nn.functional as F

MIN_ROWS = 2
MAX_ROWS = 16
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_SOURCE = r"""
#include <immintrin.h>

// y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]): MR <= 8 rows of x against weight rows w0 and w1.
template <int MR>
static void tile(const float* x, long ldx, const float* w0, const float* w1, long ldw, long K,
                 const float* b, float* y, long ldy, int two) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  long k = 0;
  for (; k + 16 <= K; k += 16) {
    if (MR > 1) {  // one row streams fine on its own; more rows need the next tiles requested early
      __builtin_prefetch(w0 + 4 * ldw + k, 0, 2);
      __builtin_prefetch(w1 + 4 * ldw + k, 0, 2);
    }
    __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      a0[m] = _mm512_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm512_fmadd_ps(v1, xv, a1[m]);
    }
  }
  if (k < K) {
    __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
    __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + k), v1 = _mm512_maskz_loadu_ps(tail, w1 + k);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + k);
      a0[m] = _mm512_fmadd_ps(v0, xv, a0[m]);
      a1[m] = _mm512_fmadd_ps(v1, xv, a1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    y[m * ldy] = _mm512_reduce_add_ps(a0[m]) + (b ? b[0] : 0.f);
    if (two) y[m * ldy + 1] = _mm512_reduce_add_ps(a1[m]) + (b ? b[1] : 0.f);
  }
}

typedef void (*tile_fn)(const float*, long, const float*, const float*, long, long, const float*, float*, long, int);
static const tile_fn TILES[9] = {0, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

// x [M, K] and y [M, N] contiguous, w [N, K] with row stride ldw.
extern "C" void dflash_cpu_linear_f32(const float* x, long M, const float* w, long ldw, long K, long N,
                                      const float* b, float* y, int threads) {
  long pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long p = 0; p < pairs; ++p) {
    long n = 2 * p;
    int two = n + 1 < N;
    for (long m = 0; m < M; m += 8) {
      int mr = M - m < 8 ? (int)(M - m) : 8;
      TILES[mr](x + m * K, K, w + n * ldw, w + (n + two) * ldw, ldw, K, b ? b + n : 0, y + m * N + n, N, two);
    }
  }
}
"""

_lock = threading.Lock()
_kernel = None
_reason: str | None = None
_tried = False


def _build():
    from dflash.smollm2 import cache_path

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"needs Linux x86-64, this is {platform.system()} {platform.machine()}")
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu_flags = next((line for line in f if line.startswith("flags")), "")
    if "avx512f" not in cpu_flags.split():
        raise RuntimeError("the CPU has no AVX-512F")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++)")
    key = hashlib.sha256("\0".join((_SOURCE, *FLAGS, cxx, cpu_flags)).encode()).hexdigest()[:16]
    path = cache_path("cpu_linear", f"{key}.so")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        done = subprocess.run([cxx, *FLAGS, "-x", "c++", "-", "-o", tmp], input=_SOURCE, text=True,
                              capture_output=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders each write their own tmp
    fn = ctypes.CDLL(path).dflash_cpu_linear_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return fn


def _load():
    global _kernel, _reason, _tried
    if _tried:
        return _kernel
    with _lock:
        if not _tried:
            _tried = True
            try:
                _kernel = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _reason = f"dflash.cpu_linear: the fast CPU kernel is unavailable ({e}); using F.linear"
                warnings.warn(_reason, RuntimeWarning, stacklevel=3)
    return _kernel


def unavailable_reason() -> str | None:
    """None when the kernel is built and loaded (building it now if needed), else why not."""
    _load()
    return _reason


def available() -> bool:
    return unavailable_reason() is None


def _fast_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> bool:
    f32 = torch.float32
    return (MIN_ROWS <= rows <= MAX_ROWS
            and x.is_cpu and weight.is_cpu and x.dtype == f32 and weight.dtype == f32
            and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and weight.stride(1) == 1
            and (bias is None or (bias.is_cpu and bias.dtype == f32 and bias.shape == weight.shape[:1]
                                  and bias.stride(0) == 1))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not _fast_ok(x, weight, bias, rows) or (_kernel is None and _load() is None):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    n = weight.shape[0]
    out = x.new_empty(x.shape[:-1] + (n,))
    _kernel(x.data_ptr(), rows, weight.data_ptr(), weight.stride(0), k, n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
