// dflash_kernels_detail.h -- per-element logic shared by the host reference, the PyTorch CPU ops
// and the CUDA kernels, so that every backend computes exactly the same thing.
// Internal header (C++ only, torch-free); compiled by the host compiler and by nvcc.
#ifndef DFLASH_KERNELS_DETAIL_H_
#define DFLASH_KERNELS_DETAIL_H_

#include <stdint.h>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash {
namespace detail {

// NaN test that survives -ffast-math style flags (x != x).
DFLASH_HD bool is_nan(float x) { return x != x; }

// True if candidate (v2, i2) beats the incumbent (v1, i1) under torch.argmax ordering:
// NaN is greater than everything (first NaN wins), otherwise larger value, ties -> smaller index.
DFLASH_HD bool argmax_better(float v1, int64_t i1, float v2, int64_t i2) {
  const bool n1 = is_nan(v1), n2 = is_nan(v2);
  if (n1 || n2) {
    if (n1 && n2) return i2 < i1;
    return n2;
  }
  return v2 > v1 || (v2 == v1 && i2 < i1);
}

// Sequential argmax over x[0..V) (V >= 1) with torch.argmax semantics. `Load` converts to float.
template <typename T, typename Load>
inline int64_t argmax_row(const T* x, int64_t V, Load load) {
  float best = load(x[0]);
  int64_t best_i = 0;
  if (is_nan(best)) return 0;
  for (int64_t i = 1; i < V; ++i) {
    const float v = load(x[i]);
    if (is_nan(v)) return i;
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
}

// Number of accepted drafts given the per-position argmax (am[0..B)) and drafts (d[0..B-1)).
DFLASH_HD int64_t accepted_prefix(const int64_t* am, const int64_t* d, int64_t B) {
  int64_t a = 0;
  while (a < B - 1 && d[a] == am[a]) ++a;
  return a;
}

// Result of validating one request of commit_round.
enum CommitCheck { kCommitOk = 0, kBadAccepted = 1, kBadLength = 2, kBadMaxLength = 3 };

DFLASH_HD int commit_check(int64_t acc, int64_t len, int64_t max_len, int64_t B, int64_t C) {
  if (acc < 0 || acc > B - 1) return kBadAccepted;
  if (len < 0 || len > C) return kBadLength;
  if (max_len > C) return kBadMaxLength;
  return kCommitOk;
}

// commit_round for one request r (see dflash_kernels.h for the definition). The caller has
// checked done[r] == 0 and commit_check(...) == kCommitOk. Pointers are already offset to row r:
//   draft -> draft_tokens[r, :], stop -> stop_tokens[r, :] (or the shared row), out -> out_tokens[r, :].
DFLASH_HD void commit_one(const int64_t* draft, int64_t acc, int64_t bonus, const int64_t* stop,
                          int64_t num_stop, int64_t max_len, int64_t* out, int64_t* length,
                          int64_t* position, int64_t* anchor, uint8_t* done, int64_t* num_new) {
  const int64_t L = *length;
  int64_t room = max_len - L;
  if (room < 0) room = 0;
  int64_t n = 0;
  bool stopped = false;
  int64_t last = *anchor;
  for (int64_t j = 0; j <= acc && n < room; ++j) {
    const int64_t t = (j < acc) ? draft[j] : bonus;
    out[L + n] = t;
    ++n;
    last = t;
    bool is_stop = false;
    for (int64_t k = 0; k < num_stop; ++k) {
      const int64_t s = stop[k];
      if (s >= 0 && s == t) {
        is_stop = true;
        break;
      }
    }
    if (is_stop) {
      stopped = true;
      break;
    }
  }
  *length = L + n;
  *position += n;
  *anchor = last;
  *num_new = n;
  *done = (stopped || L + n >= max_len) ? 1 : 0;
}

}  // namespace detail
}  // namespace dflash

#endif  // DFLASH_KERNELS_DETAIL_H_
