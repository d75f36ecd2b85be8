// torch.ops.dflash_cpu.*: the native CPU kernels of dflash_cpu.h as torch ops (the one file here with torch
// headers). Each op builds its kernel's argument struct from the tensors; the Python wrappers
// (dflash_kernels/cpu/native.py, linear.py, forward.py) check every extent and index before they call, so the
// only checks here are the dtypes that data_ptr<T>() enforces.
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
#include <cstdlib>
#include <cstring>
#include <optional>
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

// x [rows, H] with a row stride (unit stride along H).
void add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, const Tensor& out, double eps) {
  vector_kernels()->add_rms_norm({ptr<float>(x), x.stride(0), ptr<float>(residual), ptr<float>(weight),
                                  ptr<float>(out), x.size(0), x.size(1), static_cast<float>(eps),
                                  at::get_num_threads()});
}

// gate_up [rows, 2I] with a row stride, out [rows, I].
void silu_mul(const Tensor& gate_up, const Tensor& out) {
  vector_kernels()->silu_mul({ptr<float>(gate_up), gate_up.stride(0), ptr<float>(out), gate_up.size(0),
                              out.size(1), at::get_num_threads()});
}

dflash_cpu::BlockAttentionArgs attention_args(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& lens,
                                              const OptTensor& rows, const OptTensor& block_lens,
                                              const OptTensor& q_norm, const OptTensor& k_norm, double eps,
                                              const Tensor& cos, const Tensor& sin_signed,
                                              const OptTensor& tree_mask, bool causal, bool write_kv, double scale,
                                              const Tensor& out) {
  return {ptr<float>(q), ptr<float>(k), ptr<float>(v), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
          v.stride(0), v.stride(1), ptr<float>(k_cache), ptr<float>(v_cache), k_cache.size(1), ptr<int64_t>(lens),
          ptr<int64_t>(rows), ptr<int64_t>(block_lens), ptr<float>(q_norm), ptr<float>(k_norm),
          static_cast<float>(eps), ptr<float>(cos), ptr<float>(sin_signed), ptr<int64_t>(tree_mask),
          tree_mask.has_value() ? tree_mask->size(2) : 0, causal, write_kv, ptr<float>(out), q.size(0), q.size(1),
          q.size(2), k.size(2), q.size(3), static_cast<float>(scale), at::get_num_threads()};
}

// q [N, B, nH, D], k / v [N, B, kvH, D] (heads contiguous), caches [R, cap, kvH, D]: BlockAttentionArgs. 0, or 1
// when the scratch memory cannot be allocated.
int64_t block_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& lens, const OptTensor& rows,
                        const OptTensor& block_lens, const OptTensor& q_norm, const OptTensor& k_norm, double eps,
                        const Tensor& cos, const Tensor& sin_signed, const OptTensor& tree_mask, bool causal,
                        bool write_kv, double scale, const Tensor& out) {
  return vector_kernels()->block_attention(attention_args(q, k, v, k_cache, v_cache, lens, rows, block_lens, q_norm,
                                                          k_norm, eps, cos, sin_signed, tree_mask, causal, write_kv,
                                                          scale, out));
}

// k / v [M, kvH, D] (rows at a stride), offsets [N + 1], lens / rows [N]: InjectKvArgs.
void inject_context_kv(const Tensor& k, const Tensor& v, const Tensor& k_norm, double eps, const Tensor& offsets,
                       const Tensor& lens, const OptTensor& rows, const Tensor& cos, const Tensor& sin_signed,
                       const Tensor& k_cache, const Tensor& v_cache) {
  vector_kernels()->inject_kv({ptr<float>(k), ptr<float>(v), k.stride(0), v.stride(0), ptr<float>(k_norm),
                               static_cast<float>(eps), ptr<int64_t>(offsets), ptr<int64_t>(lens),
                               ptr<int64_t>(rows), lens.numel(), ptr<float>(cos), ptr<float>(sin_signed),
                               ptr<float>(k_cache), ptr<float>(v_cache), k_cache.size(1), k.size(1), k.size(2),
                               at::get_num_threads()});
}

// logits [R, P, V] (unit stride along V), lse [R, P], tokens / parents / depths [R, T]: BuildTreeArgs' status.
int64_t build_tree(const Tensor& logits, const Tensor& lse, int64_t k, const Tensor& anchor,
                   const OptTensor& vocab_ids, const Tensor& tokens, const Tensor& parents, const Tensor& depths) {
  return dflash_cpu::build_tree({ptr<float>(logits), logits.stride(0), logits.stride(1), logits.size(0),
                                 logits.size(1), logits.size(2), ptr<float>(lse), k, tokens.size(1),
                                 ptr<int64_t>(anchor), ptr<int64_t>(vocab_ids), ptr<int64_t>(tokens),
                                 ptr<int64_t>(parents), ptr<int64_t>(depths)});
}

// parents [R, T] (row stride), mask [R, T, W]: the first bad request * T + node, or -1.
int64_t tree_ancestor_mask(const Tensor& parents, const Tensor& mask) {
  return dflash_cpu::tree_ancestor_mask(ptr<int64_t>(parents), parents.stride(0), parents.size(0),
                                        parents.size(1), mask.size(2), ptr<int64_t>(mask));
}

// target / tokens / parents [R, T] (row strides), path [R, B], accepted / bonus [R]: TreeWalkArgs.
void tree_walk_tokens(const Tensor& target, const Tensor& tokens, const Tensor& parents, const Tensor& path,
                      const Tensor& accepted, const Tensor& bonus) {
  dflash_cpu::tree_walk_tokens({ptr<int64_t>(target), target.stride(0), ptr<int64_t>(tokens), tokens.stride(0),
                                ptr<int64_t>(parents), parents.stride(0), tokens.size(0), tokens.size(1),
                                path.size(1), ptr<int64_t>(path), ptr<int64_t>(accepted), ptr<int64_t>(bonus)});
}

// caches [L, Nb, cap, ...] contiguous, path [R, B] contiguous, accepted / start / rows [R]: TreeCompactArgs.
void tree_compact(const Tensor& k_cache, const Tensor& v_cache, const Tensor& path, const Tensor& accepted,
                  const Tensor& start, const Tensor& rows) {
  int64_t row_bytes = k_cache.element_size();
  for (int64_t d = 3; d < k_cache.dim(); ++d) row_bytes *= k_cache.size(d);
  dflash_cpu::tree_compact({static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()),
                            ptr<int64_t>(path), path.size(1), ptr<int64_t>(accepted), ptr<int64_t>(start),
                            ptr<int64_t>(rows), accepted.numel(), k_cache.size(0), k_cache.size(1),
                            k_cache.size(2), row_bytes});
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

// x [M, K] contiguous, up to three weight row blocks [N_i, K] (unit stride along K; fp32 for W = float, the
// bf16-packed int16 copies for W = uint16_t) and their biases (or None), out [M, sum N_i] contiguous; the kernels of
// the table `kernels`.
template <const dflash_cpu::VectorKernels* kernels, typename W>
void linear(const Tensor& x, at::TensorList weights, const c10::List<OptTensor>& biases, const Tensor& out) {
  TORCH_CHECK(weights.size() >= 1 && weights.size() <= 3 && biases.size() == weights.size(),
              "dflash_cpu::linear: 1 to 3 weight blocks, one bias (or None) each");
  // The extents the kernel's pointers walk, checked before any is read (data_ptr<T> checks the dtypes).
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.is_contiguous() && out.is_contiguous() && x.is_cpu() &&
                  out.is_cpu(),
              "dflash_cpu::linear: x [..., K] (K > 0) and out contiguous CPU tensors");
  const int64_t k = x.size(-1), rows = x.numel() / k;
  int64_t n = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    const OptTensor bias = biases.get(i);
    TORCH_CHECK(w.is_cpu() && w.dim() == 2 && w.size(1) == k && (w.stride(1) == 1 || k == 1) &&
                    (w.size(0) <= 1 || w.stride(0) >= k),
                "dflash_cpu::linear: weight block ", i, " must be [N, K=", k, "] with unit stride along K");
    TORCH_CHECK(!bias.has_value() || (bias->is_cpu() && bias->is_contiguous() && bias->numel() == w.size(0)),
                "dflash_cpu::linear: bias ", i, " must be contiguous with one value per row of its weight block");
    n += w.size(0);
  }
  TORCH_CHECK(out.numel() == rows * n, "dflash_cpu::linear: out must hold ", rows, " x ", n, " values");
  dflash_cpu::LinearBlockOf<W> blocks[3];
  for (size_t i = 0; i < weights.size(); ++i) blocks[i] = linear_block<W>(weights[i], biases.get(i));
  const dflash_cpu::LinearArgsOf<W> args{ptr<float>(x), rows, k, blocks, static_cast<int>(weights.size()),
                                         ptr<float>(out), at::get_num_threads()};
  if constexpr (std::is_same_v<W, float>)
    kernels->linear(args);
  else
    kernels->linear_bf16(args);
}

// 0 when the OS granted this process the AMX tile state.
int64_t amx_request() { return dflash_cpu::amx_request(); }

// weight [N, K] (unit stride along K) -> tiles (dflash_cpu::amx_pack): how many values are not bf16.
int64_t amx_pack(const Tensor& weight, const Tensor& tiles) {
  return dflash_cpu::amx_pack(ptr<float>(weight), weight.stride(0), weight.size(0), weight.size(1),
                              reinterpret_cast<uint16_t*>(ptr<int16_t>(tiles)), at::get_num_threads());
}

void amx_column_norms(const Tensor& tiles, int64_t n, int64_t k, const Tensor& norms) {
  dflash_cpu::amx_column_norms(reinterpret_cast<const uint16_t*>(ptr<int16_t>(tiles)), n, k, ptr<double>(norms),
                               at::get_num_threads());
}

dflash_cpu::AmxLinearArgs amx_linear_args(const Tensor& x, at::TensorList tiles, at::IntArrayRef rows,
                                          const c10::List<OptTensor>& biases, const Tensor& out) {
  TORCH_CHECK(tiles.size() >= 1 && tiles.size() <= 3 && rows.size() == tiles.size() && biases.size() == tiles.size(),
              "dflash_cpu::amx_linear: 1 to 3 tile blocks, their rows and one bias (or None) each");
  dflash_cpu::AmxLinearArgs a{ptr<float>(x), x.stride(0), x.size(0), x.size(1), {}, ptr<float>(out),
                              at::get_num_threads()};
  for (size_t i = 0; i < tiles.size(); ++i) {
    const OptTensor bias = biases.get(i);
    a.blocks[i] = {reinterpret_cast<const uint16_t*>(ptr<int16_t>(tiles[i])), rows[i], ptr<float>(bias)};
  }
  return a;
}

// x [M, K] (row stride, unit stride along K), tiles of up to three row blocks of rows[i] rows, out [M, sum rows]
// contiguous: 0, or -1 without memory for the split input rows.
int64_t amx_linear(const Tensor& x, at::TensorList tiles, at::IntArrayRef rows, const c10::List<OptTensor>& biases,
                   const Tensor& out) {
  return dflash_cpu::amx_linear(amx_linear_args(x, tiles, rows, biases, out));
}

// x [M, K] (row stride), the tiles and column norms [N] of one weight, ids [M]: the exactly computed (row, group)
// pairs, or -1 without memory.
int64_t amx_argmax(const Tensor& x, const Tensor& tiles, const OptTensor& bias, const Tensor& norms,
                   const Tensor& ids) {
  return dflash_cpu::amx_argmax({ptr<float>(x), x.stride(0), x.size(0), x.size(1),
                                 reinterpret_cast<const uint16_t*>(ptr<int16_t>(tiles)), norms.size(0),
                                 ptr<float>(bias), ptr<double>(norms), ptr<int64_t>(ids), at::get_num_threads()});
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

// The projections of forward_layer: routes[p] (dflash_cpu::Route) and nblocks[p] for p = q/k/v, o, gate/up, down;
// weights / block_rows / biases: every block in order (weights: AMX tiles on the AMX route, fp32 [n, K] else).
void projections(at::IntArrayRef routes, at::IntArrayRef nblocks, at::TensorList weights, at::IntArrayRef block_rows,
                 const c10::List<OptTensor>& biases, dflash_cpu::Projection* out) {
  TORCH_CHECK(routes.size() == 4 && nblocks.size() == 4, "dflash_cpu::forward_layer: four projections");
  size_t block = 0;
  for (size_t p = 0; p < 4; ++p) {
    TORCH_CHECK(routes[p] >= 0 && routes[p] <= 5 && nblocks[p] >= 1 && nblocks[p] <= 3 &&
                    block + nblocks[p] <= weights.size() && weights.size() == block_rows.size() &&
                    weights.size() == biases.size(),
                "dflash_cpu::forward_layer: a route 0-5 and 1 to 3 blocks a projection, one rows and bias a block");
    dflash_cpu::Projection& proj = out[p];
    proj = {static_cast<dflash_cpu::Route>(routes[p]), static_cast<int>(nblocks[p]), {}, {}, {}};
    for (int i = 0; i < proj.nblocks; ++i, ++block) {
      const OptTensor bias = biases.get(block);
      if (proj.route == dflash_cpu::Route::kAmx)
        proj.tiles[i] = {reinterpret_cast<const uint16_t*>(ptr<int16_t>(weights[block])), block_rows[block],
                         ptr<float>(bias)};
      else if (proj.route == dflash_cpu::Route::kAvx512Bf16 || proj.route == dflash_cpu::Route::kAvx2Bf16)
        proj.packed[i] = linear_block<uint16_t>(weights[block], bias);
      else
        proj.blocks[i] = linear_block<float>(weights[block], bias);
    }
  }
}

// One decoder layer (dflash_cpu::forward_layer): buffers h, x, delta [M, H], qkv [N, B, width], attn [N, B, nH, D],
// gu [M, 2I], act [M, I]; taps: [M, H] views (row stride) the residual stream is copied to after the input norm;
// the layer's caches, norms and projections. 0, 1 (attention scratch) or 2 (projection memory) as the kernel.
int64_t forward_layer(const Tensor& h, const Tensor& x, const Tensor& delta, const Tensor& qkv, const Tensor& attn,
                      const Tensor& gu, const Tensor& act, at::TensorList taps, const Tensor& k_cache,
                      const Tensor& v_cache, const Tensor& lens, const OptTensor& rows, const Tensor& cos,
                      const Tensor& sin_signed, const OptTensor& tree_mask, const Tensor& input_norm, double input_eps,
                      const Tensor& post_norm, double post_eps, const OptTensor& q_norm, const OptTensor& k_norm,
                      double qk_eps, double scale, bool first, at::IntArrayRef routes, at::IntArrayRef nblocks,
                      at::TensorList weights, at::IntArrayRef block_rows, const c10::List<OptTensor>& biases) {
  const int64_t nh = attn.size(2), kvh = k_cache.size(2), d = attn.size(3);
  const Tensor q = qkv.narrow(2, 0, nh * d).unflatten(2, {nh, d});
  const Tensor k = qkv.narrow(2, nh * d, kvh * d).unflatten(2, {kvh, d});
  const Tensor v = qkv.narrow(2, (nh + kvh) * d, kvh * d).unflatten(2, {kvh, d});
  std::vector<dflash_cpu::TapCopy> tap_copies;
  for (const Tensor& t : taps) tap_copies.push_back({ptr<float>(t), t.stride(0)});
  dflash_cpu::LayerArgs a{vector_kernels(), linear_fallback, ptr<float>(h), ptr<float>(x), ptr<float>(delta),
                          ptr<float>(qkv), ptr<float>(attn), ptr<float>(gu), ptr<float>(act), h.size(0), h.size(1),
                          act.size(1), first, ptr<float>(input_norm), ptr<float>(post_norm),
                          static_cast<float>(input_eps), static_cast<float>(post_eps), tap_copies.data(),
                          static_cast<int>(tap_copies.size()),
                          attention_args(q, k, v, k_cache, v_cache, lens, rows, std::nullopt, q_norm, k_norm, qk_eps,
                                         cos, sin_signed, tree_mask, true, true, scale, attn),
                          {}, {}, {}, {}, at::get_num_threads()};
  dflash_cpu::Projection proj[4];
  projections(routes, nblocks, weights, block_rows, biases, proj);
  a.qkv_proj = proj[0];
  a.o_proj = proj[1];
  a.gate_up_proj = proj[2];
  a.down_proj = proj[3];
  return dflash_cpu::forward_layer(a);
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
  m.def("tree_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor path, Tensor accepted, Tensor start, "
        "Tensor rows) -> ()");
  for (const char* isa : {"avx512", "avx2", "avx512_bf16", "avx2_bf16"})
    m.def((std::string("linear_") + isa + "(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor(a!) out) -> ()")
              .c_str());
  m.def("amx_request() -> int", &amx_request);
  m.def("amx_pack(Tensor weight, Tensor(a!) tiles) -> int");
  m.def("amx_column_norms(Tensor tiles, int n, int k, Tensor(a!) norms) -> ()");
  m.def("amx_linear(Tensor x, Tensor[] tiles, int[] rows, Tensor?[] biases, Tensor(a!) out) -> int");
  m.def("amx_argmax(Tensor x, Tensor tiles, Tensor? bias, Tensor norms, Tensor(a!) ids) -> int");
  m.def("forward_layer(Tensor(a!) h, Tensor(b!) x, Tensor(c!) delta, Tensor(d!) qkv, Tensor(e!) attn, "
        "Tensor(f!) gu, Tensor(g!) act, Tensor(h!)[] taps, Tensor(i!) k_cache, Tensor(j!) v_cache, Tensor lens, "
        "Tensor? rows, Tensor cos, Tensor sin_signed, Tensor? tree_mask, Tensor input_norm, float input_eps, "
        "Tensor post_norm, float post_eps, Tensor? q_norm, Tensor? k_norm, float qk_eps, float scale, bool first, "
        "int[] routes, int[] nblocks, Tensor[] weights, int[] block_rows, Tensor?[] biases) -> int");
}

TORCH_LIBRARY_IMPL(dflash_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("block_attention", &block_attention);
  m.impl("inject_context_kv", &inject_context_kv);
  m.impl("build_tree", &build_tree);
  m.impl("tree_ancestor_mask", &tree_ancestor_mask);
  m.impl("tree_walk_tokens", &tree_walk_tokens);
  m.impl("tree_compact", &tree_compact);
  m.impl("linear_avx512", &linear<&dflash_cpu::kAvx512, float>);
  m.impl("linear_avx2", &linear<&dflash_cpu::kAvx2, float>);
  m.impl("linear_avx512_bf16", &linear<&dflash_cpu::kAvx512, uint16_t>);
  m.impl("linear_avx2_bf16", &linear<&dflash_cpu::kAvx2, uint16_t>);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_column_norms", &amx_column_norms);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_argmax", &amx_argmax);
  m.impl("forward_layer", &forward_layer);
}
