// The block attention of the draft and verify steps and the draft's context K/V injection (the "cpu" bodies of
// verify_attention, draft_attention and inject_context_kv), for the instruction set of the translation unit that
// includes this (isa_avx512.cpp, isa_avx2.cpp); internal linkage.
#pragma once

#include <omp.h>

#include "dflash_cpu.h"
#include "simd16.h"

namespace {

// InjectKvArgs (dflash_cpu.h).
void inject_kv(const dflash_cpu::InjectKvArgs& a) {
  const float *k = a.k, *v = a.v, *kw = a.k_norm, *cos_t = a.cos, *sin_t = a.sin_signed;
  const int64_t *cu = a.cu, *lens = a.lens, *rows = a.rows;
  float *kc = a.k_cache, *vc = a.v_cache;
  const long sk = a.sk, sv = a.sv, N = a.N, cap = a.cap, kvH = a.kvH, D = a.D;
  const float eps = a.eps;
  const int threads = a.threads;
  const long M = cu[N], row_stride = kvH * D;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * row_stride >= 32768)
  for (long u = 0; u < M * kvH; ++u) {
    const long m = u / kvH, g = u % kvH;
    long n = 0;
    while (cu[n + 1] <= m) ++n;  // m < cu[N]: stops at its request (empty requests skipped)
    const long t = lens[n] + m - cu[n];
    if (t >= cap) continue;
    const long at = ((rows ? rows[n] : n) * cap + t) * row_stride + g * D;
    norm_rope(k + m * sk + g * D, kw, eps, cos_t + m * D, sin_t + m * D, D, kc + at);
    const float* vs = v + m * sv + g * D;
    for (long d = 0; d < D; ++d) vc[at + d] = vs[d];
  }
}

// BlockAttentionArgs (dflash_cpu.h); the method: dflash_kernels.cpu.native's docstring. Returns 0, or 1 (nothing
// computed) when its scratch memory cannot be allocated.
int block_attention(const dflash_cpu::BlockAttentionArgs& a) {
  const float *q = a.q, *k = a.k, *v = a.v, *qw = a.q_norm, *kw = a.k_norm, *cos_t = a.cos, *sin_t = a.sin_signed;
  const long sq_n = a.sq_n, sq_b = a.sq_b, sk_n = a.sk_n, sk_b = a.sk_b, sv_n = a.sv_n, sv_b = a.sv_b;
  float *kc = a.k_cache, *vc = a.v_cache, *out = a.out;
  const int64_t *lens = a.lens, *rows = a.rows, *block_lens = a.block_lens, *tree_mask = a.tree_mask;
  const long cap = a.cap, words = a.words, N = a.N, B = a.B, nH = a.nH, kvH = a.kvH, D = a.D;
  const bool causal = a.causal, write_kv = a.write_kv;
  const float eps = a.eps, scale = a.scale;
  const int threads = a.threads;
  const long group = nH / kvH, row_stride = kvH * D;
  const long kmax = max_len(lens, N) + B, tiles = (kmax + L - 1) / L, kpad = tiles * L;
  Buffer<float> scratch(write_kv ? 1 : 2 * N * B * kvH * D);
  // Each thread's query rows after norm + RoPE (B x D) and score rows (B x kpad).
  const long per_thread = B * D + B * kpad;
  Buffer<float> work(threads * per_thread);
  if (!scratch || !work) return 1;
  float* bk = scratch.get();
  float* bv = bk + N * B * kvH * D;
  auto cache_row = [&](long n) { return rows ? rows[n] : n; };  // request n's row of the caches
  // Row j of request n's keys (or values) of KV head g: the cache below lens[n], then the block rows.
  auto row_of = [&](const float* cache, const float* block, long n, long g, long j) -> const float* {
    if (write_kv || j < lens[n]) return cache + (cache_row(n) * cap + j) * row_stride + g * D;
    return block + ((n * B + j - lens[n]) * kvH + g) * D;
  };
  // Few query rows per KV head (a one-token step): a score is a dot product and a vector sum, cheaper than
  // transposing the keys, which pays for itself from about 8 rows per head (64 moves per key vs ~8 ops per sum).
  const bool transpose = B * group >= 8;
  Buffer<v16> kt(transpose ? N * kvH * tiles * D : 1);  // over-aligned
  if (!kt) return 1;
#pragma omp parallel num_threads(threads)
  {
    // Phase 1: the block's K (normed, rotated) and V rows into the cache (or the scratch copy).
#pragma omp for schedule(static)
    for (long u = 0; u < N * B * kvH; ++u) {
      long n = u / (B * kvH), i = (u / kvH) % B, g = u % kvH;
      float* kr = write_kv ? kc + (cache_row(n) * cap + lens[n] + i) * row_stride + g * D
                           : bk + ((n * B + i) * kvH + g) * D;
      float* vr = write_kv ? vc + (kr - kc) : bv + (kr - bk);
      const float* cs = cos_t + (n * B + i) * D;
      const float* sn = sin_t + (n * B + i) * D;
      norm_rope(k + n * sk_n + i * sk_b + g * D, kw, eps, cs, sn, D, kr);
      const float* vs = v + n * sv_n + i * sv_b + g * D;
      for (long d = 0; d < D; ++d) vr[d] = vs[d];
    }
    // Phase 2 (after the barrier): each request's keys of each KV head, transposed in tiles of L keys to [D][L]
    // (zero past the last key), so a score tile is L-lane FMAs over d with no per-key horizontal sum.
#pragma omp for schedule(static)
    for (long u = 0; u < (transpose ? N * kvH * tiles : 0); ++u) {
      long n = u / (kvH * tiles), g = (u / tiles) % kvH, j0 = (u % tiles) * L;
      long keys = lens[n] + B;
      const float* kr[L];
      for (long l = 0; l < L; ++l) kr[l] = j0 + l < keys ? row_of(kc, bk, n, g, j0 + l) : nullptr;
      for (long d0 = 0; d0 < D; d0 += L) {  // 16 x 16 blocks, transposed in registers
        v16 r[L];
        for (long l = 0; l < L; ++l) r[l] = kr[l] ? load(kr[l] + d0) : v16{};
        transpose16(r);
        for (long d = 0; d < L; ++d) kt[u * D + d0 + d] = r[d];
      }
    }
    // Phase 3: one (request, head, UR query rows) per unit (the unit's rows share each key tile and V row load;
    // smaller units than a whole head balance the threads: 9 heads on 2 threads would idle one for a ninth of the
    // time; 8-row units were no faster here).
    constexpr long UR = 4;
    float* const qr = work.get() + omp_get_thread_num() * per_thread;
    float* const s = qr + B * D;
    const long chunks = (B + UR - 1) / UR;
#pragma omp for schedule(static)
    for (long u = 0; u < N * nH * chunks; ++u) {
      long n = u / (nH * chunks), h = (u / chunks) % nH, g = h / group;
      long ib = (u % chunks) * UR, ie = ib + UR < B ? ib + UR : B;
      long ctx = lens[n], keys = ctx + B, ntile = (keys + L - 1) / L;
      const v16* kt_g = &kt[(n * kvH + g) * tiles * D];
      for (long i = ib; i < ie; ++i)
        norm_rope(q + n * sq_n + i * sq_b + h * D, qw, eps, cos_t + (n * B + i) * D, sin_t + (n * B + i) * D, D,
                  &qr[i * D]);
      for (long i = ib; i < (transpose ? ib : ie); ++i) {
        const float* x = &qr[i * D];
        float* si = &s[i * kpad];
        for (long j = 0; j < keys; ++j) {
          const float* kr = row_of(kc, bk, n, g, j);
          v16 a = {};
          for (long d = 0; d < D; d += L) a += load(x + d) * load(kr + d);
          si[j] = hsum(a) * scale;
        }
      }
      if (transpose) {
        const long ni = ie - ib;
        const float* x[UR];
        for (long r = 0; r < UR; ++r) x[r] = &qr[(ib + (r < ni ? r : 0)) * D];  // past ni: any row, not stored
        for (long jt = 0; jt < ntile; jt += 2) {
          const int nt = jt + 1 < ntile ? 2 : 1;
          v16 acc[UR][2];
          if (nt == 2)
            score_tiles<UR, 2>(kt_g + jt * D, D, x, acc);
          else
            score_tiles<UR, 1>(kt_g + jt * D, D, x, acc);
          for (long r = 0; r < ni; ++r)
            for (int c = 0; c < nt; ++c)
              for (long l = 0; l < L; ++l) s[(ib + r) * kpad + (jt + c) * L + l] = acc[r][c][l] * scale;
        }
      }
      float inv[UR];
      const long nb = block_lens ? block_lens[n] : B;
      for (long i = ib; i < ie; ++i) {
        float* si = &s[i * kpad];
        const int64_t* bits = tree_mask ? tree_mask + (n * B + i) * words : 0;
        bool poisoned = false;  // a NaN / +inf score: the definition's softmax row is NaN
        for (long j = 0; j < ctx + nb; ++j) poisoned |= !(si[j] < INFINITY);
        for (long bj = 0; bj < B; ++bj) {
          bool seen = bj < nb && (bits ? ((bits[bj >> 6] >> (bj & 63)) & 1) != 0 : !causal || bj <= i);
          if (!seen) si[ctx + bj] = -INFINITY;
        }
        for (long j = keys; j < ntile * L; ++j) si[j] = -INFINITY;  // the last tile's padding
        v16 mv = load(si);
        for (long jt = 1; jt < ntile; ++jt) {
          v16 x = load(si + jt * L);
          mv = x > mv ? x : mv;
        }
        float m = lane_max(mv);
        v16 sum = {};
        for (long jt = 0; jt < ntile; ++jt) {
          v16 e = exp_nonpositive(load(si + jt * L) - m);
          __builtin_memcpy(si + jt * L, &e, sizeof e);
          sum += e;
        }
        float l = hsum(sum);
        inv[i - ib] = poisoned ? NAN : l > 0.f ? 1.f / l : 0.f;
      }
      // The weighted sums of the V rows for the unit's query rows together (each V row loaded once for all of
      // them): the context rows in the cache, then the block's (in the cache after them, or aside), 64 output
      // columns at a time in registers.
      const int nr = (int)(ie - ib);
      const float* ctx_v = vc + cache_row(n) * cap * row_stride + g * D;
      const float* blk_v = write_kv ? ctx_v + ctx * row_stride : bv + (n * B * kvH + g) * D;
      const long blk_stride = write_kv ? row_stride : kvH * D;
      for (long d0 = 0; d0 < D; d0 += 4 * L) {
        const int nv = D - d0 >= 4 * L ? 4 : (int)((D - d0) / L);
        v16 acc[UR][4] = {};
        weighted_rows_any(ctx_v + d0, row_stride, &s[ib * kpad], kpad, ctx, nr, nv, acc);
        weighted_rows_any(blk_v + d0, blk_stride, &s[ib * kpad + ctx], kpad, nb, nr, nv, acc);
        for (int r = 0; r < nr; ++r) {
          float* o = out + ((n * B + ib + r) * nH + h) * D;
          for (int c = 0; c < nv; ++c)
            for (long l = 0; l < L; ++l) o[d0 + c * L + l] = acc[r][c][l] * inv[r];
        }
      }
    }
  }
  return 0;
}

}  // namespace
