// The argmax of a linear on the bf16-packed route with an int8 screen (dflash_kernels.cpu.linear.linear_argmax off
// the AMX path), for the instruction set of the translation unit that includes this after linear_f32.h (its vector
// types and its tile); internal linkage.
//
// Why: a greedy step needs only the argmax of the LM head, and the head is a fifth of a SmolLM2 step's bytes. The
// screen reads int8 codes (1 byte a weight, the packed copy's half) and bounds each column's error; only the
// 16-column groups it cannot rule out are computed exactly, with the same tile calls linear_<isa>_bf16 makes for
// those columns (a column's sums do not depend on the other columns or rows of a tile), so the exact values are
// linear's bits.
#pragma once

#include <math.h>

#include "dflash_cpu.h"
#include "simd16.h"

namespace {

// Int8ArgmaxArgs (dflash_cpu.h). Returns the (row, 16-column group) pairs computed exactly, or -1 without memory.
long argmax_int8(const dflash_cpu::Int8ArgmaxArgs& a) {
  constexpr long GC = 16;  // columns of a group
  typedef void (*tile8_fn)(const float*, long, const int8_t*, long, long, int, const float*, float*, long);
  static const tile8_fn screen_tiles[MR + 1] = {0, tile<int8_t, 1>, tile<int8_t, 2>, tile<int8_t, 3>, tile<int8_t, 4>
#if !DFLASH_CPU_AVX512
                                                , tile<int8_t, 5>, tile<int8_t, 6>, tile<int8_t, 7>, tile<int8_t, 8>
#endif
  };
  const float* x = a.x;
  const long ldx = a.ldx, M = a.M, K = a.K, N = a.N, groups = (N + GC - 1) / GC;
  const int threads = a.threads;
  if (M <= 0) return 0;
  Buffer<double> norm(M), slack(M);
  Buffer<unsigned char> whole(M), need(M * groups);
  Buffer<float> top(M * groups), best_val(M * groups), work((long)threads * M * GC);
  Buffer<long> best_idx(M * groups);
  if (!norm || !slack || !whole || !need || !top || !best_val || !work || !best_idx) return -1;
  for (long m = 0; m < M; ++m) {  // ||x||, rounded up, and room for gradual underflow in both sums
    double n2 = 0, l1 = 0;
    bool finite = true;
    for (long k = 0; k < K; ++k) {
      const double v = x[m * ldx + k];
      finite &= isfinite(v);
      n2 += v * v;
      l1 += fabs(v);
    }
    norm[m] = sqrt(n2) * (1 + 0x1p-20);
    slack[m] = 0x1p-110 * (double)(K + 3) * (1 + l1) * (1 + a.max_scale);
    whole[m] = !finite || !isfinite(norm[m]) || !isfinite(slack[m]);
  }
  long exact = 0;
#pragma omp parallel num_threads(threads) reduction(+ : exact)
  {
    float* t = work.get() + (long)omp_get_thread_num() * M * GC;  // [M][16]: one group's screened sums
    // The screen: per group and row, the largest scales[j] * sum_k x[k] codes[j, k] (NaN: not finite or near
    // overflow; the row is then computed whole).
#pragma omp for schedule(static)
    for (long g = 0; g < groups; ++g) {
      const long c0 = g * GC, nv = N - c0 < GC ? N - c0 : GC;
      for (long n = 0; n < nv; n += NW) {
        const int nw = nv - n < NW ? (int)(nv - n) : (int)NW;
        for (long m = 0; m < M; m += MR) {
          const int mr = M - m < MR ? (int)(M - m) : (int)MR;
          screen_tiles[mr](x + m * ldx, ldx, a.codes + (c0 + n) * K, K, K, nw, nullptr, t + m * GC + n, GC);
        }
      }
      for (long m = 0; m < M; ++m) {
        float mx = -INFINITY;
        bool bad = false;
        for (long j = 0; j < nv; ++j) {
          const float s = a.scales[c0 + j] * t[m * GC + j];
          bad |= !(fabsf(s) < 0x1p126f);
          mx = s > mx ? s : mx;
        }
        top[m * groups + g] = bad ? NAN : mx;
      }
    }
    // The groups each row needs exactly: those whose largest screened value + bound reaches the row's best
    // screened value - bound.
#pragma omp for schedule(static)
    for (long m = 0; m < M; ++m) {
      double best = -INFINITY;
      for (long g = 0; g < groups; ++g) {
        const double v = top[m * groups + g], bound = norm[m] * a.bounds[g] + slack[m];
        if (!(fabs(v) + bound < 0x1p126)) whole[m] = 1;  // (a NaN too)
        best = v - bound > best ? v - bound : best;
      }
      for (long g = 0; g < groups; ++g) {
        const double v = top[m * groups + g], bound = norm[m] * a.bounds[g] + slack[m];
        need[m * groups + g] = whole[m] || v + bound >= best;
        exact += need[m * groups + g];
      }
    }
    // Exact values of the needed (row, group) pairs, one row at a time (a value's bits do not depend on the
    // tile's other rows); each keeps its group's maximum and first index (a NaN first).
#pragma omp for schedule(dynamic, 1)
    for (long g = 0; g < groups; ++g) {
      const long c0 = g * GC, nv = N - c0 < GC ? N - c0 : GC;
      for (long m = 0; m < M; ++m) {
        if (!need[m * groups + g]) continue;
        float y[GC];
        for (long n = 0; n < nv; n += NW) {
          const int nw = nv - n < NW ? (int)(nv - n) : (int)NW;
          tile<uint16_t, 1>(x + m * ldx, ldx, a.packed + (c0 + n) * K, K, K, nw, nullptr, y + n, GC);
        }
        dflash_cpu::ArgmaxWinner win;
        for (long n = 0; n < nv; ++n)
          if (!win.take(y[n], c0 + n)) break;
        best_val[m * groups + g] = win.value;
        best_idx[m * groups + g] = win.index;
      }
    }
  }
  for (long m = 0; m < M; ++m) {  // the groups' winners in column order
    dflash_cpu::ArgmaxWinner win;
    for (long g = 0; g < groups; ++g)
      if (need[m * groups + g] && !win.take(best_val[m * groups + g], best_idx[m * groups + g])) break;
    a.ids[m] = win.index;
  }
  return exact;
}

}  // namespace
