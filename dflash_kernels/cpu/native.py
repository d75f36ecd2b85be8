"""Native fp32 CPU kernels behind the ``"cpu"`` backend of ``verify_attention``, ``draft_attention``,
``add_rms_norm``, ``silu_mul``, ``build_tree`` and ``tree_ancestor_mask``, and the on-first-use C++ build they
share with ``dflash_kernels.cpu.linear``.

Why: on a CPU the small ops of a decoder layer cost more in dispatch than in arithmetic. Measured on SmolLM2-135M
(2 threads, one lean target forward): the torch formulas of attention (q/k norm, RoPE, cache write, SDPA, per
request Python) took 11-16 ms and the 61 residual-add + RMSNorm calls 6.5-7 ms of a 55-65 ms forward at 1-8
rows, about as much as the projections' distance from their memory floor. Here each is one C call.

What they compute (the ops' definitions, in fp32; only the order of fp32 sums differs, so the ops' tests hold
them to the 2x error rule against fp64, not to the references' bits):

* :func:`add_rms_norm`: ``residual += x`` (in place), then ``weight * (s * rsqrt(mean(s^2) + eps))``.
* :func:`silu_mul`: ``silu(gate) * up`` of ``[gate | up]`` rows.
* :func:`block_attention`: per request n (cache row ``rows[n]``, ``C = lens[n]``, ``v = block_lens[n]`` or B)
  and block row i: q and k get their per-head RMSNorm (when the weights are given) and RoPE from the given
  tables (``cos``, and ``sin`` with its first half negated, so ``rotate_half(x) * sin == roll(x, D/2) *
  sin_signed``); the verify step writes the block's K and raw V rows to cache rows ``C + i`` (the draft step
  keeps them aside); query i attends to the context rows ``[0, C)`` and the block rows j < v that are j <= i
  (causal), set in its ancestor mask (a tree), or all (the draft's non-causal block), with scale ``scale``.
* :func:`build_tree`, :func:`tree_ancestor_mask`: the draft tree of each request and its ancestor bitmask, equal
  to ``dflash_kernels.tree``'s references bit for bit (integers; the log-probs from the same torch normalizer).
  Measured at 7 positions, 2,585 draft ids, trees of 27, 2 threads: 199 and 20 us a call through the ops, against
  684 and 223 us for the references (Python heap; torch ops); at the demo draft's 4,096 ids: 192 and 18 us.

How (attention): the block's K/V rows are written first; then, with 8 or more query rows per KV head (a verify
block), each request's keys of each KV head are transposed into tiles of 16 keys (16 x 16 blocks in registers: a
target forward 0.3-0.6 / 1-2.7 / 2.8-4.5 ms faster at 250 / 600 / 1,500 context rows than one scalar move a float,
8-16 rows, SmolLM2), so a tile of scores is 16-lane
FMAs over d with no per-key horizontal sum, four query rows and two key tiles a pass (eight independent FMA
chains: four left each FMA waiting on the previous one's latency; 0.88-0.95x the time at 16-24 rows, measured
below); with fewer (a one-token step) a score
is a dot product and a halving sum. Softmax in 16 lanes with a polynomial exp; the weighted sum of the V rows
takes the same four query rows together (each V row loaded once for the four, 16 accumulators), 64 output
columns a pass. Measured at SmolLM2's shapes (9 heads, 3 KV heads, D 64, 200 context rows, 2 threads, one run,
medians): 34, 72, 116, 158 and 208 us a call at 1, 8, 16, 24 and 32 rows, against 35, 82, 136, 189 and 253 us
with one query row per V pass (0.77x at 24 rows and 400 context rows); the torch formulas took 370-530 us a
layer inside a forward. Two key tiles a score pass instead of one (in-process A/B, bit-identical outputs): 68 ->
65, 108 -> 103 and 153 -> 134 us at 8, 16 and 24 rows (200 context rows), 129 -> 121 and 295 -> 267 us at 8 and
24 rows (400).

Threads: OpenMP (torch's libgomp) with ``torch.get_num_threads()`` threads over (request, KV head, key tile) and
then (request, head, 4 query rows); the norm and silu_mul split their rows once there are enough of them.

Build: :func:`build_library` compiles a C++ source once per source, flags, compiler and CPU (``-O3
-march=native -fopenmp``) into ``$DFLASH_CACHE/<name>/<hash>.so`` (default ``~/.cache/dflash``) and loads it
with ctypes; it refuses a cache folder other users can write and loads only a file whose sha256 matches the
sidecar it wrote with it (else it rebuilds). Without Linux x86-64 or a compiler, :func:`enabled` is False (:func:`unavailable_reason` says why,
one warning too) and the ops keep their torch formulas (bit-equal to the references). ``DFLASH_CPU_NATIVE=0``
turns these kernels off (A/B runs, tests of the torch formulas).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import threading
import warnings

import torch

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ENV = "DFLASH_CPU_NATIVE"
# A sanitizer for every native build (e.g. "address": csrc/tests/asan_cpu.sh runs the op tests on ASan builds;
# the process needs the sanitizer's runtime preloaded). Part of the flags, so of the cache key.
SANITIZE_ENV = "DFLASH_CPU_SANITIZE"


def cache_root() -> str:
    """The project's cache folder: ``$DFLASH_CACHE``, default ``~/.cache/dflash``."""
    return os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash")


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (Linux x86-64 only: raises RuntimeError elsewhere)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"needs Linux x86-64, this is {platform.system()} {platform.machine()}")
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((line for line in f if line.startswith("flags")), "")


def private_dir(path: str) -> str:
    """``path`` as a folder only the current user can write (created mode 0700 when missing). Raises RuntimeError
    naming ``DFLASH_CACHE`` when it is not: not a folder, owned by another user, or writable by group or others
    (anyone who can write there could plant a library that the next build would load)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    problem = ("is not a folder" if not stat.S_ISDIR(st.st_mode)
               else f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})" if st.st_uid != os.getuid()
               else f"is writable by {'group' if st.st_mode & stat.S_IWGRP else 'others'} (mode "
                    f"{stat.S_IMODE(st.st_mode):o})" if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
    if problem:
        raise RuntimeError(f"the native-library cache {path} (DFLASH_CACHE, default ~/.cache/dflash) {problem}: other "
                           f"users could plant code there. Point DFLASH_CACHE at a folder of your own, or run "
                           f"chmod go-w {path} if it is yours")
    return path


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()  # a library of a few hundred KB: one read


def _own_build(path: str, key: str) -> bool:
    """Whether ``path`` is the library this process's builder wrote for ``key``: the file and its sidecar
    ``<path>.sha256`` (the key and the file's sha256, written by :func:`build_library`) owned by this user and
    writable by no one else, and the file's digest the one recorded."""
    sidecar = f"{path}.sha256"
    try:
        for p in (path, sidecar):
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
        with open(sidecar, encoding="ascii") as f:
            recorded = f.read().split()
    except (OSError, UnicodeDecodeError):
        return False
    return recorded == [key, _digest(path)]


def library_path(name: str, source: str, flags) -> tuple[str, str, str]:
    """``(compiler, key, path)`` of :func:`build_library`'s library of ``source`` built with ``flags``: the key
    hashes the source, flags, compiler and CPU features. Raises RuntimeError without a compiler or off Linux
    x86-64."""
    features = cpu_flags()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++)")
    key = hashlib.sha256("\0".join((source, *flags, cxx, features)).encode()).hexdigest()[:16]
    return cxx, key, os.path.join(cache_root(), name, f"{key}.so")


def build_library(name: str, source: str, flags) -> ctypes.CDLL:
    """Compile ``source`` (C++) with ``flags`` once per source, flags, compiler and CPU into
    ``<cache_root>/<name>/<hash>.so`` and load it. The folders must be private to this user
    (:func:`private_dir`); a library is loaded only if this builder wrote it (:func:`_own_build`: its sha256
    matches the sidecar written with it), else it is rebuilt. ``$DFLASH_CPU_SANITIZE`` adds a sanitizer to the
    flags. Raises RuntimeError (no compiler, compile error,
    not Linux x86-64, a shared cache folder), OSError or SubprocessError."""
    sanitizer = os.environ.get(SANITIZE_ENV)
    if sanitizer:
        flags = (*flags, f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-g")
    cxx, key, path = library_path(name, source, flags)
    private_dir(cache_root())
    private_dir(os.path.dirname(path))
    if not _own_build(path, key):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # each concurrent builder writes its own
        done = subprocess.run([cxx, *flags, "-x", "c++", "-", "-o", tmp], input=source, text=True,
                              capture_output=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        with open(f"{tmp}.sha256", "w", encoding="ascii") as f:
            f.write(f"{key} {_digest(tmp)}\n")
        os.replace(f"{tmp}.sha256", f"{path}.sha256")  # atomic: the sidecar first, then the file it describes
        os.replace(tmp, path)
        if not _own_build(path, key):  # another builder replaced the sidecar in between: its file is as good
            raise RuntimeError(f"{path} changed while it was built; run again")
    return ctypes.CDLL(path)


_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <queue>
#include <vector>

#include <omp.h>

namespace {

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
  float t[512];
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

// out[r] = w * (s * rstd(s)) with s = x[r] (+ res[r], written back to res); x rows at stride ldx, res and out
// contiguous [rows, H].
extern "C" void dflash_cpu_add_rms_norm_f32(const float* x, long ldx, float* res, const float* w, float* out,
                                            long rows, long H, float eps, int threads) {
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

// out[r] = silu(gate) * up of rows [gate (I) | up (I)] at stride ldx; out contiguous [rows, I]. silu(g) =
// g * sigmoid(g) from e = exp(-|g|) (the polynomial's range): 1 / (1 + e) for g >= 0, e / (1 + e) below.
extern "C" void dflash_cpu_silu_mul_f32(const float* x, long ldx, float* out, long rows, long I, int threads) {
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

// A draft layer's context rows into its cache (inject_context_kv's "cpu" body). Row m of request n (cu[n] <= m <
// cu[n + 1], cu non-decreasing from cu[0] = 0) goes to cache row rows[n] (null: n) at position lens[n] + m - cu[n],
// dropped at or past cap: K = RoPE(RMSNorm(k) * kw) with the tables' row m, V copied. k / v [M, kvH, D]: rows at
// strides sk / sv, heads contiguous; cos / sin_signed [cu[N], D]; caches [R, cap, kvH, D] contiguous.
extern "C" void dflash_cpu_inject_kv_f32(const float* k, long sk, const float* v, long sv, const float* kw, float eps,
                                         const int64_t* cu, const int64_t* lens, const int64_t* rows, long N,
                                         const float* cos_t, const float* sin_t, float* kc, float* vc, long cap,
                                         long kvH, long D, int threads) {
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

// The block attention of the draft and verify steps (see the module docstring). q [N, B, nH, D], k / v
// [N, B, kvH, D]: rows at strides (sq_n, sq_b) etc., heads contiguous; caches [R, cap, kvH, D] contiguous; lens /
// rows / block_lens [N] (rows null: n; block_lens null: B); cos / sin_signed [N * B, D]; tree_mask null or
// [N, B, words] ancestor bits; out [N, B, nH, D] contiguous. write_kv: the block's K/V rows go to cache rows
// lens[n] + i (the verify step), else to a scratch copy (the draft step: its cache holds the context only).
// Block key j of request n is seen by query row i iff j < block_lens[n] and (tree: bit j of row i's mask;
// causal: j <= i; else always). The caller guarantees lens[n] (+ B with write_kv) <= cap, D <= 512, D % 16 == 0,
// 0 <= block_lens[n] <= B. NaN follows the definition's SDPA: a NaN (or +inf) score of query row i against any
// key j < lens[n] + block_lens[n], seen or masked, makes that row's output NaN; a NaN in a V row reaches every
// output its zero or non-zero weight multiplies. Returns 0, or 1 (nothing computed) when its scratch memory cannot
// be allocated.
extern "C" int dflash_cpu_block_attention_f32(
    const float* q, long sq_n, long sq_b, const float* k, long sk_n, long sk_b, const float* v, long sv_n,
    long sv_b, float* kc, float* vc, long cap, const int64_t* lens, const int64_t* rows, const int64_t* block_lens,
    const float* qw, const float* kw, float eps, const float* cos_t, const float* sin_t, const int64_t* tree_mask,
    long words, int causal, int write_kv, float* out, long N, long B, long nH, long kvH, long D, float scale,
    int threads) {
  const long group = nH / kvH, row_stride = kvH * D;
  const long kmax = max_len(lens, N) + B, tiles = (kmax + L - 1) / L, kpad = tiles * L;
  std::unique_ptr<float[]> scratch(new (std::nothrow) float[write_kv ? 1 : 2 * N * B * kvH * D]);
  // Each thread's query rows after norm + RoPE (B x D) and score rows (B x kpad).
  const long per_thread = B * D + B * kpad;
  std::unique_ptr<float[]> work(new (std::nothrow) float[threads * per_thread]);
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
  std::unique_ptr<v16[]> kt(new (std::nothrow) v16[transpose ? N * kvH * tiles * D : 1]);  // over-aligned
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
// ---- draft trees (dflash_kernels.tree's "cpu" bodies; definitions: build_tree_reference,
// tree_ancestor_mask_reference, whose results these reproduce bit for bit).

namespace {
struct Candidate {  // a heap entry, ordered as the reference's tuples (-score, depth, parent, rank)
  double key;
  long depth, parent, rank;
  bool operator>(const Candidate& o) const {
    if (key != o.key) return key > o.key;
    if (depth != o.depth) return depth > o.depth;
    if (parent != o.parent) return parent > o.parent;
    return rank > o.rank;
  }
};
}  // namespace

// z [R, P, V] fp32 (strides ldr, ldp; last dim contiguous), lse [R, P] (the log normalizer), K = min(T - 1, V)
// -> tokens / parents / depths [R, T] int64. Per row the K largest logits, by value desc then index asc, as
// log p = fp32(z - lse); then the best-first enumeration. Returns 1 (nothing usable written) when a logit is
// NaN or +inf (the reference's order then follows torch.topk's NaN rule), 2 when its work memory cannot be
// allocated, else 0.
static int build_tree(const float* z, long ldr, long ldp, long R, long P, long V, const float* lse, long K, long T,
                      const int64_t* anchor, const int64_t* vocab_ids, int64_t* tokens, int64_t* parents,
                      int64_t* depths) {
  std::vector<float> lp(P * K);
  std::vector<long> idx(P * K);
  std::vector<float> score(T);
  for (long r = 0; r < R; ++r) {
    for (long p = 0; p < P; ++p) {
      const float* row = z + r * ldr + p * ldp;
      float* vals = &lp[p * K];
      long* ids = &idx[p * K];
      long count = 0;
      for (long j = 0; j < V; ++j) {  // ascending j: an equal value goes after those already kept
        const float v = row[j];
        if (std::isnan(v) || v == INFINITY) return 1;
        if (count == K && !(v > vals[K - 1])) continue;
        long pos = count < K ? count : K - 1;
        while (pos > 0 && vals[pos - 1] < v) {
          vals[pos] = vals[pos - 1];
          ids[pos] = ids[pos - 1];
          --pos;
        }
        vals[pos] = v;
        ids[pos] = j;
        if (count < K) ++count;
      }
      const float norm = lse[r * P + p];
      for (long k = 0; k < K; ++k) vals[k] = vals[k] - norm;
    }
    int64_t* tok = tokens + r * T;
    int64_t* par = parents + r * T;
    int64_t* dep = depths + r * T;
    tok[0] = anchor[r];
    par[0] = -1;
    dep[0] = 0;
    score[0] = 0.f;
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    heap.push({-(double)(0.f + lp[0]), 1, 0, 0});
    for (long i = 1; i < T; ++i) {
      const Candidate c = heap.top();
      heap.pop();
      score[i] = (float)(-c.key);
      const long j = idx[(c.depth - 1) * K + c.rank];
      tok[i] = vocab_ids ? vocab_ids[j] : j;
      par[i] = c.parent;
      dep[i] = c.depth;
      if (c.rank + 1 < K)
        heap.push({-(double)(score[c.parent] + lp[(c.depth - 1) * K + c.rank + 1]), c.depth, c.parent, c.rank + 1});
      if (c.depth < P) heap.push({-(double)(score[i] + lp[c.depth * K]), c.depth + 1, i, 0});
    }
  }
  return 0;
}

extern "C" int dflash_cpu_build_tree(const float* z, long ldr, long ldp, long R, long P, long V, const float* lse,
                                     long K, long T, const int64_t* anchor, const int64_t* vocab_ids,
                                     int64_t* tokens, int64_t* parents, int64_t* depths) {
  try {
    return build_tree(z, ldr, ldp, R, P, V, lse, K, T, anchor, vocab_ids, tokens, parents, depths);
  } catch (const std::bad_alloc&) {  // an exception must not cross the C boundary (it would abort the process)
    return 2;
  }
}

// parents [R, T] (row stride ldr) -> mask [R, T, W]: node i's words are its parent's plus bit i. Returns the
// first request * T + node whose parent is not an earlier node (-1 for node 0), or -1 when all are valid.
extern "C" long dflash_cpu_tree_ancestor_mask(const int64_t* parents, long ldr, long R, long T, long W,
                                              int64_t* mask) {
  for (long r = 0; r < R; ++r) {
    const int64_t* par = parents + r * ldr;
    uint64_t* m = (uint64_t*)(mask + r * T * W);
    for (long i = 0; i < T; ++i) {
      const int64_t p = par[i];
      if (i == 0 ? p != -1 : (p < 0 || p >= i)) return r * T + i;
      for (long w = 0; w < W; ++w) m[i * W + w] = i == 0 ? 0 : m[p * W + w];
      m[i * W + i / 64] |= (uint64_t)1 << (i % 64);
    }
  }
  return -1;
}

// tree_accept_greedy_tokens' walk: per request, from the root, the first child (in node order) whose token is the
// target's token at the current node, while one exists and the depth is below B - 1; the target's token where it
// stops is the bonus. target / tokens / parents [R, T] at row strides; path [R, B] (-1 past the accepted depth),
// accepted / bonus [R]. Reads only rows' own T entries, whatever the parents' values.
extern "C" void dflash_cpu_tree_walk_tokens(const int64_t* target, long ldt, const int64_t* tokens, long ldk,
                                            const int64_t* parents, long ldp, long R, long T, long B, int64_t* path,
                                            int64_t* accepted, int64_t* bonus) {
  for (long r = 0; r < R; ++r) {
    const int64_t *tg = target + r * ldt, *tk = tokens + r * ldk, *pr = parents + r * ldp;
    int64_t* p = path + r * B;
    for (long d = 0; d < B; ++d) p[d] = -1;
    long cur = 0, d = 0;
    p[0] = 0;
    for (;;) {
      const int64_t x = tg[cur];
      long kid = -1;
      for (long i = 0; d + 1 < B && i < T; ++i)
        if (pr[i] == cur && tk[i] == x) {
          kid = i;
          break;
        }
      if (kid < 0) {
        bonus[r] = x;
        break;
      }
      cur = kid;
      p[++d] = cur;
    }
    accepted[r] = d;
  }
}

// tree_compact's moves: for request r and d <= accepted[r], row start[r] + path[r, d] of batch row rows[r] (null:
// r) to row start[r] + d in every layer of both caches [L, Nb, cap, row_bytes] (contiguous); sources at or past cap
// and rows that stay are skipped. The caller guarantees d <= path[r, d] < path[r, d + 1] (a walk's path), so in
// depth order no move overwrites a later one's source.
extern "C" void dflash_cpu_tree_compact(char* kc, char* vc, const int64_t* path, long ldp, const int64_t* accepted,
                                        const int64_t* start, const int64_t* rows, long R, long L, long Nb, long cap,
                                        long row_bytes) {
  for (long l = 0; l < L; ++l)
    for (long r = 0; r < R; ++r) {
      const long b = rows ? rows[r] : r, base = ((l * Nb + b) * cap + start[r]) * row_bytes;
      for (long d = 1; d <= accepted[r]; ++d) {
        const long src = path[r * ldp + d];
        if (src == d || start[r] + src >= cap) continue;
        memcpy(kc + base + d * row_bytes, kc + base + src * row_bytes, row_bytes);
        memcpy(vc + base + d * row_bytes, vc + base + src * row_bytes, row_bytes);
      }
    }
}
"""

MAX_HEAD_DIM = 512  # the kernels' per-head stack buffers (and D % 16 == 0: whole vectors)

_lock = threading.Lock()
_lib = None
_reason: str | None = None
_tried = False


def _load():
    global _lib, _reason, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                lib = build_library("cpu_native", _SOURCE, FLAGS)
                p, n, f, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
                lib.dflash_cpu_add_rms_norm_f32.restype = None
                lib.dflash_cpu_add_rms_norm_f32.argtypes = [p, n, p, p, p, n, n, f, i]
                lib.dflash_cpu_silu_mul_f32.restype = None
                lib.dflash_cpu_silu_mul_f32.argtypes = [p, n, p, n, n, i]
                lib.dflash_cpu_block_attention_f32.restype = i
                lib.dflash_cpu_block_attention_f32.argtypes = [
                    p, n, n, p, n, n, p, n, n, p, p, n, p, p, p, p, p, f, p, p, p, n, i, i, p, n, n, n, n, n, f, i]
                lib.dflash_cpu_inject_kv_f32.restype = None
                lib.dflash_cpu_inject_kv_f32.argtypes = [p, n, p, n, p, f, p, p, p, n, p, p, p, p, n, n, n, i]
                lib.dflash_cpu_build_tree.restype = i
                lib.dflash_cpu_build_tree.argtypes = [p, n, n, n, n, n, p, n, n, p, p, p, p, p]
                lib.dflash_cpu_tree_walk_tokens.restype = None
                lib.dflash_cpu_tree_walk_tokens.argtypes = [p, n, p, n, p, n, n, n, n, p, p, p]
                lib.dflash_cpu_tree_compact.restype = None
                lib.dflash_cpu_tree_compact.argtypes = [p, p, p, n, p, p, p, n, n, n, n, n]
                lib.dflash_cpu_tree_ancestor_mask.restype = n
                lib.dflash_cpu_tree_ancestor_mask.argtypes = [p, n, n, n, n, p]
                _lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _reason = f"dflash_kernels.cpu.native: unavailable ({e}); the \"cpu\" backend uses torch formulas"
                warnings.warn(_reason, RuntimeWarning, stacklevel=3)
            _tried = True
    return _lib


def enabled() -> bool:
    """Whether the native kernels run (built and loaded, and not turned off by ``DFLASH_CPU_NATIVE=0``)."""
    return os.environ.get(ENV, "1") != "0" and (_lib is not None or _load() is not None)


def library() -> ctypes.CDLL | None:
    """The loaded kernels' library when they run (:func:`enabled`), else None: for a caller that has checked its
    arguments once and calls the entry points directly (``dflash_kernels.cpu.forward``); their contracts are the
    comments above each ``extern "C"`` function of the source."""
    return _lib if enabled() else None


def unavailable_reason() -> str | None:
    """None when the kernels are built and loaded (building them now if needed), else why not."""
    _load()
    return _reason


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _raise_on_failure(status: int, kernel: str, size: str) -> None:
    """A kernel's non-zero status (its scratch memory could not be allocated) as a MemoryError naming the size."""
    if status:
        raise MemoryError(f"cpu_native.{kernel}: not enough memory for the kernel's scratch ({size}); use fewer or "
                          "shorter requests")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 out: torch.Tensor) -> bool:
    """``add_rms_norm``'s "cpu" body for fp32 tensors (x rows viewable as ``[rows, H]`` with a row stride,
    weight, residual and out contiguous); False (nothing done) where it does not apply."""
    f32 = torch.float32
    h = x.shape[-1]
    # Shapes too, even after the op's validation (validate=False skips it): a wrong one must not become a read or
    # write past a buffer; the torch formula then raises.
    if not (x.dtype == weight.dtype == out.dtype == f32 and weight.is_contiguous() and out.is_contiguous()
            and x.stride(-1) == 1 and h > 0 and weight.numel() == h and out.shape == x.shape
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape)) and enabled()):
        return False
    x2 = x.reshape(-1, h)  # a view where the layout allows (validated: last dim contiguous)
    if x2.stride(1) != 1:
        return False
    _lib.dflash_cpu_add_rms_norm_f32(x2.data_ptr(), x2.stride(0), _ptr(residual), weight.data_ptr(),
                                     out.data_ptr(), x2.shape[0], h, eps, torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> bool:
    """``silu_mul``'s "cpu" body for fp32 rows viewable as ``[rows, 2I]`` with a row stride into a contiguous
    ``out``; False (nothing done) where it does not apply."""
    i2 = gate_up.shape[-1]
    if not (gate_up.dtype == out.dtype == torch.float32 and gate_up.stride(-1) == 1 and i2 > 0 and i2 % 2 == 0
            and out.is_contiguous() and out.shape == (*gate_up.shape[:-1], i2 // 2) and enabled()):
        return False
    x2 = gate_up.reshape(-1, i2)
    if x2.stride(1) != 1:
        return False
    _lib.dflash_cpu_silu_mul_f32(x2.data_ptr(), x2.stride(0), out.data_ptr(), x2.shape[0], i2 // 2,
                                 torch.get_num_threads())
    return True


def _host_index_tensor(values) -> torch.Tensor | None:
    """A new contiguous int64 tensor of host ``values`` (None: None): what a kernel reads, built from the very
    values its caller checked, so no other thread's write to the caller's tensor between the check and the call
    reaches the C code, and an int32 input is read at its values, not as half of an int64."""
    return None if values is None else torch.tensor(values, dtype=torch.int64)


def block_attention(q, k, v, k_cache, v_cache, lens: list[int], rows: list[int] | None, q_norm_weight,
                    k_norm_weight, eps, scale, cos, sin_signed, *, causal: bool, write_kv: bool,
                    block_lens: list[int] | None = None, tree_mask=None) -> torch.Tensor | None:
    """The "cpu" body of ``verify_attention`` (``write_kv``, causal or a tree) and ``draft_attention`` (no write,
    ``block_lens``) for fp32 tensors on a contiguous cache (with room for the block where it is written).
    ``lens``, ``rows`` (None: 0..N-1) and ``block_lens`` (None: all B rows) are host values: the kernel reads
    int64 copies of exactly these. None (nothing done) where it does not apply, including cache rows outside the
    cache (the torch formulas then raise the IndexError). Raises MemoryError when the kernel's scratch cannot be
    allocated."""
    f32 = torch.float32
    n, b, nh, d = q.shape
    kvh = k.shape[2]
    cap = k_cache.shape[1]
    norms = [t for t in (q_norm_weight, k_norm_weight) if t is not None]
    # Every extent and index the kernel uses, checked here whatever the op validated: a mismatch falls back to
    # the torch formula (which raises) instead of reaching memory past a buffer.
    shapes_ok = (k.shape == v.shape == (n, b, kvh, d) and nh % kvh == 0 and k_cache.dim() == 4
                 and k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
                 and len(lens) == n and all(t.numel() == d for t in norms)
                 and cos.shape == sin_signed.shape == (n * b, d)
                 and (rows is None or len(rows) == n) and (block_lens is None or len(block_lens) == n)
                 and (tree_mask is None or (tree_mask.shape[:2] == (n, b) and tree_mask.shape[2] * 64 >= b)))
    if not (shapes_ok and q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == f32 and d <= MAX_HEAD_DIM
            and all(t.dtype == f32 and t.is_contiguous() for t in norms) and k_cache.is_contiguous()
            and v_cache.is_contiguous() and all(t.stride(3) == 1 and t.stride(2) == d for t in (q, k, v))
            and d % 16 == 0 and n > 0 and max(lens) + (b if write_kv else 0) <= cap and min(lens) >= 0
            and (rows is None or all(0 <= r < k_cache.shape[0] for r in rows))
            and (rows is not None or n <= k_cache.shape[0])
            and (block_lens is None or all(0 <= x <= b for x in block_lens)) and enabled()):
        return None
    words = 0
    if tree_mask is not None:
        tree_mask = tree_mask.contiguous()
        words = tree_mask.shape[-1]
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    lens_t, rows_t, block_lens_t = (_host_index_tensor(x) for x in (lens, rows, block_lens))
    out = q.new_empty((n, b, nh, d))
    status = _lib.dflash_cpu_block_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cap, lens_t.data_ptr(), _ptr(rows_t),
        _ptr(block_lens_t), _ptr(q_norm_weight), _ptr(k_norm_weight), eps, cos.data_ptr(), sin_signed.data_ptr(),
        _ptr(tree_mask), words, int(causal), int(write_kv), out.data_ptr(), n, b, nh, kvh, d, scale,
        torch.get_num_threads())
    _raise_on_failure(status, "block_attention", f"{n} requests x {b} block rows over {max(lens)} context rows")
    return out


def inject_context_kv(k: torch.Tensor, v: torch.Tensor, k_norm_weight: torch.Tensor, eps: float, cu: list[int],
                      lens: list[int], rows: list[int] | None, cos: torch.Tensor, sin_signed: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """``inject_context_kv``'s "cpu" body for fp32 tensors on a contiguous cache (host values: ``cu`` the row
    offsets, ``lens`` the cache lengths, ``rows`` ``cache_batch_idx`` or None; ``cos`` / ``sin_signed``
    [cu[-1], D]: each row's tables); False (nothing done) where it does not apply, including offsets that are not
    a partition of k's first rows and cache rows outside the cache (the reference then decides)."""
    f32 = torch.float32
    m, kvh, d = k.shape
    n = len(cu) - 1
    # Every extent and index the kernel uses, checked here: a mismatch falls back to the reference.
    if not (enabled() and k.dtype == v.dtype == k_norm_weight.dtype == k_cache.dtype == v_cache.dtype == f32
            and v.shape == k.shape and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == d
            and k_cache.dim() == 4 and k_cache.shape[2:] == (kvh, d) and v_cache.shape == k_cache.shape
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_norm_weight.is_contiguous()
            and k_norm_weight.numel() == d and 0 < d <= MAX_HEAD_DIM and n > 0 and cu[0] == 0 and cu[-1] <= m
            and all(a <= b for a, b in zip(cu, cu[1:])) and len(lens) == n and min(lens) >= 0
            and cos.shape == sin_signed.shape == (cu[-1], d)
            and (len(rows) == n and all(0 <= r < k_cache.shape[0] for r in rows) if rows is not None
                 else n <= k_cache.shape[0])):
        return False
    offsets, lens_t, rows_t = (_host_index_tensor(x) for x in (cu, lens, rows))
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    _lib.dflash_cpu_inject_kv_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_norm_weight.data_ptr(), eps,
                                  offsets.data_ptr(), lens_t.data_ptr(), _ptr(rows_t), n, cos.data_ptr(),
                                  sin_signed.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], kvh,
                                  d, torch.get_num_threads())
    return True


def build_tree(draft_logits: torch.Tensor, lse: torch.Tensor, anchor: torch.Tensor, budget: int,
               vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``build_tree``'s "cpu" body (validated CPU inputs; ``lse``: ``draft_log_normalizer``'s [R, P] fp32): the
    reference's trees bit for bit, or None (nothing done) where it does not apply: no native library, non-fp32
    logits, or a NaN / +inf logit (the reference then decides by torch.topk's NaN rule)."""
    r, p, v = draft_logits.shape
    i64 = torch.int64
    # Every extent the kernel indexes with, whatever the op validated (its unchecked path).
    if not (enabled() and draft_logits.dtype == torch.float32 and draft_logits.stride(2) == 1 and budget >= 1
            and v >= 1 and p >= 1 and anchor.dtype == i64 and anchor.shape == (r,) and lse.shape == (r, p)
            and (vocab_ids is None or (vocab_ids.dtype == i64 and vocab_ids.shape == (v,)))):
        return None
    t = budget + 1
    out = tuple(torch.empty((r, t), dtype=torch.int64) for _ in range(3))
    lse = lse.contiguous()
    anchor = anchor.contiguous()
    ids = None if vocab_ids is None else vocab_ids.contiguous()
    status = _lib.dflash_cpu_build_tree(draft_logits.data_ptr(), draft_logits.stride(0), draft_logits.stride(1), r,
                                        p, v, lse.data_ptr(), min(budget, v), t, anchor.data_ptr(), _ptr(ids),
                                        *(o.data_ptr() for o in out))
    if status == 2:
        _raise_on_failure(status, "build_tree", f"{r} trees of {t} nodes over {p} depths")
    return None if status else out


def tree_ancestor_mask(tree_parents: torch.Tensor, words: int) -> torch.Tensor | None:
    """``tree_ancestor_mask``'s "cpu" body for validated CPU parents; None without the native library. A node
    whose parent is not an earlier node (or a root whose parent is not -1) raises ValueError naming it."""
    if not (enabled() and tree_parents.dtype == torch.int64):
        return None
    r, t = tree_parents.shape
    par = tree_parents if tree_parents.stride(1) == 1 else tree_parents.contiguous()
    mask = torch.empty((r, t, words), dtype=torch.int64)
    bad = _lib.dflash_cpu_tree_ancestor_mask(par.data_ptr(), par.stride(0), r, t, words, mask.data_ptr())
    if bad >= 0:
        raise ValueError(bad_parent_message("tree_ancestor_mask", par, *divmod(bad, t)))
    return mask


def bad_parent_message(op: str, tree_parents: torch.Tensor, req: int, node: int) -> str:
    """The error of a tree whose node ``node`` of request ``req`` has no valid parent."""
    return (f"{op}: tree_parents[{req}, {node}] = {int(tree_parents[req, node])} is not a valid parent: node 0 (the "
            "root) needs -1, node i > 0 an earlier node (0 <= parent < i), as build_tree returns them")


def tree_walk_tokens(target_tokens: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``tree_accept_greedy_tokens``' "cpu" body (validated CPU inputs: [R, T] rows, the last dim contiguous): the
    reference's walk, ``(path, accepted, bonus)``; None without the native library."""
    i64 = torch.int64
    if not (enabled() and block_size >= 1 and tree_tokens.dtype == tree_parents.dtype == i64
            and target_tokens.shape == tree_tokens.shape == tree_parents.shape
            and tree_tokens.stride(1) == tree_parents.stride(1) == 1):
        return None
    r, t = tree_tokens.shape
    target = target_tokens.to(torch.int64)
    if target.stride(-1) != 1:
        target = target.contiguous()
    path = torch.empty((r, block_size), dtype=torch.int64)
    accepted, bonus = torch.empty(r, dtype=torch.int64), torch.empty(r, dtype=torch.int64)
    _lib.dflash_cpu_tree_walk_tokens(target.data_ptr(), target.stride(0), tree_tokens.data_ptr(), tree_tokens.stride(0),
                                     tree_parents.data_ptr(), tree_parents.stride(0), r, t, block_size,
                                     path.data_ptr(), accepted.data_ptr(), bonus.data_ptr())
    return path, accepted, bonus


def compact_index_error(paths: list[list[int]], accepted: list[int], start: list[int], rows: list[int],
                        batch_rows: int) -> str | None:
    """Why ``tree_compact``'s host values would address rows outside the caches, or None: ``accepted[r]`` must be
    a depth of the path, the moved sources ``path[r, :accepted[r] + 1]`` and ``start[r]`` non-negative (a
    negative host index would take a row from the end), batch rows inside the cache. Sources at or past the
    capacity are allowed: the moves skip them."""
    for r, (a, s, b, p) in enumerate(zip(accepted, start, rows, paths)):
        if not 0 <= a < len(p):
            return f"accepted[{r}] = {a} is not a depth of path (0 <= accepted < B = {len(p)})"
        if min(p[:a + 1]) < 0:
            return f"path[{r}, :{a + 1}] = {p[:a + 1]} holds a negative node (the walk's path, -1 only past accepted)"
        if s < 0:
            return f"start[{r}] = {s} must be >= 0 (the cache length before the verify step)"
        if not 0 <= b < batch_rows:
            return f"cache_batch_idx[{r}] = {b} is outside the cache's {batch_rows} batch rows"
    return None


def tree_compact(k_cache: torch.Tensor, v_cache: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
                 start: torch.Tensor, cache_batch_idx: torch.Tensor | None) -> bool:
    """``tree_compact``'s "cpu" body: the moves by ``memcpy``; False (nothing done) where it does not apply: no
    native library, non-contiguous caches, indices outside the caches (:func:`compact_index_error`), or a path
    that is not a walk's (node 0, then d <= path[d] < path[d + 1]: only then does no move in depth order overwrite
    a later one's source); the reference then decides. The kernel reads int64 copies of the values checked here."""
    if not (enabled() and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.dim() == 5):
        return False
    layers, nb, cap = k_cache.shape[:3]
    paths, acc, st = path.tolist(), accepted.tolist(), start.tolist()
    if not acc:
        return True
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(len(acc)))
    if not (len(paths) == len(acc) == len(st) == len(rows)) or compact_index_error(paths, acc, st, rows, nb):
        return False
    for a, p in zip(acc, paths):
        walk = p[:a + 1]
        if walk[0] != 0 or any(not (d <= x < y) for d, (x, y) in enumerate(zip(walk, walk[1:]))):
            return False
    path_t, acc_t, st_t, rows_t = (_host_index_tensor(x) for x in (paths, acc, st, rows))
    _lib.dflash_cpu_tree_compact(k_cache.data_ptr(), v_cache.data_ptr(), path_t.data_ptr(), path_t.shape[1],
                                 acc_t.data_ptr(), st_t.data_ptr(), rows_t.data_ptr(), len(acc), layers, nb, cap,
                                 k_cache.shape[3:].numel() * k_cache.element_size())
    return True
