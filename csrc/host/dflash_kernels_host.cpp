// Host (CPU) implementation of the torch-free C ABI in dflash_kernels.h: the reference that C++
// engines and the ctest executable use, with exactly the semantics of the CUDA launchers.
#include "dflash_kernels.h"

#include <stdint.h>
#include <string.h>

#include <vector>

#include "dflash_kernels_detail.h"

namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 -> binary32 (exact, handles subnormals, inf and NaN).
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    exp = 113;  // 127 - 15 + 1
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    man &= 0x3ffu;
    return bits_to_float(sign | (exp << 23) | (man << 13));
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

template <typename T, typename Load>
void verify_rows(const T* logits, const int64_t* draft, int64_t N, int64_t B, int64_t V,
                 int64_t* accepted, int64_t* bonus, Load load) {
  std::vector<int64_t> am(static_cast<size_t>(B));
  for (int64_t n = 0; n < N; ++n) {
    const T* base = logits + n * B * V;
    const int64_t* d = draft + n * (B - 1);
    // Lazy: only the positions up to the first mismatch are needed.
    int64_t a = 0;
    for (;;) {
      am[a] = dflash::detail::argmax_row(base + a * V, V, load);
      if (a < B - 1 && d[a] == am[a]) {
        ++a;
        continue;
      }
      break;
    }
    accepted[n] = a;
    bonus[n] = am[a];
  }
}

}  // namespace

extern "C" {

int dflash_kernels_abi_version(void) { return DFLASH_KERNELS_ABI_VERSION; }

int dflash_verify_greedy_host(const void* logits, dflash_dtype dtype, const int64_t* draft_tokens,
                              int64_t N, int64_t B, int64_t V, int64_t* accepted, int64_t* bonus) {
  if (N < 0 || B < 1 || V < 1) return DFLASH_ERR_ARGUMENT;
  if (N == 0) return DFLASH_OK;
  if (!logits || !accepted || !bonus || (B > 1 && !draft_tokens)) return DFLASH_ERR_ARGUMENT;
  switch (dtype) {
    case DFLASH_DTYPE_F32:
      verify_rows(static_cast<const float*>(logits), draft_tokens, N, B, V, accepted, bonus,
                  [](float x) { return x; });
      return DFLASH_OK;
    case DFLASH_DTYPE_F16:
      verify_rows(static_cast<const uint16_t*>(logits), draft_tokens, N, B, V, accepted, bonus,
                  [](uint16_t x) { return f16_to_float(x); });
      return DFLASH_OK;
    case DFLASH_DTYPE_BF16:
      verify_rows(static_cast<const uint16_t*>(logits), draft_tokens, N, B, V, accepted, bonus,
                  [](uint16_t x) { return bf16_to_float(x); });
      return DFLASH_OK;
  }
  return DFLASH_ERR_ARGUMENT;
}

int dflash_commit_round_host(const int64_t* draft_tokens, const int64_t* accepted,
                             const int64_t* bonus, const int64_t* stop_tokens, int64_t num_stop,
                             int64_t stop_row_stride, const int64_t* max_lengths,
                             int64_t* out_tokens, int64_t* lengths, int64_t* positions,
                             int64_t* anchor, uint8_t* done, int64_t* num_new, int64_t R,
                             int64_t B, int64_t capacity) {
  if (R < 0 || B < 1 || capacity < 0 || num_stop < 0 || stop_row_stride < 0)
    return DFLASH_ERR_ARGUMENT;
  if (R == 0) return DFLASH_OK;
  if (!accepted || !bonus || !max_lengths || !lengths || !positions || !anchor || !done ||
      !num_new || (B > 1 && !draft_tokens) || (num_stop > 0 && !stop_tokens) ||
      (capacity > 0 && !out_tokens))
    return DFLASH_ERR_ARGUMENT;
  // Validate everything first so that a failure writes nothing.
  for (int64_t r = 0; r < R; ++r) {
    if (done[r]) continue;
    if (dflash::detail::commit_check(accepted[r], lengths[r], max_lengths[r], B, capacity) !=
        dflash::detail::kCommitOk)
      return DFLASH_ERR_VALUE;
  }
  for (int64_t r = 0; r < R; ++r) {
    if (done[r]) {
      num_new[r] = 0;
      continue;
    }
    dflash::detail::commit_one(draft_tokens + r * (B - 1), accepted[r], bonus[r],
                               num_stop > 0 ? stop_tokens + r * stop_row_stride : nullptr, num_stop, max_lengths[r],
                               out_tokens + r * capacity, lengths + r, positions + r, anchor + r,
                               done + r, num_new + r);
  }
  return DFLASH_OK;
}

}  // extern "C"
