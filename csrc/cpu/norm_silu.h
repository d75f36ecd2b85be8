// The residual add + RMSNorm and silu * up kernels (add_rms_norm's and silu_mul's "cpu" bodies), for the
// instruction set of the translation unit that includes this (isa_avx512.cpp, isa_avx2.cpp); internal linkage.
#pragma once

#include "dflash_cpu.h"
#include "simd16.h"

namespace {

// RmsNormArgs (dflash_cpu.h).
void add_rms_norm(const dflash_cpu::RmsNormArgs& a) {
  const float *x = a.x, *w = a.weight;
  float *res = a.residual, *out = a.out;
  const long ldx = a.ldx, rows = a.rows, H = a.hidden;
  const float eps = a.eps;
  const int threads = a.threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * H >= 32768)
  for (long r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* o = out + r * H;
    const float* s = xr;
    if (res) {
      float* sr = res + r * H;
      for (long i = 0; i < H; ++i) sr[i] += xr[i];
      s = sr;
    }
    float k = rstd(s, H, eps);
    for (long i = 0; i < H; ++i) o[i] = w[i] * (s[i] * k);
  }
}

// SiluMulArgs (dflash_cpu.h). silu(g) = g * sigmoid(g) from e = exp(-|g|) (the polynomial's range): 1 / (1 + e)
// for g >= 0, e / (1 + e) below.
void silu_mul(const dflash_cpu::SiluMulArgs& a) {
  const float* x = a.gate_up;
  float* out = a.out;
  const long ldx = a.ld, rows = a.rows, I = a.inter;
  const int threads = a.threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * I >= 32768)
  for (long r = 0; r < rows; ++r) {
    const float* g = x + r * ldx;
    const float* u = g + I;
    float* o = out + r * I;
    long c = 0;
    for (; c + L <= I; c += L) {
      v16 gv = load(g + c);
      v16 a = gv < 0.f ? gv : -gv;  // -|g|
      v16 e = exp_nonpositive(a);
      v16 sig = (gv < 0.f ? e : 1.f) / (1.f + e);  // sigmoid(g), no cancellation on either side
      v16 y = gv * sig * load(u + c);
      __builtin_memcpy(o + c, &y, sizeof y);
    }
    for (; c < I; ++c) o[c] = g[c] / (1.f + expf(-g[c])) * u[c];
  }
}

}  // namespace
