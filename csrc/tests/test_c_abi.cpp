// ctest executable for the torch-free C ABI (dflash_kernels.h).
// Checks the host functions against naive definitions written here, and -- when built with
// DFLASH_TEST_CUDA and a CUDA device is present -- the device launchers against the host ones.
#include "dflash_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#ifdef DFLASH_TEST_CUDA
#include <cuda_runtime.h>
#endif

static int g_failures = 0;
#define EXPECT(cond, ...)                                          \
  do {                                                             \
    if (!(cond)) {                                                 \
      ++g_failures;                                                \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                           \
      std::fprintf(stderr, "\n");                                  \
    }                                                              \
  } while (0)

// Naive torch.argmax: first index of the maximum, NaN is the maximum (first NaN).
static int64_t naive_argmax(const float* x, int64_t V) {
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(x[i])) return i;
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

static uint16_t float_to_bf16_exact(float f) {  // only for values exactly representable in bf16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

static uint16_t small_int_to_f16(int v) {  // |v| < 2048, exact
  if (v == 0) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  unsigned a = static_cast<unsigned>(v < 0 ? -v : v);
  int e = 0;
  while ((a >> e) > 1) ++e;
  unsigned man = (a << (10 - e)) & 0x3ffu;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | man);
}

struct VerifyCase {
  int64_t N, B, V;
  std::vector<float> logits;
  std::vector<int64_t> draft;
};

static VerifyCase make_verify_case(std::mt19937_64& rng, int64_t N, int64_t B, int64_t V, bool nan) {
  VerifyCase c{N, B, V, std::vector<float>(N * B * V), std::vector<int64_t>(N * (B > 1 ? B - 1 : 0))};
  std::uniform_int_distribution<int> small(-8, 8);  // many ties, exact in fp16/bf16
  for (auto& x : c.logits) x = static_cast<float>(small(rng));
  if (nan) c.logits[(N * B * V) / 2] = std::numeric_limits<float>::quiet_NaN();
  std::uniform_int_distribution<int> coin(0, 3);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j + 1 < B; ++j) {
      const int64_t am = naive_argmax(&c.logits[(n * B + j) * V], V);
      c.draft[n * (B - 1) + j] = coin(rng) ? am : (am + 1) % V;  // mostly accepted
    }
  return c;
}

static void expected_verify(const VerifyCase& c, std::vector<int64_t>& acc, std::vector<int64_t>& bonus) {
  acc.assign(c.N, 0);
  bonus.assign(c.N, 0);
  for (int64_t n = 0; n < c.N; ++n) {
    int64_t a = 0;
    while (a < c.B - 1 &&
           c.draft[n * (c.B - 1) + a] == naive_argmax(&c.logits[(n * c.B + a) * c.V], c.V))
      ++a;
    acc[n] = a;
    bonus[n] = naive_argmax(&c.logits[(n * c.B + a) * c.V], c.V);
  }
}

static void test_verify_host(std::mt19937_64& rng) {
  const int64_t shapes[][3] = {{1, 1, 1}, {3, 1, 17}, {4, 5, 33}, {2, 16, 1000}, {7, 4, 4097}};
  for (auto& s : shapes) {
    for (int nan = 0; nan < 2; ++nan) {
      VerifyCase c = make_verify_case(rng, s[0], s[1], s[2], nan);
      std::vector<int64_t> ea, eb, a(c.N), b(c.N);
      expected_verify(c, ea, eb);
      EXPECT(dflash_verify_greedy_host(c.logits.data(), DFLASH_DTYPE_F32, c.draft.data(), c.N, c.B,
                                       c.V, a.data(), b.data()) == DFLASH_OK, "f32");
      EXPECT(a == ea && b == eb, "verify f32 N=%lld B=%lld V=%lld", (long long)c.N, (long long)c.B,
             (long long)c.V);
      if (nan) continue;  // the half conversions below are for finite small integers
      std::vector<uint16_t> h(c.logits.size()), bf(c.logits.size());
      for (size_t i = 0; i < h.size(); ++i) {
        h[i] = small_int_to_f16(static_cast<int>(c.logits[i]));
        bf[i] = float_to_bf16_exact(c.logits[i]);
      }
      EXPECT(dflash_verify_greedy_host(h.data(), DFLASH_DTYPE_F16, c.draft.data(), c.N, c.B, c.V,
                                       a.data(), b.data()) == DFLASH_OK, "f16");
      EXPECT(a == ea && b == eb, "verify f16");
      EXPECT(dflash_verify_greedy_host(bf.data(), DFLASH_DTYPE_BF16, c.draft.data(), c.N, c.B, c.V,
                                       a.data(), b.data()) == DFLASH_OK, "bf16");
      EXPECT(a == ea && b == eb, "verify bf16");
    }
  }
  int64_t a, b;
  float x = 0.f;
  EXPECT(dflash_verify_greedy_host(&x, DFLASH_DTYPE_F32, nullptr, 1, 1, 0, &a, &b) == DFLASH_ERR_ARGUMENT, "V=0");
  EXPECT(dflash_verify_greedy_host(&x, static_cast<dflash_dtype>(7), nullptr, 1, 1, 1, &a, &b) ==
             DFLASH_ERR_ARGUMENT, "bad dtype");
}

struct CommitState {
  std::vector<int64_t> out, len, pos, anc, num_new;
  std::vector<uint8_t> done;
  bool operator==(const CommitState& o) const {
    return out == o.out && len == o.len && pos == o.pos && anc == o.anc && done == o.done &&
           num_new == o.num_new;
  }
};

static void test_commit_host() {
  // R = 4, B = 4, capacity 8, shared stop token 99.
  const int64_t R = 4, B = 4, C = 8;
  std::vector<int64_t> draft = {1, 2, 3,  4, 99, 6,  7, 8, 9,  10, 11, 12};
  std::vector<int64_t> acc = {3, 2, 3, 1};
  std::vector<int64_t> bonus = {20, 21, 22, 23};
  std::vector<int64_t> stop = {-1, 99};
  std::vector<int64_t> maxl = {8, 8, 6, 8};
  CommitState s;
  s.out.assign(R * C, -5);
  s.len = {0, 3, 4, 0};
  s.pos = {10, 13, 14, 10};
  s.anc = {0, 0, 0, 0};
  s.done = {0, 0, 0, 1};
  s.num_new.assign(R, -1);
  EXPECT(dflash_commit_round_host(draft.data(), acc.data(), bonus.data(), stop.data(), 2, 0,
                                  maxl.data(), s.out.data(), s.len.data(), s.pos.data(),
                                  s.anc.data(), s.done.data(), s.num_new.data(), R, B, C) == DFLASH_OK,
         "commit");
  // r0: 1 2 3 20 -> len 4, not done. r1: 4 99 (stop) -> len 5, done. r2: room 2 -> 7 8, done.
  // r3: done, untouched.
  const int64_t out_expected[] = {1,  2,  3,  20, -5, -5, -5, -5,  -5, -5, -5, 4,  99, -5, -5, -5,
                                  -5, -5, -5, -5, 7,  8,  -5, -5,  -5, -5, -5, -5, -5, -5, -5, -5};
  EXPECT(std::memcmp(s.out.data(), out_expected, sizeof out_expected) == 0, "out_tokens");
  EXPECT((s.len == std::vector<int64_t>{4, 5, 6, 0}), "lengths");
  EXPECT((s.pos == std::vector<int64_t>{14, 15, 16, 10}), "positions");
  EXPECT((s.anc == std::vector<int64_t>{20, 99, 8, 0}), "anchor");
  EXPECT((s.done == std::vector<uint8_t>{0, 1, 1, 1}), "done");
  EXPECT((s.num_new == std::vector<int64_t>{4, 2, 2, 0}), "num_new");

  // Invalid value: nothing written at all.
  CommitState before = s;
  before.done[0] = 0;
  CommitState t = before;
  std::vector<int64_t> bad_acc = {4, 0, 0, 0};  // accepted > B-1 for a live request
  EXPECT(dflash_commit_round_host(draft.data(), bad_acc.data(), bonus.data(), stop.data(), 2, 0,
                                  maxl.data(), t.out.data(), t.len.data(), t.pos.data(),
                                  t.anc.data(), t.done.data(), t.num_new.data(), R, B, C) ==
             DFLASH_ERR_VALUE, "bad accepted");
  EXPECT(t == before, "state changed on error");
  std::vector<int64_t> big_maxl = {9, 8, 8, 8};
  EXPECT(dflash_commit_round_host(draft.data(), acc.data(), bonus.data(), stop.data(), 2, 0,
                                  big_maxl.data(), t.out.data(), t.len.data(), t.pos.data(),
                                  t.anc.data(), t.done.data(), t.num_new.data(), R, B, C) ==
             DFLASH_ERR_VALUE, "max_lengths > capacity");
  EXPECT(t == before, "state changed on error");
}

#ifdef DFLASH_TEST_CUDA
template <typename T>
static T* to_device(const std::vector<T>& v) {
  T* p = nullptr;
  cudaMalloc(&p, v.size() * sizeof(T) + 8);
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}
template <typename T>
static std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

static void test_cuda(std::mt19937_64& rng) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("CUDA: no usable device, device tests skipped\n");
    return;
  }
  const int64_t shapes[][3] = {{1, 1, 7}, {4, 5, 33}, {2, 16, 151936}, {64, 16, 4097}};
  for (auto& s : shapes) {
    VerifyCase c = make_verify_case(rng, s[0], s[1], s[2], false);
    std::vector<int64_t> ea, eb;
    expected_verify(c, ea, eb);
    float* dl = to_device(c.logits);
    int64_t* dd = to_device(c.draft);
    int64_t *da, *db;
    cudaMalloc(&da, c.N * 8);
    cudaMalloc(&db, c.N * 8);
    size_t bytes = dflash_verify_greedy_workspace_bytes(c.N, c.B, c.V, 0);
    void* ws;
    cudaMalloc(&ws, bytes);
    cudaMemset(ws, 0, bytes);
    for (int rep = 0; rep < 2; ++rep) {  // the second launch reuses the (self-reset) workspace
      EXPECT(dflash_verify_greedy_cuda(dl, DFLASH_DTYPE_F32, dd, c.N, c.B, c.V, da, db, ws, bytes, 0,
                                       nullptr) == 0, "launch");
      EXPECT(to_host(da, c.N) == ea && to_host(db, c.N) == eb, "cuda verify V=%lld rep=%d",
             (long long)c.V, rep);
    }
    cudaFree(dl); cudaFree(dd); cudaFree(da); cudaFree(db); cudaFree(ws);
  }
  // commit_round: random ragged rounds, device == host (invalid values excluded: the host rejects them).
  for (int round = 0; round < 20; ++round) {
    const int64_t R = 37, B = 8, C = 20, S = 3;
    std::uniform_int_distribution<int64_t> tok(0, 9), accd(0, B - 1), lend(0, C), coin(0, 4);
    std::vector<int64_t> draft(R * (B - 1)), acc(R), bonus(R), stop(R * S), maxl(R);
    CommitState h;
    h.out.resize(R * C);
    h.len.resize(R);
    h.pos.resize(R);
    h.anc.resize(R);
    h.done.resize(R);
    h.num_new.assign(R, 0);
    for (auto& x : draft) x = tok(rng);
    for (auto& x : stop) x = tok(rng) - 1;  // includes -1 padding
    for (auto& x : h.out) x = -7;
    for (int64_t r = 0; r < R; ++r) {
      acc[r] = accd(rng);
      bonus[r] = tok(rng);
      h.len[r] = lend(rng);
      maxl[r] = std::min<int64_t>(C, h.len[r] + coin(rng) * 3 - 2);
      h.pos[r] = 100 + r;
      h.anc[r] = -1;
      h.done[r] = coin(rng) == 0;
    }
    CommitState d = h;
    EXPECT(dflash_commit_round_host(draft.data(), acc.data(), bonus.data(), stop.data(), S, S,
                                    maxl.data(), h.out.data(), h.len.data(), h.pos.data(),
                                    h.anc.data(), h.done.data(), h.num_new.data(), R, B, C) == DFLASH_OK,
           "host commit");
    int64_t *p_draft = to_device(draft), *p_acc = to_device(acc), *p_bonus = to_device(bonus),
            *p_stop = to_device(stop), *p_maxl = to_device(maxl), *p_out = to_device(d.out),
            *p_len = to_device(d.len), *p_pos = to_device(d.pos), *p_anc = to_device(d.anc),
            *p_nn = to_device(d.num_new);
    uint8_t* p_done = to_device(d.done);
    EXPECT(dflash_commit_round_cuda(p_draft, p_acc, p_bonus, p_stop, S, S, p_maxl, p_out, p_len, p_pos,
                                    p_anc, p_done, p_nn, R, B, C, nullptr) == 0, "launch commit");
    d.out = to_host(p_out, R * C);
    d.len = to_host(p_len, R);
    d.pos = to_host(p_pos, R);
    d.anc = to_host(p_anc, R);
    d.done = to_host(p_done, R);
    d.num_new = to_host(p_nn, R);
    EXPECT(d == h, "cuda commit_round != host (round %d)", round);
    for (void* p : {(void*)p_draft, (void*)p_acc, (void*)p_bonus, (void*)p_stop, (void*)p_maxl,
                    (void*)p_out, (void*)p_len, (void*)p_pos, (void*)p_anc, (void*)p_nn, (void*)p_done})
      cudaFree(p);
  }
  std::printf("CUDA: device tests ran\n");
}
#endif

int main() {
  std::mt19937_64 rng(1234);
  EXPECT(dflash_kernels_abi_version() == DFLASH_KERNELS_ABI_VERSION, "abi version");
  test_verify_host(rng);
  test_commit_host();
#ifdef DFLASH_TEST_CUDA
  test_cuda(rng);
#else
  std::printf("CUDA: not built, device tests skipped\n");
#endif
  if (g_failures) {
    std::fprintf(stderr, "%d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("dflash_kernels C ABI: all checks passed\n");
  return 0;
}
