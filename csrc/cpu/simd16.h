// Vector helpers of the fp32 kernels (norm_silu.h, attention.h): GCC/Clang vectors of 16 floats, compiled for the
// instruction set of the translation unit that includes this (isa_avx512.cpp, isa_avx2.cpp). Only for those: it
// opens an anonymous namespace, so each ISA's copy stays its own (internal linkage, no ODR mix-up at link time).
#pragma once

#include <math.h>
#include <stdint.h>

#include <new>

// v16 arguments of these internal functions: no ABI to keep (GCC warns that AVX-512-sized vectors pass differently
// without AVX-512).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

// n elements of T from new (std::nothrow), freed at scope exit; false (null) when the allocation failed. (Not
// std::unique_ptr: a template shared with other translation units could be linked in from this ISA's copy.)
template <typename T>
class Buffer {
 public:
  explicit Buffer(long n) : p_(new (std::nothrow) T[n]) {}
  ~Buffer() { delete[] p_; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  explicit operator bool() const { return p_ != nullptr; }
  T* get() const { return p_; }
  T& operator[](long i) const { return p_[i]; }

 private:
  T* p_;
};

constexpr int L = 16;  // partial sums: one AVX-512 vector (two AVX2 ones)
typedef float v16 __attribute__((vector_size(4 * L)));  // GCC/Clang vectors: the registers of the hot loops
typedef int32_t v16i __attribute__((vector_size(4 * L)));

inline v16 load(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// sum_i a[i] * b[i] over n floats, in L lane sums added in a fixed order.
inline float dot(const float* a, const float* b, long n) {
  float acc[L] = {0.f};
  long i = 0;
  for (; i + L <= n; i += L)
    for (int l = 0; l < L; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  float s = 0.f;
  for (int l = 0; l < L; ++l) s += acc[l];
  return s;
}

// 1 / sqrt(mean(x^2) + eps) of n floats.
inline float rstd(const float* x, long n, float eps) { return 1.f / sqrtf(dot(x, x, n) / (float)n + eps); }

// y = RoPE(RMSNorm(x) * w) (w null: no norm) of one head of D floats; cos / sin_signed rows of the tables.
inline void norm_rope(const float* x, const float* w, float eps, const float* cs, const float* sn, long D, float* y) {
  float t[dflash_cpu::kMaxHeadDim];
  const float* h = x;
  if (w) {
    float r = rstd(x, D, eps);
    for (long d = 0; d < D; ++d) t[d] = w[d] * (x[d] * r);
    h = t;
  }
  long half = D / 2;
  for (long d = 0; d < D; ++d) {
    float rolled = h[d < half ? d + half : d - half];
    float a = h[d] * cs[d];
    float b = rolled * sn[d];
    y[d] = a + b;
  }
}

inline long max_len(const int64_t* lens, long n) {
  long m = 0;
  for (long i = 0; i < n; ++i) m = lens[i] > m ? lens[i] : m;
  return m;
}

// exp(t) for t <= 0; lanes below -87 (also -inf and NaN: hidden keys) give exactly 0. Cephes' expf: k = round(t /
// ln 2), t - k ln 2 in two parts, a degree-7 polynomial, times 2^k built in the exponent bits (about 1 ulp).
inline v16 exp_nonpositive(v16 t) {
  v16i hidden = !(t >= -87.0f);
  t = hidden ? 0.f : t;
  v16 y = t * 1.44269504088896341f + 0.5f;
  v16i k = __builtin_convertvector(y, v16i);  // toward zero: one less where that rounded up
  k += __builtin_convertvector(k, v16) > y;   // (true is -1)
  v16 kf = __builtin_convertvector(k, v16);
  v16 r = t - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  v16 p = 1.9875691500e-4f + 0.f * r;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  v16 two = (v16)((k + 127) << 23);
  return hidden ? 0.f : p * two;
}

// acc[r][c] += sum_j w[r * ldw + j] * p[j * stride + c * L ...] over `count` rows j, for NR weight rows r and NV
// vectors c (NR x NV accumulators in registers): each row of p is loaded once for all NR weight rows.
template <int NR, int NV>
inline void weighted_rows(const float* p, long stride, const float* w, long ldw, long count, v16 (*acc)[4]) {
  v16 a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) a[r][c] = acc[r][c];
  for (long j = 0; j < count; ++j, p += stride) {
    v16 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load(p + c * L);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NV; ++c) a[r][c] += w[r * ldw + j] * x[c];
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = a[r][c];
}

// weighted_rows with NV known at run time (1-4).
template <int NR>
inline void weighted_rows_nv(const float* p, long stride, const float* w, long ldw, long count, int nv,
                             v16 (*acc)[4]) {
  switch (nv) {
    case 4: weighted_rows<NR, 4>(p, stride, w, ldw, count, acc); break;
    case 3: weighted_rows<NR, 3>(p, stride, w, ldw, count, acc); break;
    case 2: weighted_rows<NR, 2>(p, stride, w, ldw, count, acc); break;
    default: weighted_rows<NR, 1>(p, stride, w, ldw, count, acc);
  }
}

// weighted_rows with NR and NV known at run time (1-4 each).
inline void weighted_rows_any(const float* p, long stride, const float* w, long ldw, long count, int nr, int nv,
                              v16 (*acc)[4]) {
  switch (nr) {
    case 4: weighted_rows_nv<4>(p, stride, w, ldw, count, nv, acc); break;
    case 3: weighted_rows_nv<3>(p, stride, w, ldw, count, nv, acc); break;
    case 2: weighted_rows_nv<2>(p, stride, w, ldw, count, nv, acc); break;
    default: weighted_rows_nv<1>(p, stride, w, ldw, count, nv, acc);
  }
}

// NT tiles of L scores each for NR query rows: a[r][c] = sum_d x[r][d] * t[c * D + d] (t: NT consecutive tiles of
// L keys transposed to [D][L]). NR * NT independent sums: with NT = 2 and 4 rows, 8 FMA chains hide the FMA
// latency that 4 chains leave exposed (each chain waits on its previous FMA).
template <int NR, int NT>
inline void score_tiles(const v16* t, long D, const float* const* x, v16 (*a)[2]) {
  v16 acc[NR][NT] = {};
  for (long d = 0; d < D; ++d) {
    v16 kd[NT];
    for (int c = 0; c < NT; ++c) kd[c] = t[c * D + d];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NT; ++c) acc[r][c] += x[r][d] * kd[c];
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NT; ++c) a[r][c] = acc[r][c];
}

// r[i][j] -> r[j][i] for a 16 x 16 block: four rounds of interleaving rows i and i + 8 (lanes 0-7, then 8-15),
// a perfect shuffle of the row index each round, so after log2(16) rounds row j holds column j: the keys' tiles
// of the attention, 64 shuffles a block instead of 256 scalar stores (AVX-512: vpermt2ps).
inline v16 interleave(v16 a, v16 b, int half) {
#if defined(__clang__)
  return half ? __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)
              : __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
#else
  const v16i lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  return __builtin_shuffle(a, b, half ? lo + 8 : lo);
#endif
}

inline void transpose16(v16* r) {
  static_assert(L == 16, "transpose16 is a 16 x 16 transpose");
  for (int round = 0; round < 4; ++round) {
    v16 t[L];
    for (int i = 0; i < L / 2; ++i) {
      t[2 * i] = interleave(r[i], r[i + L / 2], 0);
      t[2 * i + 1] = interleave(r[i], r[i + L / 2], 1);
    }
    for (int i = 0; i < L; ++i) r[i] = t[i];
  }
}

// The sum of the lanes by halving (8 + 4 + 2 + 1 lanes added pairwise).
inline float hsum(v16 v) {
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) v[l] += v[l + w];
  return v[0];
}

inline float lane_max(v16 v) {
  float m = v[0];
  for (int l = 1; l < L; ++l) m = v[l] > m ? v[l] : m;
  return m;
}

}  // namespace
