// The fp32 linear kernel (dflash_kernels.cpu.linear's "fp32 SIMD" path) for the instruction set of the
// translation unit that includes this, chosen by its DFLASH_CPU_AVX512 / DFLASH_CPU_AVX2 (isa_avx512.cpp,
// isa_avx2.cpp); internal linkage. One kernel for two weight storages: fp32 (float) and bf16-packed (uint16_t, the
// upper halves of the bits of a weight whose fp32 values are all bf16 values). A packed weight is widened to the
// same fp32 values in registers (shift left by 16: exact), and everything else (the loop, the products, the order
// of the sums) is shared, so both give the same bits; the packed one streams half the bytes. The tile also reads
// int8 codes (argmax_int8.h's screen), widened exactly to fp32.
#pragma once

#include <immintrin.h>

#include "dflash_cpu.h"

// GCC 12 flags its own AVX-512 intrinsics (their deliberately undefined __Y operands) under -Wall.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

// One vector type per ISA, with its tile: MR rows of x times NW weight rows, MR * NW accumulators.
// AVX-512: 16 lanes, 4 x rows x 4 weight rows. Measured on SmolLM2's projections at 8 rows (2 threads, a sweep
// of every projection of the model, distinct weights): 4 x 4 in two passes over the x rows (the second pass finds
// the 4 weight rows in L1) took ~6 % less time than one pass of 8 x rows x 2 weight rows, whose eight x loads
// per two weight loads and 16 one-vector reductions cost more than the re-read. AVX2 + FMA: 8 lanes, 8 x rows x
// 1 weight row (8 of 16 ymm registers: two weight rows would need 16 accumulators plus the loads, and spill).
#if DFLASH_CPU_AVX512
typedef __m512 vec;
enum { VL = 16, NW = 4, MR = 4 };
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_first(const float* p, long n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline vec vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vec vload_first(const uint16_t* p, long n) {
  __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const int8_t* p) {  // int8 codes (the argmax screen's): exact in fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline vec vload_first(const int8_t* p, long n) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p)));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
// Lane i of the result = the sum of v[i]'s 16 lanes: a transpose-and-add tree (15 adds and 30 shuffles for all
// 16 sums, where one reduction per vector takes 4 adds and 4 shuffles each).
inline vec hsum16(const vec* v) {
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
#elif DFLASH_CPU_AVX2
typedef __m256 vec;
enum { VL = 8, NW = 1, MR = 8 };
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload_first(const float* p, long n) {  // lanes >= n read as 0 and are not touched in memory
  __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane));
}
inline vec vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vec vload_first(const uint16_t* p, long n) {  // AVX2 has no 16-bit masked load: via a zeroed copy
  alignas(16) uint16_t t[VL] = {0};
  for (long i = 0; i < n; ++i) t[i] = p[i];
  return vload(t);
}
inline vec vload(const int8_t* p) {  // int8 codes (the argmax screen's): exact in fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline vec vload_first(const int8_t* p, long n) {
  alignas(16) int8_t t[16] = {0};
  for (long i = 0; i < n; ++i) t[i] = p[i];
  return vload(t);
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
#error "linear_f32.h needs DFLASH_CPU_AVX512 or DFLASH_CPU_AVX2 set by its translation unit"
#endif

// y[m, j] = sum_k x[m, k] w[j, k] (+ b[j]) for R <= MR rows of x and the nw <= NW weight rows at w (W: float or
// bf16-packed uint16_t).
template <typename W, int R>
void tile(const float* x, long ldx, const W* w, long ldw, long K, int nw, const float* b, float* y, long ldy) {
  const W* wr[NW];
  for (int j = 0; j < NW; ++j) wr[j] = w + (j < nw ? j : nw - 1) * ldw;  // a missing last row re-reads row nw-1
  vec acc[NW][R];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < NW; ++j) acc[j][m] = vzero();
  long k = 0;
  for (; k + VL <= K; k += VL) {
    // The weight rows 4 ahead, requested now into L2: without it this kernel ran ~2x slower here (the hardware
    // prefetcher alone does not keep enough lines in flight); 8 or more rows ahead, or into L1, was slower.
    // (A line is 64 bytes: int8 codes request each one once, every fourth step.)
    if (sizeof(W) > 1 || k % 64 == 0)
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
#if DFLASH_CPU_AVX512
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

// LinearArgsOf (dflash_cpu.h): each thread takes a contiguous range of NW-row groups of each block (no barrier
// between blocks) and runs the x rows over each group in passes of at most MR.
template <typename W>
void linear(const dflash_cpu::LinearArgsOf<W>& a) {
  typedef void (*tile_fn)(const float*, long, const W*, long, long, int, const float*, float*, long);
  static const tile_fn tiles[MR + 1] = {0, tile<W, 1>, tile<W, 2>, tile<W, 3>, tile<W, 4>
#if !DFLASH_CPU_AVX512
                                        , tile<W, 5>, tile<W, 6>, tile<W, 7>, tile<W, 8>
#endif
  };
  const float* x = a.x;
  const long M = a.M, K = a.K;
  const dflash_cpu::LinearBlockOf<W>* blk = a.blocks;
  const int nblk = a.nblocks, threads = a.threads;
  float* y = a.y;
  long N = 0;
  for (int s = 0; s < nblk; ++s) N += blk[s].n;
#pragma omp parallel num_threads(threads)
  {
    long col = 0;
    for (int s = 0; s < nblk; ++s) {
      const dflash_cpu::LinearBlockOf<W> r = blk[s];
      long groups = (r.n + NW - 1) / NW;
#pragma omp for schedule(static) nowait
      for (long p = 0; p < groups; ++p) {
        long n = NW * p;
        int nw = r.n - n < NW ? (int)(r.n - n) : (int)NW;
        for (long m = 0; m < M; m += MR) {
          int mr = M - m < MR ? (int)(M - m) : (int)MR;
          tiles[mr](x + m * K, K, r.w + n * r.ldw, r.ldw, K, nw, r.b ? r.b + n : 0, y + m * N + col + n, N);
        }
      }
      col += r.n;
    }
  }
}

}  // namespace
