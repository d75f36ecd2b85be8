// The AMX path of dflash_kernels.cpu.linear: a weight whose fp32 values are all exactly bf16 values (SmolLM2's,
// dequantized from GGUF into bf16, and drafts saved in bf16) is packed once into AMX B tiles, half the bytes of the
// fp32 weight. Each input row x is split into three bf16 parts with x = hi + mid + lo exactly (each the top 8
// significant bits of what is left), so every product w * part is exact in fp32 and TDPBF16PS accumulates them in
// fp32: the fp32 dot product, only the order of its fp32 sums differs (as between any two GEMMs). Tile registers:
// C 0-2 (hi, mid, lo sums), A 3-5 (the parts of up to 16 rows), B 6 (16 columns x 32 deep, 1 KiB); up to 10 rows,
// the 3M part rows in 16-row slices instead, two column groups a step up to 5 rows (packed_pair).
//
// Compiled for AMX-TILE + AMX-BF16 + AVX-512 (the pragma below, after every header); bindings.cpp calls it only
// where the CPU reports AMX-BF16 and the OS grants the tile state (amx_request).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dflash_cpu.h"

// GCC 12 flags its own AVX-512 intrinsics (their deliberately undefined __Y operands) under -Wall.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16", \
                   "avx2,fma,bmi,bmi2,lzcnt,popcnt,f16c")

namespace dflash_cpu {
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
// Up to PAIR rows (3M part rows in one tile), two column groups share each step (packed_pair): their two independent
// tile-product chains and B tile loads stream more of the weight at once. A one-row SmolLM2 forward's 120 projections
// took 8.9 against 9.5 ms alone (2-core Xeon-167, 2 threads, alternated runs); at 8 rows sharing was 5 % slower.
constexpr long PAIR = 5;

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

// The tiles of M > PACK rows in chunks of R (amx_linear and the argmax's exact pass) and of the argmax's screen: C
// 0-2 and A 3-5 of R rows, B 6 of 16.
inline TileConfig tile_config(long R) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 6; ++t) { cfg.rows[t] = (uint8_t)R; cfg.colsb[t] = 64; }
  cfg.rows[6] = 16;
  cfg.colsb[6] = 64;
  return cfg;
}

// packed_pair's tiles for M <= PACK rows: C 0 / 2 and A 4 the first min(3M, 16) part rows, C 1 / 3 and A 5 the rest
// (none up to 5 rows: not configured), B 6-7 of 16.
inline TileConfig pair_tile_config(long M) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  const long first = 3 * M < TR ? 3 * M : TR, rest = 3 * M - first;
  for (int t = 0; t < 6; t += 2) {  // (C 0 / 2, A 4; C 1 / 3, A 5)
    cfg.rows[t] = (uint8_t)first;
    cfg.colsb[t] = 64;
    cfg.rows[t + 1] = (uint8_t)rest;
    cfg.colsb[t + 1] = rest ? 64 : 0;
  }
  for (int t = 6; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  return cfg;
}

// Requests B tile data ahead at step t of chunk ch (of `chunks` row chunks over a group of `steps` tiles at wt):
// without it the tile loads wait on memory (~1.5x slower here). One chunk: the tile PREFETCH steps ahead. More: the
// next group's tiles, one every `chunks` iterations over all of this group's chunks, so memory keeps streaming while
// the later chunks reuse this group's tiles (prefetching in the first chunk only left it idle then: 24-32 rows took
// 1.7x the time of 16).
__attribute__((always_inline)) inline void prefetch_b_tiles(const uint16_t* wt, long t, long ch, long steps,
                                                            long chunks) {
  const char* pf = nullptr;
  if (chunks == 1)
    pf = (const char*)(wt + (t + PREFETCH) * TILE);
  else if ((ch * steps + t) % chunks == 0)
    pf = (const char*)(wt + (steps + (ch * steps + t) / chunks) * TILE);
  if (pf)
    for (int l = 0; l < 16; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
}

// One or two 16-column groups (wa, and wb unless null) with the M <= PACK rows packed (the planes of split(..., Mp =
// M, ...) at a), on pair_tile_config's tiles: C 0-1 (wa's first and rest part rows), C 2-3 (wb's), A 4-5, B 6-7.
// psa / psb [3M][16] = each part row's sums over the K depth, moved out of the tiles every FLUSH steps; c: a
// [16][16] scratch. The value of row m, column n is packed_value(ps, M, m, n) (+ bias). Each group gets the same
// operations in the same order whether it shares the step or not (the same bits); two groups (up to PAIR rows)
// run two independent chains of tile products on A tiles loaded once.
__attribute__((always_inline)) inline void packed_pair(const uint16_t* wa, const uint16_t* wb, long steps,
                                                       const uint16_t* a, long M, long Kp, float* psa, float* psb,
                                                       float* c) {
  const long first = 3 * M < TR ? 3 * M : TR, rest = 3 * M - first;
  _tile_zero(0);
  if (rest) _tile_zero(1);  // (a tile of no rows is not configured: touching it faults)
  for (long i = 0; i < 3 * M * TN; ++i) psa[i] = 0.f;
  if (wb) {
    _tile_zero(2);
    if (rest) _tile_zero(3);
    for (long i = 0; i < 3 * M * TN; ++i) psb[i] = 0.f;
  }
  auto flush = [&](float* ps, bool b) {
    if (b) _tile_stored(2, c, 64); else _tile_stored(0, c, 64);
    if (b) _tile_zero(2); else _tile_zero(0);
    for (long i = 0; i < first * TN; ++i) ps[i] += c[i];
    if (rest) {
      if (b) _tile_stored(3, c, 64); else _tile_stored(1, c, 64);
      if (b) _tile_zero(3); else _tile_zero(1);
      for (long i = 0; i < rest * TN; ++i) ps[TR * TN + i] += c[i];
    }
  };
  for (long t = 0; t < steps; ++t) {
    prefetch_b_tiles(wa, t, 0, steps, 1);
    _tile_loadd(4, a + t * TK, Kp * 2);
    _tile_loadd(6, wa + t * TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (wb) {
      prefetch_b_tiles(wb, t, 0, steps, 1);
      _tile_loadd(7, wb + t * TILE, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (rest) {
      _tile_loadd(5, a + TR * Kp + t * TK, Kp * 2);
      _tile_dpbf16ps(1, 5, 6);
      if (wb) _tile_dpbf16ps(3, 5, 7);
    }
    if ((t + 1) % FLUSH == 0 || t + 1 == steps) {
      flush(psa, false);
      if (wb) flush(psb, true);
    }
  }
}

inline float packed_value(const float* ps, long M, long m, long n) {
  return (ps[m * TN + n] + ps[(M + m) * TN + n]) + ps[(2 * M + m) * TN + n];
}
}  // namespace

// The int8 screen's tiles: C 0 (int32 sums), A 3 (16 part rows: r1 of 8 rows, then their r2), B 6 (16 quads of 16
// columns), 64 bytes a row each.
inline TileConfig int8_tile_config() {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  const int used[] = {0, 3, 6};
  for (int t : used) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// Row m of x as two int8 parts, x ~ sx r1 + (sx / 254) r2 (r1 = x / sx rounded, sx = max|x| / 127; r2 the rest in
// steps of sx / 254), written as rows r and 8 + r of its 8-row chunk's A block [16][Kp8]; sets sx and ||x|| (rounded
// up) and returns ||x - that||, rounded up (both parts' integer sums are exact, so this is the screen's only error
// from x). A zero row: sx = 1, parts 0.
double quantize_row(const float* x, long K, long Kp8, int8_t* a, double* sx, double* norm) {
  double mx = 0;
  for (long k = 0; k < K; ++k) mx = fabs((double)x[k]) > mx ? fabs((double)x[k]) : mx;
  const double s1 = mx > 0 ? mx / 127 : 1.0, s2 = s1 / 254;
  double err = 0, n2 = 0;
  for (long k = 0; k < Kp8; ++k) {
    const double v = k < K ? x[k] : 0.0;
    n2 += v * v;
    const double q1 = fmin(127.0, fmax(-127.0, nearbyint(v / s1)));
    const double q2 = fmin(127.0, fmax(-127.0, nearbyint((v - s1 * q1) / s2)));
    a[k] = (int8_t)q1;
    a[8 * Kp8 + k] = (int8_t)q2;
    const double e = v - (s1 * q1 + s2 * q2);
    err += e * e;
  }
  *sx = s1;
  *norm = sqrt(n2) * (1 + 0x1p-20);
  return sqrt(err) * (1 + 0x1p-20) + 0x1p-40 * sqrt(n2);  // (+ the fp64 rounding of the parts' products)
}

int amx_request() {
  return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
}

long amx_pack(const float* w, long ldw, long N, long K, uint16_t* tiles, int threads) {
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

void amx_column_norms(const uint16_t* tiles, long N, long K, double* norms, int threads) {
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

// AmxLinearArgs (dflash_cpu.h). Each thread takes a contiguous range of 16-column groups of each block; per group,
// the rows in chunks of at most 16 (the B tiles of the later chunks come from L1/L2: the weight leaves memory once),
// or up to PACK rows packed (packed_pair: two groups a step up to PAIR rows).
int amx_linear(const AmxLinearArgs& args) {
  const float* x = args.x;
  const long ldx = args.ldx, M = args.M, K = args.K;
  const AmxBlock* blk = args.blocks;
  float* y = args.y;
  const int threads = args.threads;
  const long N = blk[0].n + blk[1].n + blk[2].n, steps = (K + TK - 1) / TK, Kp = steps * TK;
  const long chunks = (M + TR - 1) / TR, R = (M + chunks - 1) / chunks, Mp = chunks * R;  // rows split evenly
  uint16_t* a = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 3 * Mp * Kp);  // a multiple of 64 bytes
  if (!a) return -1;
  split(x, ldx, M, K, Mp, Kp, a);
#pragma omp parallel num_threads(threads)
  {
    const TileConfig cfg = M <= PACK ? pair_tile_config(M) : tile_config(R);
    _tile_loadconfig(&cfg);  // per call: other code (oneDNN) may have configured the tiles differently
    alignas(64) float c[3][TR * TN];
    alignas(64) float hi[TR * TN];
    alignas(64) float ps[2][3 * PACK * TN];
    long col = 0;
    for (int s = 0; s < 3; ++s) {
      const AmxBlock bk = blk[s];
      const long groups = (bk.n + TN - 1) / TN;
      if (M <= PACK) {
        const long share = M <= PAIR ? 2 : 1;  // groups a step
#pragma omp for schedule(static) nowait
        for (long unit = 0; unit < (groups + share - 1) / share; ++unit) {
          const long g0 = share * unit, count = share == 2 && g0 + 1 < groups ? 2 : 1;
          packed_pair(bk.tiles + g0 * steps * TILE, count == 2 ? bk.tiles + (g0 + 1) * steps * TILE : nullptr, steps,
                      a, M, Kp, ps[0], ps[1], c[0]);
          for (long h = 0; h < count; ++h) {
            const long g = g0 + h, nv = bk.n - g * TN < TN ? bk.n - g * TN : TN;
            for (long m = 0; m < M; ++m)
              for (long n = 0; n < nv; ++n)
                y[m * N + col + g * TN + n] = packed_value(ps[h], M, m, n) + (bk.b ? bk.b[g * TN + n] : 0.f);
          }
        }
        col += bk.n;
        continue;
      }
#pragma omp for schedule(static) nowait
      for (long g = 0; g < groups; ++g) {
        const uint16_t* wt = bk.tiles + g * steps * TILE;
        const long nv = bk.n - g * TN < TN ? bk.n - g * TN : TN;
        for (long ch = 0; ch < chunks; ++ch) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          const uint16_t* ah = a + ch * R * Kp;
          for (long i = 0; i < R * TN; ++i) hi[i] = 0.f;
          for (long t = 0; t < steps; ++t) {
            prefetch_b_tiles(wt, t, ch, steps, chunks);
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

// AmxArgmaxArgs (dflash_cpu.h): ids [M] = the argmax over the N columns of y = x W^T + b as amx_linear computes y
// (the same bits decide: the first index among equal values, the first NaN if any), without computing most of y
// exactly. A screen takes the hi parts alone (one tile product a step instead of three); a screened value a differs
// from its exact value e by at most B = wn * c[m] + s[m] * (1 + wn) + 2u |b| with wn, |b| the largest column norm
// (rounded up, from amx_column_norms) and bias magnitude of its 16-column group (c: ||mid + lo|| + gamma * the
// parts' norms: Cauchy-Schwarz on the dropped parts and on both sums' rounding, in any summation order; s: room for
// denormals flushed to zero). A group whose largest a + B lies below the row's best (largest a - B) holds neither the argmax
// nor a tie: only the other groups are computed exactly, by amx_linear's loop (each row's bits are its own). A row
// with a non-finite input or screened value, or near overflow, is computed exactly whole. With an int8 screen
// (args.int8, no bias): each x row as two int8 parts (quantize_row) times the weight's int8 codes on AMX-INT8 tiles,
// integer sums exact, half the bytes of the bf16 tiles; B = ||x|| bounds[g] + ||x - parts|| code_norms[g] + room
// for the fp64 scaling and for underflow (the derivation: dflash_kernels.cpu.linear.int8_screen). Returns the (row,
// group) pairs computed exactly, or -1 without memory.
long amx_argmax(const AmxArgmaxArgs& args) {
  const float *x = args.x, *b = args.b;
  const long ldx = args.ldx, M = args.M, K = args.K, N = args.N;
  const uint16_t* tiles = args.tiles;
  const double* wn = args.norms;
  int64_t* ids = args.ids;
  const int threads = args.threads;
  const AmxInt8Screen* i8 = args.int8;
  if (M <= 0) return 0;
  const long steps = (K + TK - 1) / TK, Kp = steps * TK, groups = (N + TN - 1) / TN;
  const long chunks = (M + TR - 1) / TR, R = (M + chunks - 1) / chunks, Mp = chunks * R;
  // The int8 screen's A blocks: per 8 rows, 16 part rows of Kp8 bytes (zero padded).
  const long steps8 = (K + 63) / 64, Kp8 = steps8 * 64, chunks8 = (M + 7) / 8;
  uint16_t* a = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 3 * Mp * Kp);
  double* work = (double*)malloc(sizeof(double) * (2 * M + 2 * groups + M * groups));
  long* best_idx = (long*)malloc(sizeof(long) * M * groups);
  // per (row, group): the largest screened value (float for the hi-part screen, double for the int8 one)
  void* screened_values = malloc((i8 ? sizeof(double) : sizeof(float)) * M * groups);
  unsigned char* need = (unsigned char*)malloc(M * groups + M);
  int8_t* a8 = i8 ? (int8_t*)aligned_alloc(64, 16 * Kp8 * chunks8) : nullptr;
  double* row8 = i8 ? (double*)malloc(sizeof(double) * 4 * M) : nullptr;  // sx, ||x||, ||x - parts||, slack
  if (!a || !work || !best_idx || !screened_values || !need || (i8 && (!a8 || !row8))) {
    free(a); free(work); free(best_idx); free(screened_values); free(need); free(a8); free(row8);
    return -1;
  }
  float* screened = (float*)screened_values;
  double* screened8 = (double*)screened_values;
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
  if (i8) {  // each row's two int8 parts, ||x||, ||x - parts|| and room for the fp64 sums and for underflow
    memset(a8, 0, 16 * Kp8 * chunks8);
    for (long m = 0; m < M; ++m) {
      double* r = row8 + 4 * m;
      r[2] = quantize_row(x + m * ldx, K, Kp8, a8 + (m / 8) * 16 * Kp8 + (m % 8) * Kp8, &r[0], &r[1]);
      r[3] = 0x1p-48 * i8->max_scale * 127.0 * 127.0 * (double)K * (r[0] + r[0] / 254) +
             s[m] * (1 + 127.0 * sqrt((double)K) * i8->max_scale);  // (||w_j|| <= sqrt(K) 127 scale_j)
      whole[m] |= !isfinite(r[1]) || !isfinite(r[2]) || !isfinite(r[3]);
    }
  }
  long exact = 0;
#pragma omp parallel num_threads(threads) reduction(+ : exact)
  {
    const TileConfig cfg = tile_config(R), exact_cfg = M <= PACK ? pair_tile_config(M) : cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float cs[3][TR * TN];
    alignas(64) float hi[TR * TN];
    alignas(64) float ps[3 * PACK * TN];
    if (i8) {
      // The int8 screen: per group, per 8-row chunk, one TDPBSSD a 64-deep step gives both parts' exact integer sums
      // (rows 0-7: r1 . codes, 8-15: r2 . codes); per row the largest scaled value.
      const TileConfig cfg8 = int8_tile_config();
      _tile_loadconfig(&cfg8);
      alignas(64) int32_t ci[16 * TN];
#pragma omp for schedule(static)
      for (long g = 0; g < groups; ++g) {
        const int8_t* wt = i8->tiles + g * steps8 * 1024;
        const long nv = N - g * TN < TN ? N - g * TN : TN;
        for (long ch = 0; ch < chunks8; ++ch) {
          _tile_zero(0);
          for (long t = 0; t < steps8; ++t) {
            const char* pf = (const char*)(wt + (t + PREFETCH) * 1024);
            if (ch == 0)
              for (int l = 0; l < 16; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
            _tile_loadd(6, wt + t * 1024, 64);
            _tile_loadd(3, a8 + ch * 16 * Kp8 + t * 64, Kp8);
            _tile_dpbssd(0, 3, 6);
          }
          _tile_stored(0, ci, 64);
          for (long r = 0; r < 8 && ch * 8 + r < M; ++r) {
            const long row = ch * 8 + r;
            const double s1 = row8[4 * row], s2 = s1 / 254;
            double mx = -INFINITY;
            for (long n = 0; n < nv; ++n) {
              const double v = i8->scales[g * TN + n] * (s1 * ci[r * TN + n] + s2 * ci[(8 + r) * TN + n]);
              mx = v > mx ? v : mx;
            }
            screened8[row * groups + g] = mx;
          }
        }
      }
    } else {  // the hi-part screen: per group, per row, the largest a (AVX-512 over the group's 16 columns)
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
            prefetch_b_tiles(wt, t, ch, steps, chunks);
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
    }
    _tile_loadconfig(&exact_cfg);  // the exact pass's tiles
    // The groups each row needs exactly: those whose largest a + B reaches the row's best a - B.
#pragma omp for schedule(static)
    for (long m = 0; m < M; ++m) {
      double best = -INFINITY;
      const double cs_m = c[m] + s[m];
      // (row m, group g)'s screened value and the bound of its distance to each exact value of the group
      auto screen = [&](long g, double* bound) -> double {
        if (i8) {
          const double* r = row8 + 4 * m;
          *bound = r[1] * i8->bounds[g] + r[2] * i8->code_norms[g] + r[3];
          return screened8[m * groups + g];
        }
        *bound = wg[g] * cs_m + s[m] + 2 * u * bg[g];
        return screened[m * groups + g];
      };
      for (long g = 0; g < groups; ++g) {
        double bound;
        const double v = screen(g, &bound);
        if (!(fabs(v) + bound < 0x1p126)) whole[m] = 1;  // (a NaN too)
        best = v - bound > best ? v - bound : best;
      }
      for (long g = 0; g < groups; ++g) {
        double bound;
        const double v = screen(g, &bound);
        need[m * groups + g] = whole[m] || v + bound >= best;
        exact += need[m * groups + g];
      }
    }
    // Exact values of the (chunk, group) pairs a row of the chunk needs; each needed (row, group) keeps its maximum
    // and first index (a NaN first). amx_linear's loop (packed_pair up to PACK rows, a group alone), repeated on
    // purpose: the same bits need the same operations, and amx_linear calling one shared inline function for its row
    // chunks was 3-7 % slower at 24 rows (in-process A/B, alternated).
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
        packed_pair(wt, nullptr, steps, a, M, Kp, ps, nullptr, cs[0]);
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
        ArgmaxWinner win;
        for (long n = 0; n < nv; ++n) {
          const float e = packed ? packed_value(ps, M, m, n) : (hi[m * TN + n] + cs[1][m * TN + n]) + cs[2][m * TN + n];
          if (!win.take(e + (b ? b[g * TN + n] : 0.f), g * TN + n)) break;
        }
        best_val[row * groups + g] = win.value;
        best_idx[row * groups + g] = win.index;
      }
    }
    _tile_release();
  }
  for (long m = 0; m < M; ++m) {  // the groups' winners in column order
    ArgmaxWinner win;
    for (long g = 0; g < groups; ++g)
      if (need[m * groups + g] && !win.take(best_val[m * groups + g], best_idx[m * groups + g])) break;
    ids[m] = win.index;
  }
  free(a); free(work); free(best_idx); free(screened_values); free(need); free(a8); free(row8);
  return exact;
}

}  // namespace dflash_cpu
