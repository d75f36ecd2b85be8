"""``linear(x, weight, bias)``: fp32 CPU linear layer for the rows of decode, verify and draft steps.

Why: torch's CPU ``F.linear`` (MKL) streams the weight once for one row (GEMV), but for 2-16 rows it
takes the GEMM path, which costs up to ~2x per weight byte (the LM head at 8 rows: more). A verify
forward at B = 8 then costs ~1.85x a one-token step instead of the ~1.1x that weight streaming allows.
Measurements: ``bench/cpu_gemm.py``, results in ``bench/results/*-cpu-gemm.md``.

Two kernels, both computing ``F.linear`` in fp32 (only the order of fp32 sums differs, as between any two GEMMs;
the tests hold them to the 2x error rule against fp64):

* **AMX** (CPUs with AMX-BF16, e.g. Xeon Sapphire/Emerald Rapids, when the OS grants the tile state), for a weight
  whose fp32 values are all exactly bf16 values: SmolLM2's (dequantized from GGUF into bf16) and any model or draft
  loaded from bf16 into fp32. The weight is packed once into AMX tiles (bf16: half the bytes to stream); each x row
  is split into three bf16 parts, ``x = hi + mid + lo`` exactly, so every product is exact in fp32 and the tiles
  accumulate in fp32 (the hi sums moved out every 256 deep, so they carry no more rounding than a vector GEMM's).
  Any number of rows; the weight leaves memory once per call. Measured on SmolLM2 (2 threads, AMX against the fp32
  kernel in the same run): the one-token step 30.2 against 39.5 ms, the 8-row verify step 36.8 against 49.8, the
  16-row (trees of 15) 42.9 against 67.2 (``bench/results/*-amx-linear.md``). Memory: the packed
  copy, 2 bytes a weight (SmolLM2: 270 MB), made on first use of each weight (one C pass that also checks
  exactness) and kept while the weight lives; an in-place update (which bumps the tensor's version) repacks.
* **fp32 SIMD** (AVX-512 or AVX2 + FMA) for 2-16 rows of any fp32 weight: ``_SOURCE``, below.

The fp32 kernel reads the weight in place, in its own ``[N, K]`` layout. On AVX-512
one tile is 4 weight rows x up to 4 input rows (16 lanes; 8 rows take two passes, the second finding the
weight rows in L1); on AVX2 + FMA (e.g. AMD Zen 2/3, which have no AVX-512) 1 weight row x up to 8 input rows
(8 lanes, 16 registers). The x rows stay in L1, each weight row is read from memory once per call (prefetched
4 rows ahead) and multiplied against every x row, with per-lane partial sums along K reduced at the end (as
accurate as MKL's fp32). OpenMP splits the output columns over ``torch.get_num_threads()`` threads, in torch's
own libgomp (one thread pool per process); the AMX kernel too.

Where it lives: it computes exactly ``F.linear`` (the definition is torch's own), at the runtime's call
sites, so it is a drop-in function of the runtime rather than a ``dflash_kernels`` op: a ``torch.library``
op would add its dispatch (about 10 us per call measured here, the non-mutating ``silu_mul``) to each of the
~120 projections of a SmolLM2 step, and under ``torch.compile`` or a dispatch mode (the graph emulator) this
function is ``F.linear`` anyway. The price: captured steps (the emulator) replay ``F.linear``, not this kernel.

Build: compiled on first use with ``$CXX`` (else ``c++``) ``-O3 -march=native -fopenmp`` (the AVX2 build adds
``-mno-avx512f``; the AMX one ``-mamx-tile -mamx-bf16``) into ``$DFLASH_CACHE/cpu_linear*/<hash>.so`` (about 1 s;
the hash covers the source, flags, compiler and CPU flags), then loaded with ctypes. The widest ISA the CPU has is
used; ``DFLASH_CPU_LINEAR_ISA=avx2`` asks for the AVX2 build on an AVX-512 CPU (tests, benchmarks), and
``DFLASH_CPU_LINEAR_AMX=0`` (or :func:`set_amx`) turns the AMX path off. Without Linux, AVX-512F or AVX2 + FMA,
or a working compiler, the fp32 kernel is ``F.linear`` (one warning says why; :func:`unavailable_reason` too);
:func:`isa` says which build runs, :func:`amx_unavailable_reason` why AMX does not (no warning: most CPUs lack it).

The argmax of a linear: :func:`linear_argmax` is ``linear(x, weight, bias).argmax(-1)``, the same indices, for a
greedy verify's LM head, which needs no more. On the AMX path one tile product a step (the hi parts alone) screens
every column and only the 16-column groups that a proven bound cannot rule out are computed exactly, with the
GEMM's own loop (``dflash_amx_argmax``); 1.4-1.6 groups of SmolLM2's 3,072 a row on its hidden states, 1.6-4.5 ms
off its 8-32-row forward (``bench/greedy_head.py``, ``bench/results/*-greedy-head.md``).

Row blocks: ``weight`` may be a :class:`RowBlocks`, up to three ``[N_i, K]`` blocks of one weight (a layer's
q/k/v or gate/up projections), computed as their concatenation in one call, without a merged copy.

Falls back to ``F.linear`` (same result up to fp32 rounding order; row blocks: one ``F.linear`` each, then a
concatenation) for: non-CPU or non-fp32 tensors, a weight or bias whose last dimension is not contiguous, autograd
(grad enabled and a ``requires_grad`` input), tracing under ``torch.compile``, an active ``TorchDispatchMode``
(the graph emulator of ``dflash.graphs`` records dispatched ops and replays them: a ctypes call is not one), and,
off the AMX path, fewer than :data:`MIN_ROWS` rows (row blocks: from one row the kernel runs) or more than
:data:`MAX_ROWS` rows (``F.linear`` is as fast at 1 row and faster for many).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import warnings
import weakref
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dflash_kernels.cpu import native as cpu_native
from dflash_kernels._dispatch import unobserved_eager
from dflash_kernels.cpu.argmax import argmax_cpu

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

# The AMX path: a weight whose fp32 values are all exactly bf16 values (SmolLM2's, dequantized from GGUF into bf16,
# and drafts saved in bf16) is packed once into AMX B tiles, half the bytes of the fp32 weight. Each input row x is
# split into three bf16 parts with x = hi + mid + lo exactly (each the top 8 significant bits of what is left), so
# every product w * part is exact in fp32 and TDPBF16PS accumulates them in fp32: the fp32 dot product, only the
# order of its fp32 sums differs (as between any two GEMMs). Tile registers: C 0-2 (hi, mid, lo sums), A 3-5
# (the parts of up to 16 rows), B 6 (16 columns x 32 deep, 1 KiB); up to 10 rows, C 1-2 and A 4-5 hold the 3M part
# rows in 16-row slices instead (packed_group).
_AMX_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {
constexpr long TN = 16;  // output columns of a tile
constexpr long TK = 32;  // reduction depth of a tile (16 bf16 pairs)
constexpr long TR = 16;  // rows of an A and a C tile at most
constexpr long TILE = TN * TK;  // bf16 elements of a B tile
constexpr long PREFETCH = 4;  // B tiles requested ahead (4 KiB): 2, 8 and 16 were slower here
// A tile accumulates its products one after another in fp32 (round to nearest each time), so one long sum carries
// the error of K additions where a vector GEMM's partial sums carry ~K/16. The hi sums (the part that matters; mid
// and lo are 2^-8 and 2^-16 of it) are moved out every FLUSH steps (256 deep) and summed in fp32 outside: measured
// error at K 1536, 8 rows: 2.2x torch's without it.
constexpr long FLUSH = 8;
// Up to PACK rows, the 3M part rows (the hi, mid and lo planes one after another) fill 16-row tiles back to back:
// one tile product a step up to 5 rows, two up to 10, where one tile per part took three. Past 10 rows this saves
// nothing (16 rows: three either way) and the packed loop's sums cost more (it was 1.01-1.13x the time at 16-32 rows).
constexpr long PACK = 10;

struct TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// x [M, K] (row stride ldx) -> three planes [Mp, Kp] of bf16 (hi, mid, lo), zero padded. Truncating to the top 16
// bits keeps a float's sign, exponent and top 8 significant bits, so each remainder is exact in fp32 and the
// third part has at most 8 significant bits: x = hi + mid + lo exactly. Inf and NaN go whole into hi (a NaN with
// its quiet bit set, so no NaN truncates to inf). 16 floats at a time, the same bits as a float at a time: 4-10 us
// less a call at 21 rows (K 576-1536), ~0.25 / 0.65 ms of an 8 / 21-row SmolLM2 forward.
void split(const float* x, long ldx, long M, long K, long Mp, long Kp, uint16_t* a) {
  uint16_t *hi = a, *mid = a + Mp * Kp, *lo = a + 2 * Mp * Kp;
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000),
                frac = _mm512_set1_epi32(0x007fffff), quiet = _mm512_set1_epi32(0x40);
  for (long m = 0; m < M; ++m)
    for (long k = 0; k < Kp; k += 16) {  // past K: zeros in, zeros out
      const __mmask16 in = k + 16 <= K ? (__mmask16)0xffff : k < K ? (__mmask16)((1u << (K - k)) - 1u) : 0;
      const __m512 v = _mm512_maskz_loadu_ps(in, x + m * ldx + k);
      const __m512i u = _mm512_castps_si512(v);
      const __m512 r = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_and_si512(u, top)));
      const __m512i ur = _mm512_castps_si512(r);
      const __m512i r2 = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(_mm512_and_si512(ur, top))));
      const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(u, expo), expo);
      const __mmask16 nan = (__mmask16)(~finite & _mm512_test_epi32_mask(u, frac));
      const __m512i h = _mm512_srli_epi32(u, 16);
      _mm256_storeu_si256((__m256i*)(hi + m * Kp + k), _mm512_cvtepi32_epi16(_mm512_mask_or_epi32(h, nan, h, quiet)));
      _mm256_storeu_si256((__m256i*)(mid + m * Kp + k), _mm512_cvtepi32_epi16(_mm512_maskz_srli_epi32(finite, ur, 16)));
      _mm256_storeu_si256((__m256i*)(lo + m * Kp + k), _mm512_cvtepi32_epi16(_mm512_maskz_srli_epi32(finite, r2, 16)));
    }
  for (long p = 0; p < 3; ++p) memset(a + p * Mp * Kp + M * Kp, 0, sizeof(uint16_t) * (Mp - M) * Kp);
}

struct Block { const uint16_t* tiles; long n; const float* b; };

// The tiles of linear3 and of the argmax (which must compute linear3's values) for M rows in chunks of R: C 0-2 and
// A 3-5 of R rows, B 6 of 16. Up to PACK rows (one chunk) packed_group's instead in 1-2 and 4-5: C 1 and A 4 the
// first min(3M, 16) part rows, C 2 and A 5 the rest (none up to 5 rows); the argmax's screen keeps 0 and 3.
inline TileConfig tile_config(long R, long M) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 6; ++t) { cfg.rows[t] = (uint8_t)R; cfg.colsb[t] = 64; }
  cfg.rows[6] = 16;
  cfg.colsb[6] = 64;
  if (M <= PACK) {
    const long first = 3 * M < TR ? 3 * M : TR, rest = 3 * M - first;
    cfg.rows[1] = cfg.rows[4] = (uint8_t)first;
    cfg.rows[2] = cfg.rows[5] = (uint8_t)rest;
    cfg.colsb[2] = cfg.colsb[5] = rest ? 64 : 0;
  }
  return cfg;
}

// One 16-column group with the M <= PACK rows packed (the planes of split(..., Mp = M, ...) at a): ps [3M][16] = each
// part row's sums over the K depth, moved out of the tiles every FLUSH steps; c: a [16][16] scratch. The value of
// row m, column n is packed_value(ps, M, m, n) (+ bias).
__attribute__((always_inline)) inline void packed_group(const uint16_t* wt, long steps, const uint16_t* a, long M,
                                                        long Kp, float* ps, float* c) {
  const long first = 3 * M < TR ? 3 * M : TR, rest = 3 * M - first;
  _tile_zero(1);
  if (rest) _tile_zero(2);  // (a tile of no rows is not configured: touching it faults)
  for (long i = 0; i < 3 * M * TN; ++i) ps[i] = 0.f;
  for (long t = 0; t < steps; ++t) {
    const char* pf = (const char*)(wt + (t + PREFETCH) * TILE);  // as linear3's one chunk
    for (int l = 0; l < 16; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
    _tile_loadd(6, wt + t * TILE, 64);
    _tile_loadd(4, a + t * TK, Kp * 2);
    _tile_dpbf16ps(1, 4, 6);
    if (rest) {
      _tile_loadd(5, a + TR * Kp + t * TK, Kp * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    if ((t + 1) % FLUSH == 0 || t + 1 == steps) {
      _tile_stored(1, c, 64);
      _tile_zero(1);
      for (long i = 0; i < first * TN; ++i) ps[i] += c[i];
      if (rest) {
        _tile_stored(2, c, 64);
        _tile_zero(2);
        for (long i = 0; i < rest * TN; ++i) ps[TR * TN + i] += c[i];
      }
    }
  }
}

inline float packed_value(const float* ps, long M, long m, long n) {
  return (ps[m * TN + n] + ps[(M + m) * TN + n]) + ps[(2 * M + m) * TN + n];
}
}  // namespace

// Linux grants a process the AMX tile state only on request; 0 = granted.
extern "C" int dflash_amx_request(void) { return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                              18 /* XFEATURE_XTILEDATA */); }

// w [N, K] (row stride ldw) -> B tiles: per group of 16 output columns, per 32-deep step, [16 pairs][16 cols][2]
// (zero padded). Returns how many elements are not exactly bf16 (then the tiles are not the weight).
extern "C" long dflash_amx_pack(const float* w, long ldw, long N, long K, uint16_t* tiles, int threads) {
  const long groups = (N + TN - 1) / TN, steps = (K + TK - 1) / TK;
  long inexact = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : inexact) schedule(static)
  for (long g = 0; g < groups; ++g) {
    uint16_t* out = tiles + g * steps * TILE;
    for (long t = 0; t < steps; ++t)
      for (long p = 0; p < TK / 2; ++p)
        for (long n = 0; n < TN; ++n)
          for (long j = 0; j < 2; ++j) {
            const long row = g * TN + n, col = t * TK + 2 * p + j;
            const uint32_t u = row < N && col < K ? bits(w[row * ldw + col]) : 0u;
            inexact += (u & 0xffffu) != 0;
            *out++ = (uint16_t)(u >> 16);
          }
  }
  return inexact;
}

// norms [N] = each column's (weight row's) Euclidean norm, from its packed bf16 values, rounded up (the argmax
// screen's bounds).
extern "C" void dflash_amx_column_norms(const uint16_t* tiles, long N, long K, double* norms, int threads) {
  const long groups = (N + TN - 1) / TN, steps = (K + TK - 1) / TK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long g = 0; g < groups; ++g) {
    double sq[TN] = {0};
    const uint16_t* in = tiles + g * steps * TILE;
    for (long i = 0; i < steps * TILE; ++i) {
      const double v = from_bits((uint32_t)in[i] << 16);
      sq[(i / 2) % TN] += v * v;  // a tile is [16 pairs][16 columns][2]
    }
    for (long n = 0; n < TN && g * TN + n < N; ++n) norms[g * TN + n] = sqrt(sq[n]) * (1 + 0x1p-40);
  }
}

// y [M, N] = x [M, K] (row stride ldx) times the weight made of up to three packed row blocks (n = 0: none), plus
// their biases. Each thread takes a contiguous range of 16-column groups of each block; per group, the rows in
// chunks of at most 16 (the B tiles of the later chunks come from L1/L2: the weight leaves memory once), or up to
// PACK rows packed (packed_group).
extern "C" int dflash_amx_linear3(const float* x, long ldx, long M, long K, const uint16_t* t0, long n0,
                                  const float* b0, const uint16_t* t1, long n1, const float* b1, const uint16_t* t2,
                                  long n2, const float* b2, float* y, int threads) {
  const Block blk[3] = {{t0, n0, b0}, {t1, n1, b1}, {t2, n2, b2}};
  const long N = n0 + n1 + n2, steps = (K + TK - 1) / TK, Kp = steps * TK;
  const long chunks = (M + TR - 1) / TR, R = (M + chunks - 1) / chunks, Mp = chunks * R;  // rows split evenly
  uint16_t* a = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 3 * Mp * Kp);  // a multiple of 64 bytes
  if (!a) return -1;
  split(x, ldx, M, K, Mp, Kp, a);
#pragma omp parallel num_threads(threads)
  {
    const TileConfig cfg = tile_config(R, M);
    _tile_loadconfig(&cfg);  // per call: other code (oneDNN) may have configured the tiles differently
    alignas(64) float c[3][TR * TN];
    alignas(64) float hi[TR * TN];
    alignas(64) float ps[3 * PACK * TN];
    long col = 0;
    for (int s = 0; s < 3; ++s) {
      const Block bk = blk[s];
      const long groups = (bk.n + TN - 1) / TN;
#pragma omp for schedule(static) nowait
      for (long g = 0; g < groups; ++g) {
        const uint16_t* wt = bk.tiles + g * steps * TILE;
        const long nv = bk.n - g * TN < TN ? bk.n - g * TN : TN;
        if (M <= PACK) {
          packed_group(wt, steps, a, M, Kp, ps, c[0]);
          for (long m = 0; m < M; ++m)
            for (long n = 0; n < nv; ++n)
              y[m * N + col + g * TN + n] = packed_value(ps, M, m, n) + (bk.b ? bk.b[g * TN + n] : 0.f);
          continue;
        }
        for (long ch = 0; ch < chunks; ++ch) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          const uint16_t* ah = a + ch * R * Kp;
          for (long i = 0; i < R * TN; ++i) hi[i] = 0.f;
          for (long t = 0; t < steps; ++t) {
            // The B tiles are requested ahead (without it the tile loads wait on memory: ~1.5x slower here). One
            // chunk: PREFETCH tiles ahead. More: the next group's tiles, one every `chunks` iterations over all of
            // this group's chunks, so memory keeps streaming while the later chunks reuse this group's tiles
            // (prefetching in the first chunk only left it idle then: 24-32 rows took 1.7x the time of 16).
            const char* pf = nullptr;
            if (chunks == 1)
              pf = (const char*)(wt + (t + PREFETCH) * TILE);
            else if ((ch * steps + t) % chunks == 0)
              pf = (const char*)(wt + (steps + (ch * steps + t) / chunks) * TILE);
            if (pf)
              for (int l = 0; l < 16; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
            _tile_loadd(6, wt + t * TILE, 64);
            _tile_loadd(3, ah + t * TK, Kp * 2);
            _tile_loadd(4, ah + Mp * Kp + t * TK, Kp * 2);
            _tile_loadd(5, ah + 2 * Mp * Kp + t * TK, Kp * 2);
            _tile_dpbf16ps(0, 3, 6);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if ((t + 1) % FLUSH == 0 || t + 1 == steps) {  // the hi sums, FLUSH steps at a time, into hi[]
              _tile_stored(0, c[0], 64);
              _tile_zero(0);
              for (long i = 0; i < R * TN; ++i) hi[i] += c[0][i];
            }
          }
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          for (long m = 0; m < R && ch * R + m < M; ++m)
            for (long n = 0; n < nv; ++n)
              y[(ch * R + m) * N + col + g * TN + n] =
                  (hi[m * TN + n] + c[1][m * TN + n]) + c[2][m * TN + n] + (bk.b ? bk.b[g * TN + n] : 0.f);
        }
      }
      col += bk.n;
    }
    _tile_release();
  }
  free(a);
  return 0;
}

// ids [M] = the argmax over the N columns of y = x W^T + b as dflash_amx_linear3 computes y (the same bits decide:
// the first index among equal values, the first NaN if any), without computing most of y exactly. A screen takes
// the hi parts alone (one tile product a step instead of three); a screened value a differs from its exact value e
// by at most B = wn * c[m] + s[m] * (1 + wn) + 2u |b| with wn, |b| the largest column norm (rounded up, from
// dflash_amx_column_norms) and bias magnitude of its 16-column group (c: ||mid + lo|| + gamma * the parts' norms:
// Cauchy-Schwarz on the dropped parts and on both sums' rounding, in any summation order; s: room for denormals
// flushed to zero). A group whose largest a + B lies below the row's best (largest a - B) holds neither the argmax
// nor a tie: only the other groups are computed exactly, by linear3's loop (each row's bits are its own). A row
// with a non-finite input or screened value, or near overflow, is computed exactly whole. Returns the (row, group)
// pairs computed exactly, or -1 without memory.
extern "C" long dflash_amx_argmax(const float* x, long ldx, long M, long K, const uint16_t* tiles, long N,
                                  const float* b, const double* wn, long* ids, int threads) {
  if (M <= 0) return 0;
  const long steps = (K + TK - 1) / TK, Kp = steps * TK, groups = (N + TN - 1) / TN;
  const long chunks = (M + TR - 1) / TR, R = (M + chunks - 1) / chunks, Mp = chunks * R;
  uint16_t* a = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 3 * Mp * Kp);
  double* work = (double*)malloc(sizeof(double) * (2 * M + 2 * groups + M * groups));
  long* best_idx = (long*)malloc(sizeof(long) * M * groups);
  float* screened = (float*)malloc(sizeof(float) * M * groups);  // per (row, group): the largest a
  unsigned char* need = (unsigned char*)malloc(M * groups + M);
  if (!a || !work || !best_idx || !screened || !need) {
    free(a); free(work); free(best_idx); free(screened); free(need);
    return -1;
  }
  double *c = work, *s = work + M, *wg = work + 2 * M, *bg = wg + groups;
  float* best_val = (float*)(bg + groups);  // per (row, group): its exact maximum, when computed
  unsigned char* whole = need + M * groups;  // rows computed exactly whole
  split(x, ldx, M, K, Mp, Kp, a);
  const double u = 0x1p-24, n_ops = 2.0 * K + 8.0, gamma = n_ops * u / (1.0 - n_ops * u);
  for (long m = 0; m < M; ++m) {
    double nh = 0, nm = 0, nl = 0, nr = 0, l1 = 0;
    bool finite = true;
    for (long k = 0; k < K; ++k) {
      const double v = x[m * ldx + k];
      finite &= isfinite(v);
      const double h = from_bits((uint32_t)a[m * Kp + k] << 16), md = from_bits((uint32_t)a[(Mp + m) * Kp + k] << 16),
                   lo = from_bits((uint32_t)a[(2 * Mp + m) * Kp + k] << 16);
      nh += h * h; nm += md * md; nl += lo * lo; nr += (md + lo) * (md + lo); l1 += fabs(v);
    }
    c[m] = (sqrt(nr) + gamma * (2 * sqrt(nh) + sqrt(nm) + sqrt(nl))) * (1 + 0x1p-20);
    s[m] = 0x1p-110 * (K + 3) * (1 + l1);
    whole[m] = !finite || !isfinite(c[m]) || !isfinite(s[m]);
  }
  long exact = 0;
#pragma omp parallel num_threads(threads) reduction(+ : exact)
  {
    const TileConfig cfg = tile_config(R, M);
    _tile_loadconfig(&cfg);
    alignas(64) float cs[3][TR * TN];
    alignas(64) float hi[TR * TN];
    alignas(64) float ps[3 * PACK * TN];
    // The screen: per group, per row, the largest a (AVX-512 over the group's 16 columns).
#pragma omp for schedule(static)
    for (long g = 0; g < groups; ++g) {
      const uint16_t* wt = tiles + g * steps * TILE;
      const long nv = N - g * TN < TN ? N - g * TN : TN;
      const __mmask16 lanes = (__mmask16)((1u << nv) - 1u);
      const __m512 bias = b ? _mm512_maskz_loadu_ps(lanes, b + g * TN) : _mm512_setzero_ps();
      double w_max = 0, b_max = 0;
      for (long n = 0; n < nv; ++n) {
        w_max = wn[g * TN + n] > w_max ? wn[g * TN + n] : w_max;
        b_max = b && fabs((double)b[g * TN + n]) > b_max ? fabs((double)b[g * TN + n]) : b_max;
      }
      wg[g] = w_max;
      bg[g] = b_max;
      for (long ch = 0; ch < chunks; ++ch) {
        _tile_zero(0);
        const uint16_t* ah = a + ch * R * Kp;
        for (long t = 0; t < steps; ++t) {
          const char* pf = nullptr;  // linear3's prefetch pattern
          if (chunks == 1)
            pf = (const char*)(wt + (t + PREFETCH) * TILE);
          else if ((ch * steps + t) % chunks == 0)
            pf = (const char*)(wt + (steps + (ch * steps + t) / chunks) * TILE);
          if (pf)
            for (int l = 0; l < 16; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
          _tile_loadd(6, wt + t * TILE, 64);
          _tile_loadd(3, ah + t * TK, Kp * 2);
          _tile_dpbf16ps(0, 3, 6);
        }
        _tile_stored(0, cs[0], 64);
        for (long m = 0; m < R && ch * R + m < M; ++m) {
          const long row = ch * R + m;
          const __m512 v = _mm512_add_ps(_mm512_load_ps(cs[0] + m * TN), bias);
          // NaN, inf or near overflow (|v| not below 2^126): a NaN here, and the row is computed whole below.
          const bool bad = _mm512_mask_cmp_ps_mask(lanes, _mm512_abs_ps(v), _mm512_set1_ps(0x1p126f), _CMP_NLT_UQ);
          screened[row * groups + g] = bad ? NAN : _mm512_mask_reduce_max_ps(lanes, v);
        }
      }
    }
    // The groups each row needs exactly: those whose largest a + B reaches the row's best a - B.
#pragma omp for schedule(static)
    for (long m = 0; m < M; ++m) {
      double best = -INFINITY;
      const double cs_m = c[m] + s[m];
      for (long g = 0; g < groups; ++g) {
        const double v = screened[m * groups + g], bound = wg[g] * cs_m + s[m] + 2 * u * bg[g];
        if (!(fabs(v) + bound < 0x1p126)) whole[m] = 1;  // (a NaN too)
        best = v - bound > best ? v - bound : best;
      }
      for (long g = 0; g < groups; ++g) {
        const double v = screened[m * groups + g], bound = wg[g] * cs_m + s[m] + 2 * u * bg[g];
        need[m * groups + g] = whole[m] || v + bound >= best;
        exact += need[m * groups + g];
      }
    }
    // Exact values of the (chunk, group) pairs a row of the chunk needs; each needed (row, group) keeps its maximum
    // and first index (a NaN first). linear3's loop (packed_group up to PACK rows), repeated on purpose: the same
    // bits need the same operations, and linear3 calling one shared inline function for its row chunks was 3-7 %
    // slower at 24 rows (in-process A/B, alternated).
#pragma omp for schedule(dynamic, 1)
    for (long pair = 0; pair < groups * chunks; ++pair) {
      const long g = pair / chunks, ch = pair % chunks;
      bool any = false;
      for (long m = 0; m < R && ch * R + m < M; ++m) any |= need[(ch * R + m) * groups + g] != 0;
      if (!any) continue;
      const uint16_t* wt = tiles + g * steps * TILE;
      const long nv = N - g * TN < TN ? N - g * TN : TN;
      const uint16_t* ah = a + ch * R * Kp;
      const bool packed = M <= PACK;
      if (packed) {
        packed_group(wt, steps, a, M, Kp, ps, cs[0]);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (long i = 0; i < R * TN; ++i) hi[i] = 0.f;
        for (long t = 0; t < steps; ++t) {
          _tile_loadd(6, wt + t * TILE, 64);
          _tile_loadd(3, ah + t * TK, Kp * 2);
          _tile_loadd(4, ah + Mp * Kp + t * TK, Kp * 2);
          _tile_loadd(5, ah + 2 * Mp * Kp + t * TK, Kp * 2);
          _tile_dpbf16ps(0, 3, 6);
          _tile_dpbf16ps(1, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if ((t + 1) % FLUSH == 0 || t + 1 == steps) {
            _tile_stored(0, cs[0], 64);
            _tile_zero(0);
            for (long i = 0; i < R * TN; ++i) hi[i] += cs[0][i];
          }
        }
        _tile_stored(1, cs[1], 64);
        _tile_stored(2, cs[2], 64);
      }
      for (long m = 0; m < R && ch * R + m < M; ++m) {
        const long row = ch * R + m;
        if (!need[row * groups + g]) continue;
        float bv = 0.f;
        long bi = -1;
        for (long n = 0; n < nv; ++n) {
          const float e = packed ? packed_value(ps, M, m, n) : (hi[m * TN + n] + cs[1][m * TN + n]) + cs[2][m * TN + n];
          const float v = e + (b ? b[g * TN + n] : 0.f);
          if (bi >= 0 && isnan(bv)) break;
          if (bi < 0 || isnan(v) || v > bv) { bv = v; bi = g * TN + n; }
        }
        best_val[row * groups + g] = bv;
        best_idx[row * groups + g] = bi;
      }
    }
    _tile_release();
  }
  for (long m = 0; m < M; ++m) {  // the groups' winners in column order: the first NaN, else the first maximum
    float bv = 0.f;
    long bi = -1;
    for (long g = 0; g < groups; ++g) {
      if (!need[m * groups + g]) continue;
      const float v = best_val[m * groups + g];
      if (bi >= 0 && isnan(bv)) break;
      if (bi < 0 || isnan(v) || v > bv) { bv = v; bi = best_idx[m * groups + g]; }
    }
    ids[m] = bi;
  }
  free(a); free(work); free(best_idx); free(screened); free(need);
  return exact;
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
                _reason = f"dflash_kernels.cpu.linear: the fast CPU kernel is unavailable ({e}); using F.linear"
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


AMX_ENV = "DFLASH_CPU_LINEAR_AMX"
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")
_amx = None
_amx_reason: str | None = None
_amx_tried = False
_amx_on = os.environ.get(AMX_ENV, "1") != "0"
SCREEN_ENV = "DFLASH_CPU_ARGMAX_SCREEN"
_screen_on = os.environ.get(SCREEN_ENV, "1") != "0"


def _load_amx():
    global _amx, _amx_reason, _amx_tried
    if _amx_tried:
        return _amx
    with _lock:
        if not _amx_tried:
            try:
                missing = set(AMX_CPU_FLAGS) - set(cpu_native.cpu_flags().split())
                if missing:
                    raise RuntimeError(f"the CPU lacks {sorted(missing)}")
                lib = cpu_native.build_library("cpu_linear_amx", _AMX_SOURCE, (*FLAGS, "-mamx-tile", "-mamx-bf16"))
                if lib.dflash_amx_request() != 0:
                    raise RuntimeError("the OS did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
                p, n = ctypes.c_void_p, ctypes.c_long
                lib.dflash_amx_pack.restype = n
                lib.dflash_amx_pack.argtypes = [p, n, n, n, p, ctypes.c_int]
                lib.dflash_amx_linear3.restype = ctypes.c_int
                lib.dflash_amx_linear3.argtypes = [p, n, n, n, *[p, n, p] * 3, p, ctypes.c_int]
                lib.dflash_amx_column_norms.restype = None
                lib.dflash_amx_column_norms.argtypes = [p, n, n, p, ctypes.c_int]
                lib.dflash_amx_argmax.restype = n
                lib.dflash_amx_argmax.argtypes = [p, n, n, n, p, n, p, p, p, ctypes.c_int]
                _amx = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                # No warning: most CPUs have no AMX, and the fp32 kernel is the path then.
                _amx_reason = f"dflash_kernels.cpu.linear: the AMX path is unavailable ({e})"
            _amx_tried = True
    return _amx


def amx_unavailable_reason() -> str | None:
    """None when the AMX path can run (building it now if needed), else why not."""
    _load_amx()
    return _amx_reason


def set_amx(enabled: bool) -> bool:
    """Turn the AMX path on or off for this process (A/B runs; ``DFLASH_CPU_LINEAR_AMX=0`` starts it off);
    returns the previous setting."""
    global _amx_on
    before, _amx_on = _amx_on, bool(enabled)
    return before


def set_argmax_screen(enabled: bool) -> bool:
    """Turn :func:`linear_argmax`'s screen on or off for this process (A/B runs; ``DFLASH_CPU_ARGMAX_SCREEN=0``
    starts it off: the argmax of the whole ``linear``); returns the previous setting."""
    global _screen_on
    before, _screen_on = _screen_on, bool(enabled)
    return before


def amx_active() -> bool:
    """Whether :func:`linear` takes the AMX path for weights that are exactly bf16 (available and turned on)."""
    return amx_library() is not None


def amx_library() -> ctypes.CDLL | None:
    """The AMX kernel's library when :func:`amx_active`, else None: ``dflash_amx_linear3`` (see its comment in
    ``_AMX_SOURCE``) for a caller that has checked its arguments once (``dflash_kernels.cpu.forward``)."""
    return _load_amx() if _amx_on else None


# id(weight) -> [weak reference, version, data pointer, tiles or None, column norms or None (made on first use by
# the argmax)]: one packing per tensor and version.
_packed: dict[int, list] = {}


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: only its data pointer is checked
        return None


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """The AMX tiles of ``weight`` [N, K] (fp32 on the CPU, unit stride along K), or None when any of its values
    is not exactly a bf16 value (or the AMX path is unavailable). Packed on first use (one C pass, checking
    exactness as it goes) and kept while the tensor lives: an in-place update (which bumps its version) or a new
    storage repacks; a write that bypasses the version counter (``weight.data.copy_``, or any in-place write to an
    inference-mode tensor, which has no counter) is not seen."""
    key = id(weight)
    entry = _packed.get(key)
    version = _version(weight)
    if entry is not None and entry[0]() is weight and entry[1] == version and entry[2] == weight.data_ptr():
        return entry[3]
    lib = _load_amx()
    tiles = None
    if (lib is not None and weight.numel() and weight.dim() == 2 and weight.is_cpu and weight.dtype == torch.float32
            and weight.stride(1) == 1):
        n, k = weight.shape
        tiles = torch.empty(-(-n // 16) * -(-k // 32) * 512, dtype=torch.int16)
        inexact = lib.dflash_amx_pack(weight.data_ptr(), weight.stride(0), n, k, tiles.data_ptr(),
                                      torch.get_num_threads())
        tiles = None if inexact else tiles
    # The callback drops the entry with the tensor (a later tensor may reuse its id).
    _packed[key] = [weakref.ref(weight, lambda _ref, key=key: _packed.pop(key, None)), version,
                    weight.data_ptr(), tiles, None]
    return tiles


def _column_norms(weight: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """The norms of ``weight``'s rows (fp64, rounded up) from its current ``tiles`` (:func:`bf16_tiles`), kept with
    them."""
    entry = _packed[id(weight)]
    if entry[4] is None:
        norms = torch.empty(weight.shape[0], dtype=torch.float64)
        _amx.dflash_amx_column_norms(tiles.data_ptr(), weight.shape[0], weight.shape[1], norms.data_ptr(),
                                     torch.get_num_threads())
        entry[4] = norms
    return entry[4]


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
    tensor is not (as with ``merged_weight``). Each call compares the given tensors' addresses, shapes and strides
    with those recorded (about 1 us): a block whose storage moved (an in-place ``resize_`` that reallocated, then
    back to its shape) gets its kernel arguments recomputed; a block resized to another shape or restrided raises
    ValueError (the kernel would read freed or foreign memory)."""

    __slots__ = ("sources", "bias_sources", "layout", "weights", "biases", "in_features", "out_features", "fast",
                 "args")

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None = None):
        self.sources = tuple(weights)  # the tensors as given (e.g. Parameters): the keys of their AMX tiles
        self.bias_sources = () if biases is None else tuple(biases)
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
        self._pack()

    def _layout(self) -> tuple:
        return tuple((t.data_ptr(), t.shape, t.stride()) for t in self.sources + self.bias_sources)

    def _pack(self) -> None:
        """Record the tensors' layout and compute the kernel's arguments from their current addresses."""
        self.layout = self._layout()
        weights, biases = self.weights, self.biases
        args: list = []
        for i in range(3):  # the kernel's (pointer, row stride, rows, bias pointer) of each block; none: 0 rows
            if i < len(weights) and self.fast:
                args += [weights[i].data_ptr(), weights[i].stride(0), weights[i].shape[0],
                         None if biases is None else biases[i].data_ptr()]
            else:
                args += [None, 0, 0, None]
        self.args = tuple(args)

    def check_layout(self) -> None:
        """Raise ValueError if a block or bias was resized or restrided in place since it was built; recompute the
        kernel's arguments if only its storage moved."""
        layout = self._layout()
        if layout == self.layout:
            return
        for i, (now, then) in enumerate(zip(layout, self.layout)):
            if now[1:] != then[1:]:
                kind = "weights" if i < len(self.sources) else "biases"
                j = i if i < len(self.sources) else i - len(self.sources)
                raise ValueError(f"cpu_linear.RowBlocks: {kind}[{j}] changed in place from shape {tuple(then[1])} "
                                 f"stride {then[2]} to {tuple(now[1])} stride {now[2]} after the RowBlocks was built; "
                                 "build a new RowBlocks from the resized tensors")
        self._pack()


def _fast_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    f32 = torch.float32
    return (x.is_cpu and weight.is_cpu and x.dtype == f32 and weight.dtype == f32
            and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and weight.stride(1) == 1
            and (bias is None or (bias.is_cpu and bias.dtype == f32 and bias.shape == weight.shape[:1]
                                  and bias.stride(0) == 1))
            and unobserved_eager((x, weight, bias)))


def linear(x: torch.Tensor, weight: torch.Tensor | RowBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``.

    ``weight`` may also be a :class:`RowBlocks` (``bias`` None: the blocks carry theirs): ``F.linear`` of the
    blocks' concatenation. Row blocks take the kernel from one row up (one kernel call; at one row it streams the
    weight as fast as ``F.linear``'s GEMV, ``bench/cpu_gemm.py``); where the kernel cannot run, each block is an
    ``F.linear`` and the outputs are concatenated.

    A weight (every block of row blocks) whose values are all bf16 values takes the AMX path, at any row count,
    where the CPU has it (:func:`amx_active`); see the module docstring."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if type(weight) is RowBlocks:
        if bias is not None:
            raise ValueError("cpu_linear.linear: bias must be None with RowBlocks (the blocks carry their biases)")
        return _run_blocks(x, weight, rows)
    if not rows or not _fast_ok(x, weight, bias):
        return F.linear(x, weight, bias)
    if amx_active():
        tiles = bf16_tiles(weight)
        if tiles is not None:
            return _run_amx(x, ((tiles, weight.shape[0], bias),), weight.shape[0], rows)
    if not MIN_ROWS <= rows <= MAX_ROWS or (_kernel is None and _load() is None):
        return F.linear(x, weight, bias)
    return _run(_kernel, x, weight, bias, rows)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias).argmax(-1)``: ``x [..., K]`` -> int64 ``[...]``, the same indices exactly (the
    first among equal values, the first NaN if any), where the AMX path applies without computing most logits.

    Why: a greedy verify needs only the target's argmax, and on the AMX path the LM head's cost grows with the rows
    (three tile products per row chunk a step: SmolLM2's head at 24 rows ~2x its 8-row time). Here one tile product
    a step (the hi parts alone) screens the columns; each screened value lies within a proven bound of the exact one
    (the dropped parts by Cauchy-Schwarz against the column norms, both sums' rounding for any order, denormals
    flushed), and only the 16-column groups whose upper bound reaches the row's best lower bound are computed
    exactly, by the GEMM's own loop, so their bits are ``linear``'s. On SmolLM2's hidden states 1.4-1.6 groups of
    3,072 a row are computed exactly. Elsewhere (no AMX, a weight off the bf16 grid, :func:`set_argmax_screen`
    off, anything :func:`linear` itself leaves to ``F.linear``): ``linear(x, weight, bias).argmax(-1)``."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    fast = _fast_ok(x, weight, bias)
    if rows and _screen_on and fast and weight.shape[0] and amx_active():
        tiles = bf16_tiles(weight)
        if tiles is not None:
            return _amx_argmax(x.contiguous(), weight, tiles, bias)[0].view(x.shape[:-1])
    logits = linear(x, weight, bias)
    # Where nothing watches (fast), NumPy's argmax: the same rule, ~25x faster than torch's on the CPU.
    return argmax_cpu(logits) if fast and logits.numel() else logits.argmax(-1)


def _amx_argmax(x: torch.Tensor, weight: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, int]:
    """``dflash_amx_argmax`` on contiguous ``x``: (ids [rows], the (row, 16-column group) pairs computed exactly)."""
    n, k = weight.shape
    rows = x.numel() // k
    ids = torch.empty(rows, dtype=torch.int64)
    exact = _amx.dflash_amx_argmax(x.data_ptr(), k, rows, k, tiles.data_ptr(), n,
                                   None if bias is None else bias.data_ptr(), _column_norms(weight, tiles).data_ptr(),
                                   ids.data_ptr(), torch.get_num_threads())
    if exact < 0:
        raise MemoryError(f"cpu_linear.linear_argmax: no memory for the split input rows ({rows} x {k})")
    return ids, exact


def _run(kernel: _Kernel, x, weight, bias, rows):
    x = x.contiguous()
    k, n = x.shape[-1], weight.shape[0]
    out = x.new_empty(x.shape[:-1] + (n,))
    kernel.one(x.data_ptr(), rows, weight.data_ptr(), weight.stride(0), k, n,
               None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def _run_amx(x: torch.Tensor, blocks, n: int, rows: int) -> torch.Tensor:
    """``blocks``: up to three (tiles, rows N_i, bias or None); ``n`` = sum N_i."""
    x = x.contiguous()
    out = x.new_empty(x.shape[:-1] + (n,))
    args: list = []
    for i in range(3):
        if i < len(blocks):
            tiles, rows_i, bias = blocks[i]
            args += [tiles.data_ptr(), rows_i, None if bias is None else bias.data_ptr()]
        else:
            args += [None, 0, None]
    if _amx.dflash_amx_linear3(x.data_ptr(), x.shape[-1], rows, x.shape[-1], *args, out.data_ptr(),
                               torch.get_num_threads()):
        raise MemoryError(f"cpu_linear: no memory for the split input rows ({rows} x {x.shape[-1]})")
    return out


def _run_blocks(x: torch.Tensor, blocks: RowBlocks, rows: int) -> torch.Tensor:
    blocks.check_layout()
    ok = (blocks.fast and rows >= 1 and x.is_cpu and x.dtype == torch.float32 and x.shape[-1] == blocks.in_features
          and unobserved_eager((x,)))
    if ok and amx_active():
        tiles = [bf16_tiles(w) for w in blocks.sources]
        if all(t is not None for t in tiles):
            biases = blocks.biases or (None,) * len(tiles)
            return _run_amx(x, [(t, w.shape[0], b) for t, w, b in zip(tiles, blocks.weights, biases)],
                            blocks.out_features, rows)
    if ok and rows <= MAX_ROWS and (_kernel is not None or _load() is not None):
        x = x.contiguous()
        out = x.new_empty(x.shape[:-1] + (blocks.out_features,))
        _kernel.three(x.data_ptr(), rows, blocks.in_features, *blocks.args, out.data_ptr(), torch.get_num_threads())
        return out
    biases = blocks.biases or (None,) * len(blocks.weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(blocks.weights, biases)], -1)
