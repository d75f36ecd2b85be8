// CUDA kernels and the torch-free extern "C" launchers declared in dflash_kernels.h.
// Compiles with plain nvcc (no PyTorch): nvcc -std=c++17 -arch=sm_90 -Icsrc/include -c <this>.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>

#include "dflash_kernels.h"
#include "dflash_kernels_detail.h"

namespace {

using dflash::detail::argmax_better;

constexpr int kThreads = 256;           // verify_greedy block size (8 warps)
constexpr int kWarps = kThreads / 32;
constexpr int kMinPerThread = 4;        // do not split the vocabulary finer than this
constexpr int kBlocksPerSM = 4;         // target occupancy of the split grid
constexpr int kCommitThreads = 128;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

struct Plan {
  int64_t splits;  // vocabulary splits per row
  int64_t chunk;   // vocabulary entries per split
};

Plan make_plan(int64_t N, int64_t B, int64_t V, int sm_count) {
  const int64_t rows = N * B;
  const int64_t target = static_cast<int64_t>(sm_count > 0 ? sm_count : 132) * kBlocksPerSM;
  int64_t splits = (target + rows - 1) / rows;
  const int64_t max_splits = (V + kThreads * kMinPerThread - 1) / (kThreads * kMinPerThread);
  if (splits > max_splits) splits = max_splits;
  if (splits < 1) splits = 1;
  // Chunks are multiples of 8 elements (16 bytes for 16-bit types, 32 for fp32) so that the
  // vectorized path can use aligned 16-byte loads in every split.
  int64_t chunk = (V + splits - 1) / splits;
  chunk = (chunk + 7) / 8 * 8;
  return Plan{(V + chunk - 1) / chunk, chunk};
}

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Layout {
  size_t counters, vals, idx, total;  // byte offsets
};

Layout make_layout(int64_t N, int64_t B, const Plan& p) {
  const size_t parts = static_cast<size_t>(N * B * p.splits);
  Layout l;
  l.counters = 0;
  l.vals = align_up(sizeof(unsigned int) * static_cast<size_t>(N), 16);
  l.idx = align_up(l.vals + sizeof(float) * parts, 16);
  l.total = align_up(l.idx + sizeof(int64_t) * parts, 16);
  return l;
}

int resolve_sm_count(int sm_count) {
  if (sm_count > 0) return sm_count;
  int dev = 0, sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
  return sm > 0 ? sm : 132;
}

__device__ __forceinline__ void warp_argmax(float& v, int64_t& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, v, off);
    const int64_t oi = __shfl_down_sync(0xffffffffu, i, off);
    if (argmax_better(v, i, ov, oi)) {
      v = ov;
      i = oi;
    }
  }
}

// grid.x = N * B * splits. Block (row, split) computes the argmax of logits[row, split chunk];
// the last block of request n reduces the partials of its B rows and writes accepted/bonus.
template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kThreads)
verify_greedy_kernel(const T* __restrict__ logits, const int64_t* __restrict__ draft, int64_t B,
                     int64_t V, int64_t splits, int64_t chunk, int64_t* __restrict__ accepted,
                     int64_t* __restrict__ bonus, unsigned int* counters, float* pval,
                     int64_t* pidx) {
  __shared__ float s_val[kWarps];
  __shared__ int64_t s_idx[kWarps];
  __shared__ bool s_last;

  const int64_t bid = blockIdx.x;
  const int64_t split = bid % splits;
  const int64_t row = bid / splits;
  const int64_t n = row / B;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int64_t begin = split * chunk;
  const int64_t end = begin + chunk < V ? begin + chunk : V;
  const T* x = logits + row * V;

  // argmax_better is a strict total order (NaN first-index, then value, then index), so the
  // result does not depend on the order in which a thread or the reductions visit elements.
  float best = -__int_as_float(0x7f800000);  // -inf
  int64_t best_i = INT64_MAX;
  if (kVectorized) {
    // 16-byte loads: rows start 16-byte aligned and begin/end are multiples of kVec (host checks).
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
#pragma unroll 2
    for (int64_t i = begin + static_cast<int64_t>(tid) * kVec; i < end; i += kThreads * kVec) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + i));
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = to_float(e[k]);
        if (argmax_better(best, best_i, v, i + k)) {
          best = v;
          best_i = i + k;
        }
      }
    }
  } else {
#pragma unroll 4
    for (int64_t i = begin + tid; i < end; i += kThreads) {
      const float v = to_float(x[i]);
      if (argmax_better(best, best_i, v, i)) {
        best = v;
        best_i = i;
      }
    }
  }
  warp_argmax(best, best_i);
  if (lane == 0) {
    s_val[warp] = best;
    s_idx[warp] = best_i;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? s_val[lane] : -__int_as_float(0x7f800000);
    best_i = lane < kWarps ? s_idx[lane] : INT64_MAX;
    warp_argmax(best, best_i);
    if (lane == 0) {
      pval[row * splits + split] = best;
      pidx[row * splits + split] = best_i;
      __threadfence();
      const unsigned int prev = atomicAdd(&counters[n], 1u);
      s_last = (prev == static_cast<unsigned int>(B * splits - 1));
    }
  }
  __syncthreads();
  if (!s_last) return;

  // ---- tail: this block is the last one of request n ----
  __threadfence();
  for (int64_t j = warp; j < B; j += kWarps) {
    const int64_t base = (n * B + j) * splits;
    float v = -__int_as_float(0x7f800000);
    int64_t vi = INT64_MAX;
    for (int64_t s = lane; s < splits; s += 32) {
      const float ov = __ldcg(pval + base + s);
      const int64_t oi = __ldcg(reinterpret_cast<const long long*>(pidx) + base + s);
      if (argmax_better(v, vi, ov, oi)) {
        v = ov;
        vi = oi;
      }
    }
    warp_argmax(v, vi);
    __syncwarp();
    if (lane == 0) pidx[base] = vi;  // argmax of row (n, j)
  }
  __syncthreads();
  if (tid == 0) {
    const int64_t* d = draft + n * (B - 1);
    int64_t a = 0;
    while (a < B - 1 && d[a] == pidx[(n * B + a) * splits]) ++a;
    accepted[n] = a;
    bonus[n] = pidx[(n * B + a) * splits];
    counters[n] = 0u;  // leave the workspace ready for the next launch
  }
}

__global__ void commit_round_kernel(const int64_t* __restrict__ draft,
                                    const int64_t* __restrict__ accepted,
                                    const int64_t* __restrict__ bonus,
                                    const int64_t* __restrict__ stop, int64_t num_stop,
                                    int64_t stop_row_stride, const int64_t* __restrict__ max_lengths,
                                    int64_t* out, int64_t* lengths, int64_t* positions,
                                    int64_t* anchor, uint8_t* done, int64_t* num_new, int64_t R,
                                    int64_t B, int64_t C) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= R) return;
  if (done[r]) {
    num_new[r] = 0;
    return;
  }
  if (dflash::detail::commit_check(accepted[r], lengths[r], max_lengths[r], B, C) !=
      dflash::detail::kCommitOk) {
    done[r] = 1;  // invalid request: finish it, write nothing else (see dflash_kernels.h)
    num_new[r] = 0;
    return;
  }
  dflash::detail::commit_one(draft + r * (B - 1), accepted[r], bonus[r],
                             num_stop > 0 ? stop + r * stop_row_stride : nullptr, num_stop,
                             max_lengths[r], out + r * C, lengths + r, positions + r, anchor + r,
                             done + r, num_new + r);
}

template <typename T>
cudaError_t launch_verify(const void* logits, const int64_t* draft, int64_t N, int64_t B,
                          int64_t V, int64_t* accepted, int64_t* bonus, char* ws, const Plan& p,
                          const Layout& l, cudaStream_t stream) {
  const int64_t blocks = N * B * p.splits;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const bool vec = reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                   (V * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                   (p.chunk * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  auto kernel = vec ? verify_greedy_kernel<T, true> : verify_greedy_kernel<T, false>;
  kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), draft, B, V, p.splits, p.chunk, accepted, bonus,
      reinterpret_cast<unsigned int*>(ws + l.counters), reinterpret_cast<float*>(ws + l.vals),
      reinterpret_cast<int64_t*>(ws + l.idx));
  return cudaGetLastError();
}

}  // namespace

extern "C" {

size_t dflash_verify_greedy_workspace_bytes(int64_t N, int64_t B, int64_t V, int device_sm_count) {
  if (N <= 0 || B < 1 || V < 1) return 0;
  return make_layout(N, B, make_plan(N, B, V, resolve_sm_count(device_sm_count))).total;
}

int dflash_verify_greedy_cuda(const void* logits, dflash_dtype dtype, const int64_t* draft_tokens,
                              int64_t N, int64_t B, int64_t V, int64_t* accepted, int64_t* bonus,
                              void* workspace, size_t workspace_bytes, int device_sm_count,
                              cudaStream_t stream) {
  if (N < 0 || B < 1 || V < 1) return static_cast<int>(cudaErrorInvalidValue);
  if (N == 0) return static_cast<int>(cudaSuccess);
  if (!logits || !accepted || !bonus || !workspace || (B > 1 && !draft_tokens))
    return static_cast<int>(cudaErrorInvalidValue);
  const Plan p = make_plan(N, B, V, resolve_sm_count(device_sm_count));
  const Layout l = make_layout(N, B, p);
  if (workspace_bytes < l.total) return static_cast<int>(cudaErrorInvalidValue);
  char* ws = static_cast<char*>(workspace);
  switch (dtype) {
    case DFLASH_DTYPE_F32:
      return static_cast<int>(launch_verify<float>(logits, draft_tokens, N, B, V, accepted, bonus,
                                                   ws, p, l, stream));
    case DFLASH_DTYPE_F16:
      return static_cast<int>(launch_verify<__half>(logits, draft_tokens, N, B, V, accepted, bonus,
                                                    ws, p, l, stream));
    case DFLASH_DTYPE_BF16:
      return static_cast<int>(launch_verify<__nv_bfloat16>(logits, draft_tokens, N, B, V,
                                                           accepted, bonus, ws, p, l, stream));
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int dflash_commit_round_cuda(const int64_t* draft_tokens, const int64_t* accepted,
                             const int64_t* bonus, const int64_t* stop_tokens, int64_t num_stop,
                             int64_t stop_row_stride, const int64_t* max_lengths,
                             int64_t* out_tokens, int64_t* lengths, int64_t* positions,
                             int64_t* anchor, uint8_t* done, int64_t* num_new, int64_t R,
                             int64_t B, int64_t capacity, cudaStream_t stream) {
  if (R < 0 || B < 1 || capacity < 0 || num_stop < 0 || stop_row_stride < 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (R == 0) return static_cast<int>(cudaSuccess);
  if (!accepted || !bonus || !max_lengths || !lengths || !positions || !anchor || !done ||
      !num_new || (B > 1 && !draft_tokens) || (num_stop > 0 && !stop_tokens) ||
      (capacity > 0 && !out_tokens))
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t blocks = (R + kCommitThreads - 1) / kCommitThreads;
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  commit_round_kernel<<<static_cast<unsigned int>(blocks), kCommitThreads, 0, stream>>>(
      draft_tokens, accepted, bonus, stop_tokens, num_stop, stop_row_stride, max_lengths,
      out_tokens, lengths, positions, anchor, done, num_new, R, B, capacity);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
