// torch.ops.dflash_cpu.*: the native CPU kernels of dflash_cpu.h as torch ops (the one file here with torch
// headers). Each op checks everything its kernel's pointers walk (the checks below: any caller's input, not only
// what the Python wrappers dflash_kernels/cpu/native.py, linear.py, forward.py pass) and then builds the kernel's
// argument struct from the tensors.
//
// Instruction sets are chosen here, at load: isas() lists those of this CPU that the build has kernels for
// (__builtin_cpu_supports / CPUID; $DFLASH_CPU_ISA caps them), and the vector ops run the widest table (kAvx512,
// else kAvx2). The fp32 linear kernel has one op per instruction set (linear_avx512, linear_avx2): Python picks
// one, honouring DFLASH_CPU_LINEAR_ISA; linear_<isa>_bf16 is the same kernel on a weight's bf16-packed copy.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <cpuid.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dflash_cpu.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

bool has_amx() {  // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE (the OS grant: amx_request)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return has_avx512() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
}

// The instruction sets of this CPU that the build has kernels for, widest first ("amx", "avx512", "avx2"), without
// those wider than $DFLASH_CPU_ISA when it is set (avx2: run as on a CPU without AVX-512; avx512: without AMX).
// Decided once, at the first call.
const std::vector<std::string>& cpu_isas() {
  static const std::vector<std::string> chosen = [] {
    const std::pair<const char*, bool> all[] = {{"amx", has_amx()}, {"avx512", has_avx512()}, {"avx2", has_avx2()}};
    const char* cap = std::getenv("DFLASH_CPU_ISA");
    bool capped = cap && *cap;
    if (capped) {
      bool known = false;
      for (const auto& isa : all) known |= std::strcmp(isa.first, cap) == 0;
      TORCH_CHECK(known, "DFLASH_CPU_ISA=", cap, " is not one of amx, avx512, avx2");
    }
    std::vector<std::string> out;
    for (const auto& isa : all) {
      capped = capped && std::strcmp(isa.first, cap) != 0;  // still above the cap
      if (isa.second && !capped) out.push_back(isa.first);
    }
    TORCH_CHECK(!cap || !*cap || std::find(out.begin(), out.end(), cap) != out.end(), "DFLASH_CPU_ISA=", cap,
                ": this CPU lacks it");
    return out;
  }();
  return chosen;
}

// The vector kernels of the widest of cpu_isas() (AVX-512, else AVX2 + FMA).
const dflash_cpu::VectorKernels* vector_kernels() {
  static const dflash_cpu::VectorKernels* chosen = [] {
    const std::vector<std::string>& have = cpu_isas();
    return std::find(have.begin(), have.end(), "avx512") != have.end() ? &dflash_cpu::kAvx512
           : std::find(have.begin(), have.end(), "avx2") != have.end() ? &dflash_cpu::kAvx2
                                                                          : nullptr;
  }();
  TORCH_CHECK(chosen, "dflash_cpu: this CPU has neither AVX-512 nor AVX2 + FMA (check isas() first)");
  return chosen;
}

template <typename T>
T* ptr(const Tensor& t) {
  return t.data_ptr<T>();
}

template <typename T>
T* ptr(const OptTensor& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

std::vector<std::string> isas() { return cpu_isas(); }

// ---- The checks. Every op validates, before any pointer is read, what its kernel walks: dtypes, the CPU device,
// dims and sizes (each tensor covers the extent the kernel walks, given its strides), contiguity where the kernel
// assumes it, the CPU features its code needs, and the values of the index tensors that address memory. Those are
// copied once (they are small) and the kernel reads the copy, so the values checked are the values used. An error
// names the op and the argument and says what is expected.

constexpr int64_t kAny = -1;  // a size that `expect` leaves free

// An argument's name in an error: "x", or "taps[2]" for an element of a tensor list.
struct Arg {
  Arg(const char* name, int64_t index = -1) : name(name), index(index) {}  // NOLINT: implicit from a name
  const char* name;
  int64_t index;
};

std::ostream& operator<<(std::ostream& os, const Arg& a) {
  os << a.name;
  if (a.index >= 0) os << "[" << a.index << "]";
  return os;
}

// Whether dims [from, dim) of t are laid out contiguously (a dim of size 1 takes no step: any stride).
bool contiguous_from(const Tensor& t, int64_t from) {
  if (from == 0) return t.is_contiguous();
  int64_t step = 1;
  for (int64_t d = t.dim() - 1; d >= from; --d) {
    if (t.size(d) != 1 && t.stride(d) != step) return false;
    step *= t.size(d);
  }
  return true;
}

std::string shape_text(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t d = 0; d < sizes.size(); ++d)
    s += (d ? ", " : "") + (sizes[d] == kAny ? std::string("*") : std::to_string(sizes[d]));
  return s + "]";
}

std::string layout_text(int64_t packed, int64_t dims) {
  return packed == 0 ? ", contiguous" : packed < dims ? ", contiguous from dim " + std::to_string(packed) + " on" : "";
}

// t: a CPU `dtype` tensor of shape `sizes` (kAny: any size in that dim) whose dims from `packed` on are laid out
// contiguously (0: the whole tensor; sizes.size(): any strides; the kernel then walks the tensor's own strides).
void expect(const char* op, Arg arg, const Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes,
            int64_t packed = 0) {
  const int64_t dims = static_cast<int64_t>(sizes.size());
  bool ok = t.is_cpu() && t.scalar_type() == dtype && t.dim() == dims;
  for (int64_t d = 0; ok && d < dims; ++d) ok = sizes[d] == kAny || t.size(d) == sizes[d];
  TORCH_CHECK(ok && contiguous_from(t, packed), "dflash_cpu::", op, ": ", arg, " must be a CPU ", dtype,
              " tensor of shape ", shape_text(sizes), layout_text(packed, dims), "; got ", t.scalar_type(), " ",
              t.sizes(), " strides ", t.strides(), " on ", t.device());
}

void expect(const char* op, Arg arg, const OptTensor& t, at::ScalarType dtype, at::IntArrayRef sizes,
            int64_t packed = 0) {
  if (t.has_value()) expect(op, arg, *t, dtype, sizes, packed);
}

// t: a contiguous CPU `dtype` tensor of `numel` values, of any shape (a weight vector, a buffer the kernel reads
// flat).
void expect_values(const char* op, Arg arg, const Tensor& t, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK(t.is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel, "dflash_cpu::", op,
              ": ", arg, " must be a contiguous CPU ", dtype, " tensor of ", numel, " values; got ", t.scalar_type(),
              " ", t.sizes(), " strides ", t.strides(), " on ", t.device());
}

void expect_values(const char* op, Arg arg, const OptTensor& t, at::ScalarType dtype, int64_t numel) {
  if (t.has_value()) expect_values(op, arg, *t, dtype, numel);
}

// A size argument (not a tensor's): at least `least`.
void expect_size(const char* op, const char* arg, int64_t value, int64_t least) {
  TORCH_CHECK(value >= least, "dflash_cpu::", op, ": ", arg, " = ", value, " must be at least ", least);
}

// The values of an int64 index tensor of shape `sizes` (contiguous), copied once: the kernel reads the copy.
using Index = c10::SmallVector<int64_t, 16>;

Index index_copy(const char* op, const char* arg, const Tensor& t, at::IntArrayRef sizes) {
  expect(op, arg, t, at::kLong, sizes);
  const int64_t* p = t.data_ptr<int64_t>();
  return Index(p, p + t.numel());
}

// Every value of the index `arg` in [lo, hi]; `what`: what the bounds are.
void expect_within(const char* op, const char* arg, const Index& values, int64_t lo, int64_t hi, const char* what) {
  for (size_t i = 0; i < values.size(); ++i)
    TORCH_CHECK(values[i] >= lo && values[i] <= hi, "dflash_cpu::", op, ": ", arg, "[", i, "] = ", values[i],
                " must be in [", lo, ", ", hi, "] (", what, ")");
}

// The caches' rows of n requests: `rows` (each one of the caches' `batch` rows), copied; absent, rows 0..n-1 (n <=
// batch) and an empty copy.
Index cache_rows(const char* op, const OptTensor& rows, int64_t n, int64_t batch) {
  if (!rows.has_value()) {
    TORCH_CHECK(n <= batch, "dflash_cpu::", op, ": without rows, request i uses cache row i, but there are ", n,
                " requests and ", batch, " cache rows; pass rows");
    return {};
  }
  Index values = index_copy(op, "rows", *rows, {n});
  expect_within(op, "rows", values, 0, batch - 1, "a row of the caches");
  return values;
}

const int64_t* index_ptr(const OptTensor& t, const Index& values) { return t.has_value() ? values.data() : nullptr; }

// The instruction sets the kernels are compiled for: the code of one runs only where the CPU has it.
enum class Isa { kAvx2, kAvx512, kAmx };

bool cpu_has(Isa isa) {
  static const bool has[] = {has_avx2(), has_avx512(), has_amx()};
  return has[static_cast<int>(isa)];
}

void expect_isa(const char* op, Isa isa) {
  static const char* const names[] = {"AVX2 + FMA", "AVX-512 (F, BW, DQ, VL) + FMA", "AMX-TILE + AMX-BF16"};
  TORCH_CHECK(cpu_has(isa), "dflash_cpu::", op, ": this CPU lacks ", names[static_cast<int>(isa)],
              ", which its code needs (isas() lists what it has)");
}

// Whether amx_request() got this process the AMX tile state (tile instructions fault without it).
std::atomic<bool> amx_granted{false};

void expect_amx_tiles(const char* op) {
  TORCH_CHECK(amx_granted.load(std::memory_order_relaxed), "dflash_cpu::", op,
              ": the AMX tile state is not granted to this process: call amx_request() first (it fails where the "
              "CPU lacks AMX-TILE / AMX-BF16 or the OS refuses)");
}

// The values of amx_pack's tiles of a [n, k] weight (dflash_cpu.h): ceil(n / 16) column groups x ceil(k / 32)
// steps x 512.
int64_t amx_tile_values(const char* op, int64_t n, int64_t k) {
  expect_size(op, "the weight's rows", n, 0);
  expect_size(op, "the weight's columns", k, 0);
  const int64_t groups = n / 16 + (n % 16 != 0), steps = k / 32 + (k % 32 != 0);
  int64_t values = 0;
  TORCH_CHECK(!__builtin_mul_overflow(groups, steps, &values) && !__builtin_mul_overflow(values, 512, &values),
              "dflash_cpu::", op, ": a [", n, ", ", k, "] weight's tiles would overflow int64");
  return values;
}

// A bias of a block of n weight rows: None, or n contiguous fp32 values.
void expect_bias(const char* op, int64_t block, const OptTensor& bias, int64_t n) {
  expect_values(op, {"biases", block}, bias, at::kFloat, n);
}

// Block `block` of a weight for the vector kernels: [n, k] of `dtype` (fp32, or int16 for a bf16-packed copy) with
// unit stride along k and rows that do not overlap, and its bias (or None). Returns n.
int64_t expect_weight_block(const char* op, int64_t block, const Tensor& w, const OptTensor& bias, int64_t k,
                            at::ScalarType dtype) {
  expect(op, {"weights", block}, w, dtype, {kAny, k}, 1);
  TORCH_CHECK(w.size(0) <= 1 || w.stride(0) >= k, "dflash_cpu::", op, ": weights[", block, "] rows overlap (stride ",
              w.stride(0), " < K = ", k, ")");
  expect_bias(op, block, bias, w.size(0));
  return w.size(0);
}

// Block `block` of a weight as AMX tiles (the op's tensor list `list`): amx_pack's tiles of its [n, k] rows, and its
// bias (or None).
void expect_tile_block(const char* op, const char* list, int64_t block, const Tensor& tiles, int64_t n,
                       const OptTensor& bias, int64_t k) {
  expect_values(op, {list, block}, tiles, at::kShort, amx_tile_values(op, n, k));
  expect_bias(op, block, bias, n);
}

// The inter width I of [gate (I) | up (I)] rows t [rows, 2I].
int64_t half_width(const char* op, const char* arg, const Tensor& t) {
  TORCH_CHECK(t.size(1) % 2 == 0, "dflash_cpu::", op, ": ", arg, "'s rows must be [gate | up], an even width; got ",
              t.size(1));
  return t.size(1) / 2;
}

// x [rows, H] with a row stride (unit stride along H).
void add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, const Tensor& out, double eps) {
  const char* op = "add_rms_norm";
  expect(op, "x", x, at::kFloat, {kAny, kAny}, 1);
  const int64_t rows = x.size(0), hidden = x.size(1);
  expect_values(op, "residual", residual, at::kFloat, rows * hidden);
  expect_values(op, "weight", weight, at::kFloat, hidden);
  expect_values(op, "out", out, at::kFloat, rows * hidden);
  vector_kernels()->add_rms_norm({ptr<float>(x), x.stride(0), ptr<float>(residual), ptr<float>(weight),
                                  ptr<float>(out), rows, hidden, static_cast<float>(eps), at::get_num_threads()});
}

// gate_up [rows, 2I] with a row stride (unit stride along 2I), out [rows, I] contiguous.
void silu_mul(const Tensor& gate_up, const Tensor& out) {
  const char* op = "silu_mul";
  expect(op, "gate_up", gate_up, at::kFloat, {kAny, kAny}, 1);
  expect(op, "out", out, at::kFloat, {gate_up.size(0), half_width(op, "gate_up", gate_up)});
  vector_kernels()->silu_mul({ptr<float>(gate_up), gate_up.stride(0), ptr<float>(out), gate_up.size(0),
                              out.size(1), at::get_num_threads()});
}

// The checked copies of the block attention's index tensors (empty where absent).
struct AttentionIndex {
  Index lens, rows, block_lens;
};

// Everything BlockAttentionArgs' pointers walk (dflash_cpu.h): q [N, B, nH, D], k / v [N, B, kvH, D] (rows at
// strides, heads contiguous), caches [R, cap, kvH, D] contiguous, D a multiple of 16 up to kMaxHeadDim, nH a
// multiple of kvH, lens [N] in [0, cap] (less B with write_kv), rows [N] in [0, R) (absent: N <= R), block_lens
// [N] in [0, B], norms [D], tables [N * B, D], tree_mask [N, B, W] with 64 W >= B, out [N, B, nH, D] contiguous.
AttentionIndex check_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& k_cache, const Tensor& v_cache, const Tensor& lens,
                               const OptTensor& rows, const OptTensor& block_lens, const OptTensor& q_norm,
                               const OptTensor& k_norm, const Tensor& cos, const Tensor& sin_signed,
                               const OptTensor& tree_mask, bool write_kv, const Tensor& out) {
  expect(op, "q", q, at::kFloat, {kAny, kAny, kAny, kAny}, 2);
  const int64_t n = q.size(0), b = q.size(1), nh = q.size(2), d = q.size(3);
  expect(op, "k_cache", k_cache, at::kFloat, {kAny, kAny, kAny, d});
  const int64_t batch = k_cache.size(0), cap = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(kvh >= 1 && nh % kvh == 0, "dflash_cpu::", op, ": q's ", nh, " heads must be a multiple of the "
              "caches' ", kvh, " KV heads (at least one)");
  TORCH_CHECK(d % 16 == 0 && d <= dflash_cpu::kMaxHeadDim, "dflash_cpu::", op, ": the head dim ", d,
              " must be a multiple of 16, at most ", dflash_cpu::kMaxHeadDim);
  expect(op, "v_cache", v_cache, at::kFloat, {batch, cap, kvh, d});
  expect(op, "k", k, at::kFloat, {n, b, kvh, d}, 2);
  expect(op, "v", v, at::kFloat, {n, b, kvh, d}, 2);
  expect_values(op, "q_norm", q_norm, at::kFloat, d);
  expect_values(op, "k_norm", k_norm, at::kFloat, d);
  expect(op, "cos", cos, at::kFloat, {n * b, d});
  expect(op, "sin_signed", sin_signed, at::kFloat, {n * b, d});
  expect(op, "tree_mask", tree_mask, at::kLong, {n, b, kAny});
  TORCH_CHECK(!tree_mask.has_value() || tree_mask->size(2) * 64 >= b, "dflash_cpu::", op, ": tree_mask's ",
              tree_mask->size(2), " words a row must hold a bit for each of the ", b, " block rows");
  expect(op, "out", out, at::kFloat, {n, b, nh, d});
  AttentionIndex index{index_copy(op, "lens", lens, {n}), cache_rows(op, rows, n, batch), {}};
  expect_within(op, "lens", index.lens, 0, write_kv ? cap - b : cap,
                write_kv ? "a cache length with room for the block's rows" : "a cache length");
  if (block_lens.has_value()) {
    index.block_lens = index_copy(op, "block_lens", *block_lens, {n});
    expect_within(op, "block_lens", index.block_lens, 0, b, "the block rows seen");
  }
  return index;
}

dflash_cpu::BlockAttentionArgs attention_args(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& k_cache, const Tensor& v_cache,
                                              const AttentionIndex& index, const OptTensor& rows,
                                              const OptTensor& block_lens, const OptTensor& q_norm,
                                              const OptTensor& k_norm, double eps, const Tensor& cos,
                                              const Tensor& sin_signed, const OptTensor& tree_mask, bool causal,
                                              bool write_kv, double scale, const Tensor& out) {
  return {ptr<float>(q), ptr<float>(k), ptr<float>(v), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
          v.stride(0), v.stride(1), ptr<float>(k_cache), ptr<float>(v_cache), k_cache.size(1), index.lens.data(),
          index_ptr(rows, index.rows), index_ptr(block_lens, index.block_lens), ptr<float>(q_norm),
          ptr<float>(k_norm), static_cast<float>(eps), ptr<float>(cos), ptr<float>(sin_signed),
          ptr<int64_t>(tree_mask), tree_mask.has_value() ? tree_mask->size(2) : 0, causal, write_kv, ptr<float>(out),
          q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), static_cast<float>(scale), at::get_num_threads()};
}

// q [N, B, nH, D], k / v [N, B, kvH, D] (heads contiguous), caches [R, cap, kvH, D]: BlockAttentionArgs. 0, or 1
// when the scratch memory cannot be allocated.
int64_t block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& lens, const OptTensor& rows,
                        const OptTensor& block_lens, const OptTensor& q_norm, const OptTensor& k_norm, double eps,
                        const Tensor& cos, const Tensor& sin_signed, const OptTensor& tree_mask, bool causal,
                        bool write_kv, double scale, const Tensor& out) {
  const AttentionIndex index = check_attention("block_attention", q, k, v, k_cache, v_cache, lens, rows, block_lens,
                                               q_norm, k_norm, cos, sin_signed, tree_mask, write_kv, out);
  return vector_kernels()->block_attention(attention_args(q, k, v, k_cache, v_cache, index, rows, block_lens, q_norm,
                                                          k_norm, eps, cos, sin_signed, tree_mask, causal, write_kv,
                                                          scale, out));
}

// k / v [M, kvH, D] (rows at a stride, heads contiguous), offsets [N + 1] (0, non-decreasing, at most M), lens [N]
// (>= 0; rows past the capacity are dropped), rows [N], tables [offsets[N], D], caches [R, cap, kvH, D]
// contiguous: InjectKvArgs.
void inject_context_kv(const Tensor& k, const Tensor& v, const Tensor& k_norm, double eps, const Tensor& offsets,
                       const Tensor& lens, const OptTensor& rows, const Tensor& cos, const Tensor& sin_signed,
                       const Tensor& k_cache, const Tensor& v_cache) {
  const char* op = "inject_context_kv";
  expect(op, "k", k, at::kFloat, {kAny, kAny, kAny}, 1);
  const int64_t m = k.size(0), kvh = k.size(1), d = k.size(2);
  TORCH_CHECK(d <= dflash_cpu::kMaxHeadDim, "dflash_cpu::inject_context_kv: the head dim ", d, " must be at most ",
              dflash_cpu::kMaxHeadDim);
  expect(op, "v", v, at::kFloat, {m, kvh, d}, 1);
  expect_values(op, "k_norm", k_norm, at::kFloat, d);
  expect(op, "k_cache", k_cache, at::kFloat, {kAny, kAny, kvh, d});
  const int64_t batch = k_cache.size(0), cap = k_cache.size(1);
  expect(op, "v_cache", v_cache, at::kFloat, {batch, cap, kvh, d});
  const Index lens_v = index_copy(op, "lens", lens, {kAny});
  const int64_t n = static_cast<int64_t>(lens_v.size());
  const Index cu = index_copy(op, "offsets", offsets, {n + 1});
  for (int64_t i = 0; i <= n; ++i)
    TORCH_CHECK(i == 0 ? cu[0] == 0 : cu[i] >= cu[i - 1] && cu[i] <= m, "dflash_cpu::", op, ": offsets[", i, "] = ",
                cu[i], ": offsets must start at 0 and not decrease, up to k's ", m, " rows");
  // (lens + a request's rows stays an int64: the kernel compares it with the capacity)
  expect_within(op, "lens", lens_v, 0, std::numeric_limits<int64_t>::max() - m, "a cache length");
  const Index rows_v = cache_rows(op, rows, n, batch);
  expect(op, "cos", cos, at::kFloat, {cu[n], d});
  expect(op, "sin_signed", sin_signed, at::kFloat, {cu[n], d});
  vector_kernels()->inject_kv({ptr<float>(k), ptr<float>(v), k.stride(0), v.stride(0), ptr<float>(k_norm),
                               static_cast<float>(eps), cu.data(), lens_v.data(), index_ptr(rows, rows_v), n,
                               ptr<float>(cos), ptr<float>(sin_signed), ptr<float>(k_cache), ptr<float>(v_cache), cap,
                               kvh, d, at::get_num_threads()});
}

// The nodes below the root of a full tree of `depths` levels with k children a node, or `limit` if that is fewer.
int64_t tree_capacity(int64_t k, int64_t depths, int64_t limit) {
  int64_t total = 0, level = 1;
  for (int64_t depth = 1; depth <= depths && total < limit; ++depth) {
    level = level > limit / k ? limit : level * k;
    total += level;
  }
  return total < limit ? total : limit;
}

// logits [R, P, V] (unit stride along V), lse [R, P], anchor [R], vocab_ids [V], tokens / parents / depths [R, T]
// with 1 <= k <= V and T - 1 nodes in the tree of P levels of k children: BuildTreeArgs' status.
int64_t build_tree(const Tensor& logits, const Tensor& lse, int64_t k, const Tensor& anchor,
                   const OptTensor& vocab_ids, const Tensor& tokens, const Tensor& parents, const Tensor& depths) {
  const char* op = "build_tree";
  expect(op, "logits", logits, at::kFloat, {kAny, kAny, kAny}, 2);
  const int64_t r = logits.size(0), p = logits.size(1), v = logits.size(2);
  expect_size(op, "logits' depths P", p, 1);
  TORCH_CHECK(k >= 1 && k <= v, "dflash_cpu::build_tree: k = ", k, " must be in [1, V = ", v,
              "] (the children kept a node)");
  expect(op, "lse", lse, at::kFloat, {r, p});
  expect(op, "anchor", anchor, at::kLong, {r});
  expect(op, "vocab_ids", vocab_ids, at::kLong, {v});
  expect(op, "tokens", tokens, at::kLong, {r, kAny});
  const int64_t t = tokens.size(1);
  expect(op, "parents", parents, at::kLong, {r, t});
  expect(op, "depths", depths, at::kLong, {r, t});
  expect_size(op, "tokens' nodes T", t, 1);
  TORCH_CHECK(tree_capacity(k, p, t) >= t - 1, "dflash_cpu::build_tree: T = ", t, " nodes need ", t - 1,
              " below the root, more than a tree of ", p, " levels of k = ", k, " children has");
  return dflash_cpu::build_tree({ptr<float>(logits), logits.stride(0), logits.stride(1), r, p, v, ptr<float>(lse), k,
                                 t, ptr<int64_t>(anchor), ptr<int64_t>(vocab_ids), ptr<int64_t>(tokens),
                                 ptr<int64_t>(parents), ptr<int64_t>(depths)});
}

// parents [R, T] (row stride), mask [R, T, W] with 64 W >= T: the first bad request * T + node, or -1 (the kernel
// checks each parent before it follows it).
int64_t tree_ancestor_mask(const Tensor& parents, const Tensor& mask) {
  const char* op = "tree_ancestor_mask";
  expect(op, "parents", parents, at::kLong, {kAny, kAny}, 1);
  const int64_t r = parents.size(0), t = parents.size(1);
  expect(op, "mask", mask, at::kLong, {r, t, kAny});
  TORCH_CHECK(mask.size(2) * 64 >= t, "dflash_cpu::tree_ancestor_mask: mask's ", mask.size(2),
              " words a node must hold a bit for each of the ", t, " nodes");
  return dflash_cpu::tree_ancestor_mask(ptr<int64_t>(parents), parents.stride(0), r, t, mask.size(2),
                                        ptr<int64_t>(mask));
}

// target / tokens / parents [R, T] (row strides, T >= 1), path [R, B] (B >= 1), accepted / bonus [R]: TreeWalkArgs.
void tree_walk_tokens(const Tensor& target, const Tensor& tokens, const Tensor& parents, const Tensor& path,
                      const Tensor& accepted, const Tensor& bonus) {
  const char* op = "tree_walk_tokens";
  expect(op, "tokens", tokens, at::kLong, {kAny, kAny}, 1);
  const int64_t r = tokens.size(0), t = tokens.size(1);
  expect(op, "target", target, at::kLong, {r, t}, 1);
  expect(op, "parents", parents, at::kLong, {r, t}, 1);
  expect(op, "path", path, at::kLong, {r, kAny});
  expect(op, "accepted", accepted, at::kLong, {r});
  expect(op, "bonus", bonus, at::kLong, {r});
  if (r > 0) {  // each request's walk starts at its root, node 0 of T, written at path depth 0 of B
    expect_size(op, "tokens' nodes T", t, 1);
    expect_size(op, "path's depths B", path.size(1), 1);
  }
  dflash_cpu::tree_walk_tokens({ptr<int64_t>(target), target.stride(0), ptr<int64_t>(tokens), tokens.stride(0),
                                ptr<int64_t>(parents), parents.stride(0), r, t, path.size(1), ptr<int64_t>(path),
                                ptr<int64_t>(accepted), ptr<int64_t>(bonus)});
}

// tree_* [R, T] (row strides, T >= 1), tokens [R, C] (row stride), lengths [R], out_* [R, T] contiguous, limit >= 0,
// 1 <= min_n <= max_n: TreeGraftArgs (any token, parent or length value is safe: the kernel clamps the lengths and
// compares the rest).
void tree_graft_lookup(const Tensor& tree_tokens, const Tensor& tree_parents, const Tensor& tree_depths,
                       const Tensor& tokens, const Tensor& lengths, int64_t limit, int64_t max_n, int64_t min_n,
                       const Tensor& out_tokens, const Tensor& out_parents, const Tensor& out_depths) {
  const char* op = "tree_graft_lookup";
  expect(op, "tree_tokens", tree_tokens, at::kLong, {kAny, kAny}, 1);
  const int64_t r = tree_tokens.size(0), t = tree_tokens.size(1);
  expect(op, "tree_parents", tree_parents, at::kLong, {r, t}, 1);
  expect(op, "tree_depths", tree_depths, at::kLong, {r, t}, 1);
  expect(op, "tokens", tokens, at::kLong, {r, kAny}, 1);
  expect(op, "lengths", lengths, at::kLong, {r});
  for (const auto& [name, out] : {std::pair<const char*, const Tensor*>{"out_tokens", &out_tokens},
                                  {"out_parents", &out_parents}, {"out_depths", &out_depths}})
    expect(op, name, *out, at::kLong, {r, t});
  if (r > 0) expect_size(op, "tree_tokens' nodes T", t, 1);
  expect_size(op, "limit", limit, 0);
  expect_size(op, "min_n", min_n, 1);
  expect_size(op, "max_n", max_n, min_n);
  dflash_cpu::tree_graft_lookup({ptr<int64_t>(tree_tokens), ptr<int64_t>(tree_parents), ptr<int64_t>(tree_depths),
                                 tree_tokens.stride(0), tree_parents.stride(0), tree_depths.stride(0),
                                 ptr<int64_t>(tokens), ptr<int64_t>(lengths), tokens.stride(0), r, t, tokens.size(1),
                                 limit, max_n, min_n, ptr<int64_t>(out_tokens), ptr<int64_t>(out_parents),
                                 ptr<int64_t>(out_depths)});
}

// caches [L, Nb, cap, ...] contiguous (one shape and dtype), path [R, B] a walk's path up to accepted (d <=
// path[r, d] < path[r, d + 1]), accepted [R] in [0, B), start [R] >= 0, rows [R] in [0, Nb): TreeCompactArgs.
void tree_compact(const Tensor& k_cache, const Tensor& v_cache, const Tensor& path, const Tensor& accepted,
                  const Tensor& start, const Tensor& rows) {
  const char* op = "tree_compact";
  TORCH_CHECK(k_cache.dim() >= 3, "dflash_cpu::tree_compact: k_cache must be [L, Nb, cap, ...]; got ",
              k_cache.sizes());
  expect(op, "k_cache", k_cache, k_cache.scalar_type(), k_cache.sizes());
  expect(op, "v_cache", v_cache, k_cache.scalar_type(), k_cache.sizes());
  const Index acc = index_copy(op, "accepted", accepted, {kAny});
  const int64_t r = static_cast<int64_t>(acc.size());
  const Index paths = index_copy(op, "path", path, {r, kAny});
  const int64_t b = path.size(1);
  const Index starts = index_copy(op, "start", start, {r});
  const Index rows_v = index_copy(op, "rows", rows, {r});
  expect_within(op, "accepted", acc, 0, b - 1, "a depth of path");
  expect_within(op, "start", starts, 0, std::numeric_limits<int64_t>::max(), "a cache length");
  expect_within(op, "rows", rows_v, 0, k_cache.size(1) - 1, "a row of the caches");
  for (int64_t i = 0; i < r; ++i)
    for (int64_t d = 1; d <= acc[i]; ++d) {
      const int64_t src = paths[i * b + d];
      int64_t row = 0;
      TORCH_CHECK(src >= d && (d == 1 || src > paths[i * b + d - 1]), "dflash_cpu::tree_compact: path[", i, ", ",
                  d, "] = ", src, ": a walk's path has d <= path[r, d] < path[r, d + 1] up to accepted[r]");
      TORCH_CHECK(!__builtin_add_overflow(starts[i], src, &row), "dflash_cpu::tree_compact: start[", i,
                  "] + path[", i, ", ", d, "] overflows int64");
    }
  int64_t row_bytes = k_cache.element_size();
  for (int64_t d = 3; d < k_cache.dim(); ++d) row_bytes *= k_cache.size(d);
  dflash_cpu::tree_compact({static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()),
                            paths.data(), b, acc.data(), starts.data(), rows_v.data(), r, k_cache.size(0),
                            k_cache.size(1), k_cache.size(2), row_bytes});
}

// A weight block's element pointer: the fp32 weight, or its bf16-packed copy (int16 storage, read as uint16_t).
const float* weight_ptr(const Tensor& w, const float*) { return ptr<float>(w); }
const uint16_t* weight_ptr(const Tensor& w, const uint16_t*) {
  return reinterpret_cast<const uint16_t*>(ptr<int16_t>(w));
}

// weights [n, K] (unit stride along K; fp32, or int16 for the bf16-packed copies) and their biases (or None) as
// kernel blocks.
template <typename W>
dflash_cpu::LinearBlockOf<W> linear_block(const Tensor& w, const OptTensor& bias) {
  return {weight_ptr(w, static_cast<const W*>(nullptr)), w.stride(0), w.size(0), ptr<float>(bias)};
}

// The storage of W's weight blocks: fp32, or int16 for the bf16-packed copies.
template <typename W>
constexpr at::ScalarType weight_dtype = std::is_same_v<W, float> ? at::kFloat : at::kShort;

// x [M, K] contiguous, up to three weight row blocks [N_i, K] (unit stride along K; fp32 for W = float, the
// bf16-packed int16 copies for W = uint16_t) and their biases (or None), out [M, sum N_i] contiguous; the kernels of
// the table `kernels`.
template <const dflash_cpu::VectorKernels* kernels, typename W>
void linear(const Tensor& x, at::TensorList weights, const c10::List<OptTensor>& biases, const Tensor& out) {
  const char* op = "linear";
  TORCH_CHECK(weights.size() >= 1 && weights.size() <= 3 && biases.size() == weights.size(),
              "dflash_cpu::linear: 1 to 3 weight blocks, one bias (or None) each");
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0 && x.is_contiguous(),
              "dflash_cpu::linear: x must be a contiguous CPU Float tensor [..., K] (K > 0); got ", x.scalar_type(),
              " ", x.sizes(), " strides ", x.strides());
  const int64_t k = x.size(-1), rows = x.numel() / k;
  int64_t n = 0;
  for (size_t i = 0; i < weights.size(); ++i)
    n += expect_weight_block(op, static_cast<int64_t>(i), weights[i], biases.get(i), k, weight_dtype<W>);
  expect_values(op, "out", out, at::kFloat, rows * n);
  expect_isa(op, kernels == &dflash_cpu::kAvx512 ? Isa::kAvx512 : Isa::kAvx2);
  dflash_cpu::LinearBlockOf<W> blocks[3];
  for (size_t i = 0; i < weights.size(); ++i) blocks[i] = linear_block<W>(weights[i], biases.get(i));
  const dflash_cpu::LinearArgsOf<W> args{ptr<float>(x), rows, k, blocks, static_cast<int>(weights.size()),
                                         ptr<float>(out), at::get_num_threads()};
  if constexpr (std::is_same_v<W, float>)
    kernels->linear(args);
  else
    kernels->linear_bf16(args);
}

// x [M, K] (M >= 1, row stride, unit stride along K), a weight's int8 screen (codes [N, K], scales [N], bounds
// [ceil(N / 16)], the largest scale) and its bf16-packed copy (int16 [N, K]), ids [M]: the (row, 16-column group)
// pairs computed exactly, or -1 without memory. The screen's values are the caller's promise (int8_screen makes
// them): they decide which columns are computed, not which memory is read.
template <const dflash_cpu::VectorKernels* kernels>
int64_t argmax_int8(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& bounds,
                    double max_scale, const Tensor& packed, const Tensor& ids) {
  const char* op = "argmax_int8";
  expect(op, "x", x, at::kFloat, {kAny, kAny}, 1);
  expect_size(op, "x's rows M", x.size(0), 1);
  expect_size(op, "x's columns K", x.size(1), 1);
  expect(op, "codes", codes, at::kChar, {kAny, x.size(1)});
  const int64_t n = codes.size(0);
  expect_size(op, "codes' rows N", n, 1);
  expect(op, "scales", scales, at::kFloat, {n});
  expect(op, "bounds", bounds, at::kDouble, {n / 16 + (n % 16 != 0)});
  expect(op, "packed", packed, at::kShort, {n, x.size(1)});
  expect(op, "ids", ids, at::kLong, {x.size(0)});
  TORCH_CHECK(max_scale >= 0, "dflash_cpu::argmax_int8: max_scale must be the largest scale (>= 0); got ",
              max_scale);
  expect_isa(op, kernels == &dflash_cpu::kAvx512 ? Isa::kAvx512 : Isa::kAvx2);
  return kernels->argmax_int8({ptr<float>(x), x.stride(0), x.size(0), x.size(1), ptr<int8_t>(codes),
                               ptr<float>(scales), ptr<double>(bounds), max_scale,
                               reinterpret_cast<const uint16_t*>(ptr<int16_t>(packed)), n, ptr<int64_t>(ids),
                               at::get_num_threads()});
}

// 0 when the OS granted this process the AMX tile state (then the amx_linear / amx_argmax ops run).
int64_t amx_request() {
  const int status = dflash_cpu::amx_request();
  if (status == 0 && cpu_has(Isa::kAmx)) amx_granted.store(true, std::memory_order_relaxed);
  return status;
}

// weight [N, K] (unit stride along K) -> tiles (dflash_cpu::amx_pack): how many values are not bf16.
int64_t amx_pack(const Tensor& weight, const Tensor& tiles) {
  const char* op = "amx_pack";
  expect(op, "weight", weight, at::kFloat, {kAny, kAny}, 1);
  expect_values(op, "tiles", tiles, at::kShort, amx_tile_values(op, weight.size(0), weight.size(1)));
  expect_isa(op, Isa::kAmx);
  return dflash_cpu::amx_pack(ptr<float>(weight), weight.stride(0), weight.size(0), weight.size(1),
                              reinterpret_cast<uint16_t*>(ptr<int16_t>(tiles)), at::get_num_threads());
}

// tiles of a [n, k] weight -> norms [n].
void amx_column_norms(const Tensor& tiles, int64_t n, int64_t k, const Tensor& norms) {
  const char* op = "amx_column_norms";
  expect_values(op, "tiles", tiles, at::kShort, amx_tile_values(op, n, k));
  expect_values(op, "norms", norms, at::kDouble, n);
  expect_isa(op, Isa::kAmx);
  dflash_cpu::amx_column_norms(reinterpret_cast<const uint16_t*>(ptr<int16_t>(tiles)), n, k, ptr<double>(norms),
                               at::get_num_threads());
}

// x [M, K] (M >= 1, row stride, unit stride along K), tiles of up to three row blocks of rows[i] rows and their
// biases (or None), out [M, sum rows] contiguous: 0, or -1 without memory for the split input rows.
int64_t amx_linear(const Tensor& x, at::TensorList tiles, at::IntArrayRef rows, const c10::List<OptTensor>& biases,
                   const Tensor& out) {
  const char* op = "amx_linear";
  TORCH_CHECK(tiles.size() >= 1 && tiles.size() <= 3 && rows.size() == tiles.size() && biases.size() == tiles.size(),
              "dflash_cpu::amx_linear: 1 to 3 tile blocks, their rows and one bias (or None) each");
  expect(op, "x", x, at::kFloat, {kAny, kAny}, 1);
  expect_size(op, "x's rows M", x.size(0), 1);
  dflash_cpu::AmxLinearArgs a{ptr<float>(x), x.stride(0), x.size(0), x.size(1), {}, nullptr, at::get_num_threads()};
  int64_t n = 0;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const OptTensor bias = biases.get(i);
    expect_tile_block(op, "tiles", static_cast<int64_t>(i), tiles[i], rows[i], bias, x.size(1));
    a.blocks[i] = {reinterpret_cast<const uint16_t*>(ptr<int16_t>(tiles[i])), rows[i], ptr<float>(bias)};
    n += rows[i];
  }
  expect_values(op, "out", out, at::kFloat, x.size(0) * n);
  expect_amx_tiles(op);
  a.y = ptr<float>(out);
  return dflash_cpu::amx_linear(a);
}

// Whether the CPU has AMX-INT8 (CPUID leaf 7, EDX bit 25) besides AMX-BF16: amx_argmax's int8 screen needs it.
// Read once (each greedy verify checks it, and CPUID exits to the hypervisor in a VM).
bool has_amx_int8() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return cpu_has(Isa::kAmx) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);
  }();
  return has;
}

// x [M, K] (row stride, unit stride along K), the tiles and column norms [N] of one weight [N, K], its bias [N] (or
// None), ids [M]: the exactly computed (row, group) pairs, or -1 without memory. With int8_tiles (and scales [N],
// int8_bounds and code_norms [ceil(N / 16)], max_scale; no bias): the AMX-INT8 screen of those codes instead of the
// hi-part screen; its values are the caller's promise (int8_screen makes them): they decide which columns are
// computed exactly, not which memory is read.
int64_t amx_argmax(const Tensor& x, const Tensor& tiles, const OptTensor& bias, const Tensor& norms,
                   const Tensor& ids, const OptTensor& int8_tiles, const OptTensor& scales,
                   const OptTensor& int8_bounds, const OptTensor& code_norms, double max_scale) {
  const char* op = "amx_argmax";
  expect(op, "x", x, at::kFloat, {kAny, kAny}, 1);
  expect(op, "norms", norms, at::kDouble, {kAny});
  const int64_t n = norms.size(0);
  expect_values(op, "tiles", tiles, at::kShort, amx_tile_values(op, n, x.size(1)));
  expect_values(op, "bias", bias, at::kFloat, n);
  expect(op, "ids", ids, at::kLong, {x.size(0)});
  const int given = int8_tiles.has_value() + scales.has_value() + int8_bounds.has_value() + code_norms.has_value();
  TORCH_CHECK(given == 0 || given == 4, "dflash_cpu::amx_argmax: int8_tiles, scales, int8_bounds and code_norms go "
              "together (the int8 screen) or not at all");
  dflash_cpu::AmxInt8Screen screen{};
  if (given) {
    TORCH_CHECK(!bias.has_value(), "dflash_cpu::amx_argmax: the int8 screen takes no bias (pass bias=None)");
    const int64_t groups = n / 16 + (n % 16 != 0);
    expect_size(op, "x's columns K", x.size(1), 1);
    expect_values(op, "int8_tiles", *int8_tiles, at::kChar, groups * ((x.size(1) + 63) / 64) * 1024);
    expect(op, "scales", scales, at::kFloat, {n});
    expect(op, "int8_bounds", int8_bounds, at::kDouble, {groups});
    expect(op, "code_norms", code_norms, at::kDouble, {groups});
    TORCH_CHECK(max_scale >= 0, "dflash_cpu::amx_argmax: max_scale must be the largest scale (>= 0); got ", max_scale);
    TORCH_CHECK(has_amx_int8(), "dflash_cpu::amx_argmax: the int8 screen needs AMX-INT8, which this CPU lacks");
    screen = {ptr<int8_t>(int8_tiles), ptr<float>(scales), ptr<double>(int8_bounds), ptr<double>(code_norms),
              max_scale};
  }
  expect_amx_tiles(op);
  return dflash_cpu::amx_argmax({ptr<float>(x), x.stride(0), x.size(0), x.size(1),
                                 reinterpret_cast<const uint16_t*>(ptr<int16_t>(tiles)), n, ptr<float>(bias),
                                 ptr<double>(norms), ptr<int64_t>(ids), at::get_num_threads(),
                                 given ? &screen : nullptr});
}

// LinearFallback: torch's linear of each block (F.linear's arithmetic) into its columns of y.
int linear_fallback(const float* x, long M, long K, const dflash_cpu::LinearBlock* blocks, int nblocks, float* y) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  long N = 0;
  for (int i = 0; i < nblocks; ++i) N += blocks[i].n;
  const Tensor xt = at::from_blob(const_cast<float*>(x), {M, K}, f32);
  Tensor yt = at::from_blob(y, {M, N}, f32);
  long col = 0;
  for (int i = 0; i < nblocks; ++i) {
    const dflash_cpu::LinearBlock& b = blocks[i];
    const Tensor w = at::from_blob(const_cast<float*>(b.w), {b.n, K}, {b.ldw, 1}, f32);
    const OptTensor bias = b.b ? OptTensor(at::from_blob(const_cast<float*>(b.b), {b.n}, f32)) : std::nullopt;
    yt.narrow(1, col, b.n).copy_(at::linear(xt, w, bias));
    col += b.n;
  }
  return 0;
}

// That this process runs a projection route's code: its instruction set, or the AMX tile state.
void expect_route(const char* op, dflash_cpu::Route route) {
  switch (route) {
    case dflash_cpu::Route::kAmx:
      expect_amx_tiles(op);
      break;
    case dflash_cpu::Route::kAvx512:
    case dflash_cpu::Route::kAvx512Bf16:
      expect_isa(op, Isa::kAvx512);
      break;
    case dflash_cpu::Route::kAvx2:
    case dflash_cpu::Route::kAvx2Bf16:
      expect_isa(op, Isa::kAvx2);
      break;
    case dflash_cpu::Route::kFallback:
      break;
  }
}

// One layer's projections of forward_layers: routes[p] (dflash_cpu::Route) and nblocks[p] for p = q/k/v, o,
// gate/up, down, projection p reading rows of depth[p] values and writing rows of width[p]; weights / block_rows /
// biases: every block in order from block `first` on (weights: AMX tiles on the AMX route, bf16-packed int16 [n, K]
// on the bf16 routes, fp32 [n, K] else). Returns the block after the layer's last.
size_t projections(const char* op, at::IntArrayRef routes, at::IntArrayRef nblocks, at::TensorList weights,
                   at::IntArrayRef block_rows, const c10::List<OptTensor>& biases, size_t first,
                   const int64_t (&depth)[4], const int64_t (&width)[4], dflash_cpu::Projection* out) {
  size_t block = first;
  for (size_t p = 0; p < 4; ++p) {
    TORCH_CHECK(routes[p] >= 0 && routes[p] <= 5 && nblocks[p] >= 1 && nblocks[p] <= 3 &&
                    block + nblocks[p] <= weights.size(),
                "dflash_cpu::", op, ": projection ", p, " needs a route 0-5 and 1 to 3 blocks of the ",
                weights.size() - block, " weight blocks left");
    const auto route = static_cast<dflash_cpu::Route>(routes[p]);
    expect_route(op, route);
    const bool packed = route == dflash_cpu::Route::kAvx512Bf16 || route == dflash_cpu::Route::kAvx2Bf16;
    dflash_cpu::Projection& proj = out[p];
    proj = {route, static_cast<int>(nblocks[p]), {}, {}, {}};
    int64_t rows = 0;
    for (int i = 0; i < proj.nblocks; ++i, ++block) {
      const Tensor& w = weights[block];
      const OptTensor bias = biases.get(block);
      const auto index = static_cast<int64_t>(block);
      if (route == dflash_cpu::Route::kAmx) {
        expect_tile_block(op, "weights", index, w, block_rows[block], bias, depth[p]);
        proj.tiles[i] = {reinterpret_cast<const uint16_t*>(ptr<int16_t>(w)), block_rows[block], ptr<float>(bias)};
      } else {
        TORCH_CHECK(expect_weight_block(op, index, w, bias, depth[p], packed ? at::kShort : at::kFloat) ==
                        block_rows[block],
                    "dflash_cpu::", op, ": block_rows[", block, "] = ", block_rows[block], " must be weights[",
                    block, "]'s ", w.size(0), " rows");
        if (packed)
          proj.packed[i] = linear_block<uint16_t>(w, bias);
        else
          proj.blocks[i] = linear_block<float>(w, bias);
      }
      rows += block_rows[block];
    }
    TORCH_CHECK(rows == width[p], "dflash_cpu::", op, ": projection ", p, "'s blocks have ", rows,
                " rows in all; its output rows have ", width[p], " values");
  }
  return block;
}

// The L decoder layers of a forward (dflash_cpu::forward_layer, layer 0 first) of M = N * B rows: buffers h, x, delta
// [M, H], qkv [N, B, (nH + 2 kvH) D], attn [N, B, nH, D], gu [M, 2I], act [M, I] (contiguous); taps[t]: an [M, H]
// view (row stride) the residual stream entering layer tap_layers[t] is copied to (after that layer's input norm
// adds it up); caches [L, R, cap, kvH, D] contiguous; per layer l: input_norms[l] / post_norms[l] [H], their eps,
// q_norms[l] / k_norms[l] ([D] or None), qk_eps[l], scales[l], and routes / nblocks [4 L] with the weight blocks in
// layer order (the attention's rules: check_attention). Everything is checked before the first layer runs. 0, 1
// (attention scratch) or 2 (projection memory) as the kernel; a failing layer leaves the ones after it unrun.
int64_t forward_layers(const Tensor& h, const Tensor& x, const Tensor& delta, const Tensor& qkv, const Tensor& attn,
                       const Tensor& gu, const Tensor& act, at::TensorList taps, at::IntArrayRef tap_layers,
                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& lens, const OptTensor& rows,
                       const Tensor& cos, const Tensor& sin_signed, const OptTensor& tree_mask,
                       at::TensorList input_norms, at::ArrayRef<double> input_eps, at::TensorList post_norms,
                       at::ArrayRef<double> post_eps, const c10::List<OptTensor>& q_norms,
                       const c10::List<OptTensor>& k_norms, at::ArrayRef<double> qk_eps, at::ArrayRef<double> scales,
                       at::IntArrayRef routes, at::IntArrayRef nblocks, at::TensorList weights,
                       at::IntArrayRef block_rows, const c10::List<OptTensor>& biases) {
  const char* op = "forward_layers";
  const auto layers = static_cast<int64_t>(input_norms.size());
  expect_size(op, "the layer count (input_norms' length)", layers, 1);
  TORCH_CHECK(post_norms.size() == input_norms.size() && q_norms.size() == input_norms.size() &&
                  k_norms.size() == input_norms.size() && input_eps.size() == input_norms.size() &&
                  post_eps.size() == input_norms.size() && qk_eps.size() == input_norms.size() &&
                  scales.size() == input_norms.size(),
              "dflash_cpu::forward_layers: input_norms, post_norms, q_norms, k_norms, input_eps, post_eps, qk_eps and "
              "scales need one entry a layer; got ", input_norms.size(), ", ", post_norms.size(), ", ", q_norms.size(),
              ", ", k_norms.size(), ", ", input_eps.size(), ", ", post_eps.size(), ", ", qk_eps.size(), ", ",
              scales.size());
  TORCH_CHECK(routes.size() == static_cast<size_t>(4 * layers) && nblocks.size() == routes.size(),
              "dflash_cpu::forward_layers: routes and nblocks need four entries a layer (", 4 * layers, "); got ",
              routes.size(), " and ", nblocks.size());
  TORCH_CHECK(weights.size() == block_rows.size() && weights.size() == biases.size(),
              "dflash_cpu::forward_layers: one block_rows and one bias (or None) a weight block");
  expect(op, "h", h, at::kFloat, {kAny, kAny});
  const int64_t m = h.size(0), hidden = h.size(1);
  expect_size(op, "h's rows M", m, 1);
  expect(op, "x", x, at::kFloat, {m, hidden});
  expect(op, "delta", delta, at::kFloat, {m, hidden});
  expect(op, "attn", attn, at::kFloat, {kAny, kAny, kAny, kAny});
  const int64_t n = attn.size(0), b = attn.size(1), nh = attn.size(2), d = attn.size(3);
  TORCH_CHECK(n * b == m, "dflash_cpu::forward_layers: attn's ", n, " x ", b, " rows must be h's ", m, " rows");
  expect(op, "k_cache", k_cache, at::kFloat, {layers, kAny, kAny, kAny, d});
  expect(op, "v_cache", v_cache, at::kFloat, k_cache.sizes());
  const int64_t kvh = k_cache.size(3);
  expect(op, "qkv", qkv, at::kFloat, {n, b, (nh + 2 * kvh) * d});
  expect(op, "gu", gu, at::kFloat, {m, kAny});
  const int64_t inter = half_width(op, "gu", gu);
  expect(op, "act", act, at::kFloat, {m, inter});
  TORCH_CHECK(tap_layers.size() == taps.size(), "dflash_cpu::forward_layers: one tap_layers entry a tap; got ",
              tap_layers.size(), " for ", taps.size(), " taps");
  std::vector<std::vector<dflash_cpu::TapCopy>> tap_copies(layers);
  for (size_t t = 0; t < taps.size(); ++t) {
    expect(op, {"taps", static_cast<int64_t>(t)}, taps[t], at::kFloat, {m, hidden}, 1);
    TORCH_CHECK(tap_layers[t] >= 0 && tap_layers[t] < layers, "dflash_cpu::forward_layers: tap_layers[", t, "] = ",
                tap_layers[t], " must name one of the ", layers, " layers");
    tap_copies[tap_layers[t]].push_back({ptr<float>(taps[t]), taps[t].stride(0)});
  }
  const Tensor q = qkv.narrow(2, 0, nh * d).unflatten(2, {nh, d});
  const Tensor k = qkv.narrow(2, nh * d, kvh * d).unflatten(2, {kvh, d});
  const Tensor v = qkv.narrow(2, (nh + kvh) * d, kvh * d).unflatten(2, {kvh, d});
  // Layer 0's caches stand for every layer's: the same shape, at a fixed stride in the contiguous [L, ...] caches.
  const Tensor k_cache0 = k_cache.select(0, 0), v_cache0 = v_cache.select(0, 0);
  const AttentionIndex index = check_attention(op, q, k, v, k_cache0, v_cache0, lens, rows, std::nullopt,
                                               q_norms.get(0), k_norms.get(0), cos, sin_signed, tree_mask, true, attn);
  const dflash_cpu::BlockAttentionArgs attention =
      attention_args(q, k, v, k_cache0, v_cache0, index, rows, std::nullopt, std::nullopt, std::nullopt, 0.0, cos,
                     sin_signed, tree_mask, true, true, 1.0, attn);
  std::vector<dflash_cpu::LayerArgs> args(layers);
  size_t block = 0;
  for (int64_t l = 0; l < layers; ++l) {
    expect_values(op, {"input_norms", l}, input_norms[l], at::kFloat, hidden);
    expect_values(op, {"post_norms", l}, post_norms[l], at::kFloat, hidden);
    const OptTensor q_norm = q_norms.get(l), k_norm = k_norms.get(l);
    expect_values(op, {"q_norms", l}, q_norm, at::kFloat, d);
    expect_values(op, {"k_norms", l}, k_norm, at::kFloat, d);
    dflash_cpu::Projection proj[4];
    block = projections(op, routes.slice(4 * l, 4), nblocks.slice(4 * l, 4), weights, block_rows, biases, block,
                        {hidden, nh * d, hidden, inter}, {(nh + 2 * kvh) * d, hidden, 2 * inter, hidden}, proj);
    dflash_cpu::BlockAttentionArgs at = attention;
    at.k_cache += l * k_cache.stride(0);
    at.v_cache += l * v_cache.stride(0);
    at.q_norm = ptr<float>(q_norm);
    at.k_norm = ptr<float>(k_norm);
    at.eps = static_cast<float>(qk_eps[l]);
    at.scale = static_cast<float>(scales[l]);
    args[l] = {vector_kernels(), linear_fallback, ptr<float>(h), ptr<float>(x), ptr<float>(delta), ptr<float>(qkv),
               ptr<float>(attn), ptr<float>(gu), ptr<float>(act), m, hidden, inter, l == 0,
               ptr<float>(input_norms[l]), ptr<float>(post_norms[l]), static_cast<float>(input_eps[l]),
               static_cast<float>(post_eps[l]), tap_copies[l].data(), static_cast<int>(tap_copies[l].size()), at,
               proj[0], proj[1], proj[2], proj[3], at::get_num_threads()};
  }
  TORCH_CHECK(block == weights.size(), "dflash_cpu::forward_layers: the layers' projections use ", block, " of the ",
              weights.size(), " weight blocks given");
  for (const dflash_cpu::LayerArgs& a : args)
    if (const int status = dflash_cpu::forward_layer(a)) return status;
  return 0;
}

}  // namespace

TORCH_LIBRARY(dflash_cpu, m) {
  m.def("isas() -> str[]", &isas);
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, Tensor(b!) out, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("block_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor lens, "
        "Tensor? rows, Tensor? block_lens, Tensor? q_norm, Tensor? k_norm, float eps, Tensor cos, Tensor sin_signed, "
        "Tensor? tree_mask, bool causal, bool write_kv, float scale, Tensor(c!) out) -> int");
  m.def("inject_context_kv(Tensor k, Tensor v, Tensor k_norm, float eps, Tensor offsets, Tensor lens, Tensor? rows, "
        "Tensor cos, Tensor sin_signed, Tensor(a!) k_cache, Tensor(b!) v_cache) -> ()");
  m.def("build_tree(Tensor logits, Tensor lse, int k, Tensor anchor, Tensor? vocab_ids, Tensor(a!) tokens, "
        "Tensor(b!) parents, Tensor(c!) depths) -> int");
  m.def("tree_ancestor_mask(Tensor parents, Tensor(a!) mask) -> int");
  m.def("tree_walk_tokens(Tensor target, Tensor tokens, Tensor parents, Tensor(a!) path, Tensor(b!) accepted, "
        "Tensor(c!) bonus) -> ()");
  m.def("tree_graft_lookup(Tensor tree_tokens, Tensor tree_parents, Tensor tree_depths, Tensor tokens, "
        "Tensor lengths, int limit, int max_n, int min_n, Tensor(a!) out_tokens, Tensor(b!) out_parents, "
        "Tensor(c!) out_depths) -> ()");
  m.def("tree_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor path, Tensor accepted, Tensor start, "
        "Tensor rows) -> ()");
  for (const char* isa : {"avx512", "avx2", "avx512_bf16", "avx2_bf16"})
    m.def((std::string("linear_") + isa + "(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor(a!) out) -> ()")
              .c_str());
  for (const char* isa : {"avx512", "avx2"})
    m.def((std::string("argmax_int8_") + isa + "(Tensor x, Tensor codes, Tensor scales, Tensor bounds, "
           "float max_scale, Tensor packed, Tensor(a!) ids) -> int").c_str());
  m.def("amx_request() -> int", &amx_request);
  m.def("amx_pack(Tensor weight, Tensor(a!) tiles) -> int");
  m.def("amx_column_norms(Tensor tiles, int n, int k, Tensor(a!) norms) -> ()");
  m.def("amx_linear(Tensor x, Tensor[] tiles, int[] rows, Tensor?[] biases, Tensor(a!) out) -> int");
  m.def("amx_argmax(Tensor x, Tensor tiles, Tensor? bias, Tensor norms, Tensor(a!) ids, Tensor? int8_tiles=None, "
        "Tensor? scales=None, Tensor? int8_bounds=None, Tensor? code_norms=None, float max_scale=0) -> int");
  m.def("amx_int8() -> bool", &has_amx_int8);
  m.def("forward_layers(Tensor(a!) h, Tensor(b!) x, Tensor(c!) delta, Tensor(d!) qkv, Tensor(e!) attn, "
        "Tensor(f!) gu, Tensor(g!) act, Tensor(h!)[] taps, int[] tap_layers, Tensor(i!) k_cache, Tensor(j!) v_cache, "
        "Tensor lens, Tensor? rows, Tensor cos, Tensor sin_signed, Tensor? tree_mask, Tensor[] input_norms, "
        "float[] input_eps, Tensor[] post_norms, float[] post_eps, Tensor?[] q_norms, Tensor?[] k_norms, "
        "float[] qk_eps, float[] scales, int[] routes, int[] nblocks, Tensor[] weights, int[] block_rows, "
        "Tensor?[] biases) -> int");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("block_attention", &block_attention);
  m.impl("inject_context_kv", &inject_context_kv);
  m.impl("build_tree", &build_tree);
  m.impl("tree_ancestor_mask", &tree_ancestor_mask);
  m.impl("tree_walk_tokens", &tree_walk_tokens);
  m.impl("tree_graft_lookup", &tree_graft_lookup);
  m.impl("tree_compact", &tree_compact);
  m.impl("linear_avx512", &linear<&dflash_cpu::kAvx512, float>);
  m.impl("linear_avx2", &linear<&dflash_cpu::kAvx2, float>);
  m.impl("linear_avx512_bf16", &linear<&dflash_cpu::kAvx512, uint16_t>);
  m.impl("linear_avx2_bf16", &linear<&dflash_cpu::kAvx2, uint16_t>);
  m.impl("argmax_int8_avx512", &argmax_int8<&dflash_cpu::kAvx512>);
  m.impl("argmax_int8_avx2", &argmax_int8<&dflash_cpu::kAvx2>);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_column_norms", &amx_column_norms);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_argmax", &amx_argmax);
  m.impl("forward_layers", &forward_layers);
}
