// The native CPU kernels of the "cpu" backend (dflash_kernels.cpu.native, dflash_kernels.cpu.linear,
// dflash_kernels.cpu.forward): torch-free C++, one struct of arguments per kernel. bindings.cpp registers them as
// torch.ops.dflash_cpu.* and builds these structs from the tensors after checking every extent and index they
// address, so the kernels trust their arguments.
//
// The vector kernels are compiled once per instruction set, each in its own translation unit (isa_avx512.cpp,
// isa_avx2.cpp: a `#pragma GCC target` at the top), into a table of entry points (VectorKernels); bindings.cpp
// picks a table at load from what the CPU supports. The AMX kernels (linear_amx.cpp) likewise; the tree kernels
// (tree.cpp) are integer code for any x86-64.
#pragma once

#include <cmath>
#include <cstdint>

namespace dflash_cpu {

// torch.argmax's rule over values fed in index order: the first NaN, else the first maximum (the argmax kernels'
// per-group winners and their winner across groups). index -1: nothing taken yet.
struct ArgmaxWinner {
  float value = 0.f;
  long index = -1;
  // Takes value v at index i if it wins; false once a NaN is held (nothing later can win: stop feeding).
  bool take(float v, long i) {
    if (index >= 0 && std::isnan(value)) return false;
    if (index < 0 || std::isnan(v) || v > value) {
      value = v;
      index = i;
    }
    return true;
  }
};

// out[r] = w * (s * rstd(s)) with s = x[r] (+ residual[r], written back to residual); x rows at stride ldx,
// residual and out contiguous [rows, hidden].
struct RmsNormArgs {
  const float* x;
  long ldx;
  float* residual;  // null: no residual add
  const float* weight;
  float* out;
  long rows, hidden;
  float eps;
  int threads;
};

// out[r] = silu(gate) * up of rows [gate (inter) | up (inter)] at stride ld; out contiguous [rows, inter].
struct SiluMulArgs {
  const float* gate_up;
  long ld;
  float* out;
  long rows, inter;
  int threads;
};

// The largest head dim D of the attention kernels (norm_rope's per-head stack buffer, simd16.h);
// dflash_kernels.cpu.native.MAX_HEAD_DIM.
constexpr long kMaxHeadDim = 512;

// The block attention of the draft and verify steps (dflash_kernels.cpu.native.block_attention). q [N, B, nH, D],
// k / v [N, B, kvH, D]: rows at strides (sq_n, sq_b) etc., heads contiguous; caches [R, cap, kvH, D] contiguous;
// lens / rows / block_lens [N] (rows null: n; block_lens null: B); cos / sin_signed [N * B, D]; tree_mask null or
// [N, B, words] ancestor bits; out [N, B, nH, D] contiguous. write_kv: the block's K/V rows go to cache rows
// lens[n] + i (the verify step), else to a scratch copy (the draft step: its cache holds the context only).
// Block key j of request n is seen by query row i iff j < block_lens[n] and (tree: bit j of row i's mask;
// causal: j <= i; else always). The caller guarantees lens[n] (+ B with write_kv) <= cap, D <= 512, D % 16 == 0,
// 0 <= block_lens[n] <= B. NaN follows the definition's SDPA: a NaN (or +inf) score of query row i against any
// key j < lens[n] + block_lens[n], seen or masked, makes that row's output NaN; a NaN in a V row reaches every
// output its zero or non-zero weight multiplies.
struct BlockAttentionArgs {
  const float *q, *k, *v;
  long sq_n, sq_b, sk_n, sk_b, sv_n, sv_b;
  float *k_cache, *v_cache;
  long cap;
  const int64_t *lens, *rows, *block_lens;
  const float *q_norm, *k_norm;  // null: no per-head RMSNorm
  float eps;
  const float *cos, *sin_signed;
  const int64_t* tree_mask;
  long words;
  bool causal, write_kv;
  float* out;
  long N, B, nH, kvH, D;
  float scale;
  int threads;
};

// A draft layer's context rows into its cache (inject_context_kv's "cpu" body). Row m of request n (cu[n] <= m <
// cu[n + 1], cu non-decreasing from cu[0] = 0) goes to cache row rows[n] (null: n) at position lens[n] + m - cu[n],
// dropped at or past cap: K = RoPE(RMSNorm(k) * k_norm) with the tables' row m, V copied. k / v [M, kvH, D]: rows
// at strides sk / sv, heads contiguous; cos / sin_signed [cu[N], D]; caches [R, cap, kvH, D] contiguous.
struct InjectKvArgs {
  const float *k, *v;
  long sk, sv;
  const float* k_norm;
  float eps;
  const int64_t *cu, *lens, *rows;
  long N;
  const float *cos, *sin_signed;
  float *k_cache, *v_cache;
  long cap, kvH, D;
  int threads;
};

// One block of weight rows: n rows [n, K] at w with row stride ldw, and their bias (or null). W is float (the fp32
// weight in place) or uint16_t (a packed bf16 copy of a weight whose fp32 values are all bf16 values: the upper
// halves of their bits, widened to the same fp32 values in registers).
template <typename W>
struct LinearBlockOf {
  const W* w;
  long ldw, n;
  const float* b;
};
typedef LinearBlockOf<float> LinearBlock;
typedef LinearBlockOf<uint16_t> Bf16Block;

// y [M, N] = x [M, K] times the weight made of nblocks row blocks stacked in order (N = their total rows); x and y
// contiguous.
template <typename W>
struct LinearArgsOf {
  const float* x;
  long M, K;
  const LinearBlockOf<W>* blocks;
  int nblocks;
  float* y;
  int threads;
};
typedef LinearArgsOf<float> LinearArgs;
typedef LinearArgsOf<uint16_t> Bf16LinearArgs;

// ids [M] = the argmax over the N columns of y = x W^T as the fp32 kernel computes y from W's bf16-packed copy
// `packed` (linear_<isa>_bf16's bits; the first index among equal values, the first NaN if any), without computing
// most of y. A screen multiplies x by int8 codes of W (column j ~ scales[j] * codes[j], half the bytes of the
// packed copy); each screened value lies within ||x|| * bounds[g] + slack of the exact one for every column of
// 16-column group g (the derivation: dflash_kernels.cpu.linear.int8_screen; slack covers gradual underflow, with
// max_scale the largest scale), and only the groups whose upper bound reaches the row's best lower bound are
// computed exactly, by the fp32 kernel's own tile. A row with a non-finite input or screened value, or near
// overflow, is computed exactly whole. x rows at stride ldx; codes and packed [N, K], scales [N], bounds
// [ceil(N / 16)] contiguous.
struct Int8ArgmaxArgs {
  const float* x;
  long ldx, M, K;
  const int8_t* codes;
  const float* scales;
  const double* bounds;
  double max_scale;
  const uint16_t* packed;
  long N;
  int64_t* ids;
  int threads;
};

// One instruction set's build of the vector kernels. The status results: 0, or 1 (nothing computed) when the
// kernel's scratch memory cannot be allocated.
struct VectorKernels {
  const char* isa;
  void (*add_rms_norm)(const RmsNormArgs&);
  void (*silu_mul)(const SiluMulArgs&);
  int (*block_attention)(const BlockAttentionArgs&);
  void (*inject_kv)(const InjectKvArgs&);
  void (*linear)(const LinearArgs&);
  void (*linear_bf16)(const Bf16LinearArgs&);  // the same kernel (same bits) reading bf16-packed weights
  long (*argmax_int8)(const Int8ArgmaxArgs&);   // the (row, group) pairs computed exactly, or -1 without memory
};

extern const VectorKernels kAvx512;  // AVX-512F/BW/DQ/VL + FMA (isa_avx512.cpp)
extern const VectorKernels kAvx2;    // AVX2 + FMA (isa_avx2.cpp)

// ---- draft trees (tree.cpp; definitions: dflash_kernels.tree's references, reproduced bit for bit)

// z [R, P, V] fp32 (strides ldr, ldp; last dim contiguous), lse [R, P] (the log normalizer), K = min(T - 1, V)
// -> tokens / parents / depths [R, T] int64. Per row the K largest logits, by value desc then index asc, as
// log p = fp32(z - lse); then the best-first enumeration.
struct BuildTreeArgs {
  const float* z;
  long ldr, ldp, R, P, V;
  const float* lse;
  long K, T;
  const int64_t *anchor, *vocab_ids;  // vocab_ids null: token j is j
  int64_t *tokens, *parents, *depths;
};
// 0, 1 (nothing usable written) when a logit is NaN or +inf (the reference's order then follows torch.topk's NaN
// rule), 2 when its work memory cannot be allocated.
int build_tree(const BuildTreeArgs& a);

// parents [R, T] (row stride ldr) -> mask [R, T, W]: node i's words are its parent's plus bit i. Returns the first
// request * T + node whose parent is not an earlier node (-1 for node 0), or -1 when all are valid.
long tree_ancestor_mask(const int64_t* parents, long ldr, long R, long T, long W, int64_t* mask);

// tree_accept_greedy_tokens' walk: per request, from the root, the first child (in node order) whose token is the
// target's token at the current node, while one exists and the depth is below B - 1; the target's token where it
// stops is the bonus. target / tokens / parents [R, T] at row strides; path [R, B] (-1 past the accepted depth),
// accepted / bonus [R]. Reads only rows' own T entries, whatever the parents' values.
struct TreeWalkArgs {
  const int64_t* target;
  long ldt;
  const int64_t* tokens;
  long ldk;
  const int64_t* parents;
  long ldp, R, T, B;
  int64_t *path, *accepted, *bonus;
};
void tree_walk_tokens(const TreeWalkArgs& a);

// tree_graft_lookup: per request, the prompt lookup's continuation of tokens[r, :L] (L = lengths[r] clamped to
// [0, C]; suffix lengths max_n down to min_n, the latest recurrence, up to limit tokens) replaces the tree's last
// m nodes as a path (m the least with k - d(m) <= m, d(m) the continuation's leading nodes below T - m). in_* / out_*
// [R, T] at row strides (out_* contiguous), tokens [R, C] at row stride lds. Reads only the rows' own entries.
struct TreeGraftArgs {
  const int64_t *in_tokens, *in_parents, *in_depths;
  long ldt, ldp, ldd;
  const int64_t *tokens, *lengths;
  long lds, R, T, C, limit, max_n, min_n;
  int64_t *out_tokens, *out_parents, *out_depths;
};
void tree_graft_lookup(const TreeGraftArgs& a);

// tree_compact's moves: for request r and d <= accepted[r], row start[r] + path[r, d] of batch row rows[r] to row
// start[r] + d in every layer of both caches [L, Nb, cap, row_bytes] (contiguous); sources at or past cap and rows
// that stay are skipped. The caller guarantees d <= path[r, d] < path[r, d + 1] (a walk's path), so in depth order
// no move overwrites a later one's source.
struct TreeCompactArgs {
  char *k_cache, *v_cache;
  const int64_t* path;
  long ldp;
  const int64_t *accepted, *start, *rows;
  long R, L, Nb, cap, row_bytes;
};
void tree_compact(const TreeCompactArgs& a);

// ---- AMX (linear_amx.cpp): weights whose fp32 values are all bf16 values, packed once into AMX B tiles

// Linux grants a process the AMX tile state only on request; 0 = granted.
int amx_request();

// w [N, K] (row stride ldw) -> B tiles: per group of 16 output columns, per 32-deep step, [16 pairs][16 cols][2]
// (zero padded). Returns how many elements are not exactly bf16 (then the tiles are not the weight).
long amx_pack(const float* w, long ldw, long N, long K, uint16_t* tiles, int threads);

// norms [N] = each column's (weight row's) Euclidean norm, from its packed bf16 values, rounded up (the argmax
// screen's bounds).
void amx_column_norms(const uint16_t* tiles, long N, long K, double* norms, int threads);

// One packed row block: its tiles, rows n (0: none) and bias (or null).
struct AmxBlock {
  const uint16_t* tiles;
  long n;
  const float* b;
};

// y [M, N] = x [M, K] (row stride ldx) times the weight made of up to three packed row blocks, plus their biases.
// Returns 0, or -1 (nothing computed) when the split input rows cannot be allocated.
struct AmxLinearArgs {
  const float* x;
  long ldx, M, K;
  AmxBlock blocks[3];
  float* y;
  int threads;
};
int amx_linear(const AmxLinearArgs& a);

// An int8 screen for amx_argmax in place of its hi-part screen (AMX-INT8): a weight's int8 codes (column j ~
// scales[j] * codes[j], dflash_kernels.cpu.linear.int8_screen) as B tiles, per 16-column group and 64-deep step
// [16 quads][16 columns][4] (zero padded); per group the largest ||w_j - d_j|| + error terms (bounds) and the largest
// ||d_j|| (code_norms) of its columns, rounded up; max_scale the largest scale.
struct AmxInt8Screen {
  const int8_t* tiles;
  const float* scales;
  const double *bounds, *code_norms;
  double max_scale;
};

struct AmxArgmaxArgs {
  const float* x;
  long ldx, M, K;
  const uint16_t* tiles;
  long N;
  const float* b;
  const double* norms;
  int64_t* ids;
  int threads;
  const AmxInt8Screen* int8;  // null: the hi-part screen
};
// ids [M] = the argmax over the N columns of y = x W^T + b as amx_linear computes y (the first index among equal
// values, the first NaN if any), without computing most of y exactly (see linear_amx.cpp). Returns the (row,
// 16-column group) pairs computed exactly, or -1 without memory.
long amx_argmax(const AmxArgmaxArgs& a);

// ---- the lean target's decoder layer as one call (forward.cpp; dflash_kernels.cpu.forward)

// How a projection is computed, decided by the caller with dflash_kernels.cpu.linear's rule for these rows: the AMX
// tiles, the fp32 kernel of one instruction set on the fp32 weights or on their bf16-packed copies, or `fallback`
// (torch's linear, as F.linear computes it).
enum class Route : int { kAmx = 0, kAvx512 = 1, kAvx2 = 2, kFallback = 3, kAvx512Bf16 = 4, kAvx2Bf16 = 5 };

// y [M, sum n_i] = x [M, K] times the blocks (their biases added), contiguous: torch's linear of each block into its
// columns. Returns 0.
typedef int (*LinearFallback)(const float* x, long M, long K, const LinearBlock* blocks, int nblocks, float* y);

// One projection: up to three row blocks, as fp32 weights (kAvx512, kAvx2, kFallback), bf16-packed weights
// (kAvx512Bf16, kAvx2Bf16) or AMX tiles (kAmx).
struct Projection {
  Route route;
  int nblocks;
  LinearBlock blocks[3];
  Bf16Block packed[3];
  AmxBlock tiles[3];
};

// Where the residual stream is copied after the layer's input norm (the previous layer's output, a tapped layer):
// M rows of `hidden` floats at row stride ld.
struct TapCopy {
  float* out;
  long ld;
};

// One decoder layer of M = N * B rows: input RMSNorm (with the previous layer's residual add unless first), the
// taps, q/k/v projection, block attention (q / k / v inside qkv, out attn), o projection, post RMSNorm with the
// residual add, gate/up projection, silu * up, down projection (into delta). h, x, delta [M, hidden], qkv [M, width],
// attn [M, nH * D], gu [M, 2 * inter], act [M, inter]: contiguous buffers.
struct LayerArgs {
  const VectorKernels* kernels;  // the norms, the attention, silu * up
  LinearFallback fallback;
  float *h, *x, *delta, *qkv, *attn, *gu, *act;
  long M, hidden, inter;
  bool first;
  const float *input_norm, *post_norm;
  float input_eps, post_eps;
  const TapCopy* taps;
  int ntaps;
  BlockAttentionArgs attention;
  Projection qkv_proj, o_proj, gate_up_proj, down_proj;
  int threads;
};

// Returns 0, 1 when the attention's scratch memory cannot be allocated, 2 when a projection's cannot (the layer is
// then incomplete).
int forward_layer(const LayerArgs& a);

}  // namespace dflash_cpu
