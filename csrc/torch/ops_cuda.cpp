// CUDA implementations of torch.ops.dflash_ext.*: thin wrappers over the torch-free launchers of
// csrc/cuda/dflash_kernels.cu (the C ABI in dflash_kernels.h). Built only when torch is a CUDA
// build and nvcc exists. Uses c10/cuda only (not ATen/cuda/CUDAContext.h, which needs the
// cuBLAS/cuSPARSE headers).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <tuple>

#include "checks.h"
#include "dflash_kernels.h"

namespace dflash {
namespace torch_ops {
namespace {

// SM count per device, queried once (outside any CUDA-graph capture in practice: the first call).
int sm_count(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, 256> cache{};
  const size_t slot = static_cast<size_t>(device) & 255u;
  int sm = cache[slot].load(std::memory_order_relaxed);
  if (sm > 0) return sm;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, device));
  cache[slot].store(sm, std::memory_order_relaxed);
  return sm;
}

void check_launch(int err, const char* op) {
  TORCH_CHECK(err == 0, op, ": CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

std::tuple<at::Tensor, at::Tensor> verify_greedy_cuda(const at::Tensor& logits,
                                                      const at::Tensor& draft_tokens) {
  constexpr const char* op = "dflash_ext::verify_greedy";
  const VerifySizes s = check_verify_greedy(logits, draft_tokens);
  TORCH_CHECK(logits.is_cuda(), op, ": CUDA kernel got logits on ", logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  auto opts = draft_tokens.options();
  at::Tensor accepted = at::empty({s.N}, opts);
  at::Tensor bonus = at::empty({s.N}, opts);
  if (s.N == 0) return {accepted, bonus};
  dflash_dtype dt;
  switch (logits.scalar_type()) {
    case at::kFloat: dt = DFLASH_DTYPE_F32; break;
    case at::kHalf: dt = DFLASH_DTYPE_F16; break;
    default: dt = DFLASH_DTYPE_BF16; break;  // dtype already checked
  }
  const int sm = sm_count(logits.device().index());
  const size_t bytes = dflash_verify_greedy_workspace_bytes(s.N, s.B, s.V, sm);
  at::Tensor ws = at::empty({static_cast<int64_t>(bytes)}, opts.dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // The N completion counters sit at the start of the workspace and must start at zero.
  C10_CUDA_CHECK(cudaMemsetAsync(ws.mutable_data_ptr(), 0, sizeof(unsigned int) * s.N, stream));
  check_launch(dflash_verify_greedy_cuda(logits.const_data_ptr(), dt,
                                         draft_tokens.const_data_ptr<int64_t>(), s.N, s.B, s.V,
                                         accepted.mutable_data_ptr<int64_t>(),
                                         bonus.mutable_data_ptr<int64_t>(), ws.mutable_data_ptr(),
                                         bytes, sm, stream),
               op);
  return {accepted, bonus};
}

at::Tensor commit_round_cuda(const at::Tensor& draft_tokens, const at::Tensor& accepted,
                             const at::Tensor& bonus, const at::Tensor& stop_tokens,
                             const at::Tensor& max_lengths, at::Tensor& out_tokens,
                             at::Tensor& lengths, at::Tensor& positions, at::Tensor& anchor,
                             at::Tensor& done) {
  constexpr const char* op = "dflash_ext::commit_round";
  const CommitSizes s = check_commit_round(draft_tokens, accepted, bonus, stop_tokens,
                                           max_lengths, out_tokens, lengths, positions, anchor,
                                           done);
  TORCH_CHECK(draft_tokens.is_cuda(), op, ": CUDA kernel got tensors on ", draft_tokens.device());
  const c10::cuda::CUDAGuard guard(draft_tokens.device());
  at::Tensor num_new = at::empty({s.R}, accepted.options());
  if (s.R == 0) return num_new;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(
      dflash_commit_round_cuda(
          draft_tokens.const_data_ptr<int64_t>(), accepted.const_data_ptr<int64_t>(),
          bonus.const_data_ptr<int64_t>(), stop_tokens.const_data_ptr<int64_t>(), s.S,
          s.stop_row_stride, max_lengths.const_data_ptr<int64_t>(),
          out_tokens.mutable_data_ptr<int64_t>(), lengths.mutable_data_ptr<int64_t>(),
          positions.mutable_data_ptr<int64_t>(), anchor.mutable_data_ptr<int64_t>(),
          reinterpret_cast<uint8_t*>(done.mutable_data_ptr<bool>()),
          num_new.mutable_data_ptr<int64_t>(), s.R, s.B, s.C, stream),
      op);
  return num_new;
}

}  // namespace
}  // namespace torch_ops
}  // namespace dflash

TORCH_LIBRARY_IMPL(dflash_ext, CUDA, m) {
  m.impl("verify_greedy", &dflash::torch_ops::verify_greedy_cuda);
  m.impl("commit_round", &dflash::torch_ops::commit_round_cuda);
}
