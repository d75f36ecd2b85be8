"""``linear(x, weight, bias)``: fp32 CPU linear layer for the 2-16 rows of a verify block.

Why: torch's CPU ``F.linear`` (MKL) streams the weight once for one row (GEMV), but for 2-16 rows it
takes the GEMM path, which costs up to ~2x per weight byte (the LM head at 8 rows: more). A verify
forward at B = 8 then costs ~1.85x a one-token step instead of the ~1.1x that weight streaming allows.
Measurements: ``bench/cpu_gemm.py``, results in ``bench/results/*-cpu-gemm.md``.

How: a small SIMD kernel (``_SOURCE``) reads the weight in place, in its own ``[N, K]`` layout. On AVX-512
one tile is 4 weight rows x up to 4 input rows (16 lanes; 8 rows take two passes, the second finding the
weight rows in L1); on AVX2 + FMA (e.g. AMD Zen 2/3, which have no AVX-512) 1 weight row x up to 8 input rows
(8 lanes, 16 registers). The x rows stay in L1, each weight row is read from memory once per call (prefetched
4 rows ahead) and multiplied against every x row, with per-lane partial sums along K reduced at the end (as
accurate as MKL's fp32). OpenMP splits the output columns over ``torch.get_num_threads()`` threads, in torch's
own libgomp (one thread pool per process).

Where it lives: it computes exactly ``F.linear`` (the definition is torch's own), at the runtime's call
sites, so it is a drop-in function of the runtime rather than a ``dflash_kernels`` op: a ``torch.library``
op would add its dispatch (about 10 us per call measured here, the non-mutating ``silu_mul``) to each of the
~120 projections of a SmolLM2 step, and under ``torch.compile`` or a dispatch mode (the graph emulator) this
function is ``F.linear`` anyway. The price: captured steps (the emulator) replay ``F.linear``, not this kernel.

Memory: nothing is packed or cached, so no weight copy (0 extra bytes for SmolLM2) and a weight changed
in place is seen by the next call: there is nothing to repack or invalidate.

Build: compiled on first use with ``$CXX`` (else ``c++``) ``-O3 -march=native -fopenmp`` (the AVX2 build adds
``-mno-avx512f``) into ``$DFLASH_CACHE/cpu_linear/<hash>.so`` (about 1 s; the hash covers the source, flags,
compiler and CPU flags), then loaded with ctypes. The widest ISA the CPU has is used;
``DFLASH_CPU_LINEAR_ISA=avx2`` asks for the AVX2 build on an AVX-512 CPU (tests, benchmarks). Without Linux,
AVX-512F or AVX2 + FMA, or a working compiler, :func:`linear` is ``F.linear`` (one warning says why;
:func:`unavailable_reason` too); :func:`isa` says which build runs.

Row blocks: ``weight`` may be a :class:`RowBlocks`, up to three ``[N_i, K]`` blocks of one weight (a layer's
q/k/v or gate/up projections), computed as their concatenation in one call, without a merged copy.

Falls back to ``F.linear`` (same result up to fp32 rounding order; row blocks: one ``F.linear`` each, then a
concatenation) for: fewer than :data:`MIN_ROWS` rows (row blocks: from one row the kernel runs) or
more than :data:`MAX_ROWS` rows (``F.linear`` is as fast at 1 row and faster for many), non-CPU or
non-fp32 tensors, a weight or bias whose last dimension is not contiguous, autograd (grad enabled and
a ``requires_grad`` input), tracing under ``torch.compile``, and an active ``TorchDispatchMode`` (the
graph emulator of ``dflash.graphs`` records dispatched ops and replays them: a ctypes call is not one).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import warnings
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dflash_kernels import cpu_native
from dflash_kernels._dispatch import unobserved_eager

MIN_ROWS = 2
MAX_ROWS = 16
FLAGS = cpu_native.FLAGS
# The kernel's instruction sets, widest first, and the /proc/cpuinfo flags each needs.
ISAS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}
ISA_ENV = "DFLASH_CPU_LINEAR_ISA"

_SOURCE = r"""
#include <immintrin.h>

// One vector type per ISA, with its tile: MR rows of x times NW weight rows, MR * NW accumulators.
// AVX-512: 16 lanes, 4 x rows x 4 weight rows. Measured on SmolLM2's projections at 8 rows (2 threads, a sweep
// of every projection of the model, distinct weights): 4 x 4 in two passes over the x rows (the second pass finds
// the 4 weight rows in L1) took ~6 % less time than one pass of 8 x rows x 2 weight rows, whose eight x loads
// per two weight loads and 16 one-vector reductions cost more than the re-read. AVX2 + FMA: 8 lanes, 8 x rows x
// 1 weight row (8 of 16 ymm registers: two weight rows would need 16 accumulators plus the loads, and spill).
#if defined(__AVX512F__)
typedef __m512 vec;
enum { VL = 16, NW = 4, MR = 4 };
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload_first(const float* p, long n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
// Lane i of the result = the sum of v[i]'s 16 lanes: a transpose-and-add tree (15 adds and 30 shuffles for all
// 16 sums, where one reduction per vector takes 4 adds and 4 shuffles each).
static inline vec hsum16(const vec* v) {
  vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: the block's part of the sums of v4i .. v4i+3
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i)  // fold the four 128-bit blocks pairwise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
enum { VL = 8, NW = 1, MR = 8 };
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload_first(const float* p, long n) {  // lanes >= n read as 0 and are not touched in memory
  __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
#error "cpu_linear needs AVX-512F or AVX2 + FMA"
#endif

// y[m, j] = sum_k x[m, k] w[j, k] (+ b[j]) for R <= MR rows of x and the nw <= NW weight rows at w.
template <int R>
static void tile(const float* x, long ldx, const float* w, long ldw, long K, int nw, const float* b, float* y,
                 long ldy) {
  const float* wr[NW];
  for (int j = 0; j < NW; ++j) wr[j] = w + (j < nw ? j : nw - 1) * ldw;  // a missing last row re-reads row nw-1
  vec acc[NW][R];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NW; ++j) acc[j][m] = vzero();
  long k = 0;
  for (; k + VL <= K; k += VL) {
    // The weight rows 4 ahead, requested now into L2: without it this kernel ran ~2x slower here (the hardware
    // prefetcher alone does not keep enough lines in flight); 8 or more rows ahead, or into L1, was slower.
    for (int j = 0; j < NW; ++j) __builtin_prefetch(wr[j] + 4 * ldw + k, 0, 2);
    vec wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = vload(wr[j] + k);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      vec xv = vload(x + m * ldx + k);
      for (int j = 0; j < NW; ++j) acc[j][m] = vfma(wv[j], xv, acc[j][m]);
    }
  }
  if (k < K) {
    vec wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = vload_first(wr[j] + k, K - k);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      vec xv = vload_first(x + m * ldx + k, K - k);
      for (int j = 0; j < NW; ++j) acc[j][m] = vfma(wv[j], xv, acc[j][m]);
    }
  }
#if defined(__AVX512F__)
  vec v[16];  // NW * MR == 16: the missing x rows of a partial tile are zeros
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NW; ++j) v[m * NW + j] = m < R ? acc[j][m] : vzero();
  alignas(64) float s[16];
  _mm512_store_ps(s, hsum16(v));
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < nw; ++j) y[m * ldy + j] = s[m * NW + j] + (b ? b[j] : 0.f);
#else
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < nw; ++j) y[m * ldy + j] = vsum(acc[j][m]) + (b ? b[j] : 0.f);
#endif
}

typedef void (*tile_fn)(const float*, long, const float*, long, long, int, const float*, float*, long);
static const tile_fn TILES[MR + 1] = {0, tile<1>, tile<2>, tile<3>, tile<4>
#if !defined(__AVX512F__)
                                      , tile<5>, tile<6>, tile<7>, tile<8>
#endif
};

// One block of weight rows: n rows [n, K] at w with row stride ldw, and their bias (or null).
struct Rows { const float* w; long ldw; long n; const float* b; };

// y [M, N] = x [M, K] times the weight made of nblk row blocks stacked in order (N = their total rows); x and y
// contiguous. Each thread takes a contiguous range of NW-row groups of each block (no barrier between blocks)
// and runs the x rows over each group in passes of at most MR.
static void linear_rows(const float* x, long M, long K, const Rows* blk, int nblk, float* y, long N, int threads) {
#pragma omp parallel num_threads(threads)
  {
    long col = 0;
    for (int s = 0; s < nblk; ++s) {
      const Rows r = blk[s];
      long groups = (r.n + NW - 1) / NW;
#pragma omp for schedule(static) nowait
      for (long p = 0; p < groups; ++p) {
        long n = NW * p;
        int nw = r.n - n < NW ? (int)(r.n - n) : (int)NW;
        for (long m = 0; m < M; m += MR) {
          int mr = M - m < MR ? (int)(M - m) : (int)MR;
          TILES[mr](x + m * K, K, r.w + n * r.ldw, r.ldw, K, nw, r.b ? r.b + n : 0, y + m * N + col + n, N);
        }
      }
      col += r.n;
    }
  }
}

// w [N, K] with row stride ldw, b [N] or null.
extern "C" void dflash_cpu_linear_f32(const float* x, long M, const float* w, long ldw, long K, long N,
                                      const float* b, float* y, int threads) {
  Rows r = {w, ldw, N, b};
  linear_rows(x, M, K, &r, 1, y, N, threads);
}

// Up to three row blocks (a block of n = 0 rows is skipped): a layer's q/k/v or gate/up weights read where they
// are, with no merged copy.
extern "C" void dflash_cpu_linear3_f32(const float* x, long M, long K, const float* w0, long ldw0, long n0,
                                       const float* b0, const float* w1, long ldw1, long n1, const float* b1,
                                       const float* w2, long ldw2, long n2, const float* b2, float* y, int threads) {
  Rows blk[3] = {{w0, ldw0, n0, b0}, {w1, ldw1, n1, b1}, {w2, ldw2, n2, b2}};
  linear_rows(x, M, K, blk, 3, y, n0 + n1 + n2, threads);
}
"""

_lock = threading.Lock()
_kernel = None
_reason: str | None = None
_tried = False
_isa: str | None = None


def _pick_isa(cpu_flags: set[str], wanted: str | None = None) -> str:
    """The widest ISA the CPU has, or ``wanted`` (default ``$DFLASH_CPU_LINEAR_ISA``) if it has that one."""
    have = [isa for isa, needs in ISAS.items() if needs <= cpu_flags]
    if not have:
        raise RuntimeError("the CPU has neither AVX-512F nor AVX2 + FMA")
    wanted = wanted or os.environ.get(ISA_ENV)
    if wanted:
        if wanted not in ISAS:
            raise RuntimeError(f"{ISA_ENV}={wanted!r} is not one of {tuple(ISAS)}")
        if wanted not in have:
            raise RuntimeError(f"{ISA_ENV}={wanted!r}: this CPU lacks {sorted(ISAS[wanted] - cpu_flags)}")
        return wanted
    return have[0]


def _build(wanted: str | None = None):
    """Compile (once per source, flags and CPU) and load the kernel of ``wanted`` or the picked ISA; returns
    (kernel, ISA). Benchmarks call it with ``"avx2"`` for a second kernel next to the loaded one."""
    isa = _pick_isa(set(cpu_native.cpu_flags().split()), wanted)
    # -march=native tunes for this CPU; -mno-avx512f keeps the AVX2 build off AVX-512 on a CPU that has both.
    lib = cpu_native.build_library("cpu_linear", _SOURCE, (*FLAGS, "-mno-avx512f") if isa == "avx2" else FLAGS)
    p, n = ctypes.c_void_p, ctypes.c_long
    one, three = lib.dflash_cpu_linear_f32, lib.dflash_cpu_linear3_f32
    one.restype = three.restype = None
    one.argtypes = [p, n, p, n, n, n, p, p, ctypes.c_int]
    three.argtypes = [p, n, n, *[p, n, n, p] * 3, p, ctypes.c_int]
    return _Kernel(one, three), isa


def _load():
    global _kernel, _reason, _tried, _isa
    if _tried:
        return _kernel
    with _lock:
        if not _tried:
            _tried = True
            try:
                _kernel, _isa = _build()
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


def isa() -> str | None:
    """The instruction set of the loaded kernel (``"avx512"`` or ``"avx2"``), None without one."""
    _load()
    return _isa


class _Kernel(NamedTuple):
    """The loaded kernel's two entry points: one weight, and up to three row blocks of one."""

    one: Callable
    three: Callable


class RowBlocks:
    """Up to three row blocks ``[N_i, K]`` of one weight ``[N, K]`` (N = sum N_i) and their biases, which
    :func:`linear` reads as that weight in one call: a decoder layer's q/k/v or gate/up projections where they
    are, without the merged copy that would cost ~0.25 s of page faults and copying on SmolLM2's first call.
    Built once per layer: the blocks are checked and the kernel's arguments computed here, not per call. It holds
    the tensors (their memory stays valid): a block updated in place is seen, a parameter replaced by another
    tensor is not (as with ``merged_weight``)."""

    __slots__ = ("weights", "biases", "in_features", "out_features", "fast", "args")

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None = None):
        weights = tuple(w.detach() for w in weights)
        if not 1 <= len(weights) <= 3:
            raise ValueError(f"cpu_linear.RowBlocks: weights must be 1 to 3 row blocks, got {len(weights)}")
        first = weights[0]
        for i, w in enumerate(weights):
            if w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device:
                raise ValueError(f"cpu_linear.RowBlocks: weights[{i}] is {tuple(w.shape)} {w.dtype} on {w.device}; "
                                 f"every block must be [N_i, {first.shape[-1]}] {first.dtype} on {first.device}")
        if biases is not None:
            biases = tuple(b.detach() for b in biases)
            if len(biases) != len(weights) or any(b.shape != w.shape[:1] or b.dtype != first.dtype
                                                  or b.device != first.device for w, b in zip(weights, biases)):
                got = [f"{tuple(b.shape)} {b.dtype} on {b.device}" for b in biases]
                raise ValueError(f"cpu_linear.RowBlocks: biases must be one [N_i] per block in the weights' dtype and "
                                 f"device, got {got} for blocks of {[w.shape[0] for w in weights]} rows")
        self.weights, self.biases = weights, biases
        self.in_features, self.out_features = first.shape[1], sum(w.shape[0] for w in weights)
        self.fast = first.is_cpu and first.dtype == torch.float32 and all(w.stride(1) == 1 for w in weights) and (
            biases is None or all(b.stride(0) == 1 for b in biases))
        args: list = []
        for i in range(3):  # the kernel's (pointer, row stride, rows, bias pointer) of each block; none: 0 rows
            if i < len(weights) and self.fast:
                args += [weights[i].data_ptr(), weights[i].stride(0), weights[i].shape[0],
                         None if biases is None else biases[i].data_ptr()]
            else:
                args += [None, 0, 0, None]
        self.args = tuple(args)


def _fast_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> bool:
    f32 = torch.float32
    return (MIN_ROWS <= rows <= MAX_ROWS
            and x.is_cpu and weight.is_cpu and x.dtype == f32 and weight.dtype == f32
            and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and weight.stride(1) == 1
            and (bias is None or (bias.is_cpu and bias.dtype == f32 and bias.shape == weight.shape[:1]
                                  and bias.stride(0) == 1))
            and unobserved_eager((x, weight, bias)))


def linear(x: torch.Tensor, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``.

    ``weight`` may also be a :class:`RowBlocks` (``bias`` None: the blocks carry theirs): ``F.linear`` of the
    blocks' concatenation. Row blocks take the kernel from one row up (one kernel call; at one row it streams the
    weight as fast as ``F.linear``'s GEMV, ``bench/cpu_gemm.py``); where the kernel cannot run, each block is an
    ``F.linear`` and the outputs are concatenated."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if type(weight) is RowBlocks:
        if bias is not None:
            raise ValueError("cpu_linear.linear: bias must be None with RowBlocks (the blocks carry their biases)")
        return _run_blocks(x, weight, rows)
    if not _fast_ok(x, weight, bias, rows) or (_kernel is None and _load() is None):
        return F.linear(x, weight, bias)
    return _run(_kernel, x, weight, bias, rows)


def _run(kernel: _Kernel, x, weight, bias, rows):
    x = x.contiguous()
    k, n = x.shape[-1], weight.shape[0]
    out = x.new_empty(x.shape[:-1] + (n,))
    kernel.one(x.data_ptr(), rows, weight.data_ptr(), weight.stride(0), k, n,
               None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def _run_blocks(x: torch.Tensor, blocks: RowBlocks, rows: int) -> torch.Tensor:
    if (blocks.fast and 1 <= rows <= MAX_ROWS and x.is_cpu and x.dtype == torch.float32
            and x.shape[-1] == blocks.in_features and unobserved_eager((x,))
            and (_kernel is not None or _load() is not None)):
        x = x.contiguous()
        out = x.new_empty(x.shape[:-1] + (blocks.out_features,))
        _kernel.three(x.data_ptr(), rows, blocks.in_features, *blocks.args, out.data_ptr(), torch.get_num_threads())
        return out
    biases = blocks.biases or (None,) * len(blocks.weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(blocks.weights, biases)], -1)
