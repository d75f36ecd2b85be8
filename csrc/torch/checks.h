// Argument checks shared by the CPU, Meta and CUDA implementations of the torch.ops.dflash_ext ops.
// Every failure is a c10::Error (RuntimeError in Python) whose message names the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace dflash {
namespace torch_ops {

inline void check_tensor(const at::Tensor& t, const char* op, const char* name,
                         at::ScalarType dtype, int64_t dim, const c10::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " (like the other ",
              "arguments), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

struct VerifySizes {
  int64_t N, B, V;
};

inline VerifySizes check_verify_greedy(const at::Tensor& logits, const at::Tensor& draft_tokens) {
  constexpr const char* op = "dflash_ext::verify_greedy";
  TORCH_CHECK(logits.defined(), op, ": logits is undefined");
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
              ": logits must be float32, float16 or bfloat16, got ", dt);
  check_tensor(logits, op, "logits", dt, 3, logits.device());
  const int64_t N = logits.size(0), B = logits.size(1), V = logits.size(2);
  TORCH_CHECK(B >= 1, op, ": logits must have at least one block position (B >= 1), got shape ",
              logits.sizes());
  TORCH_CHECK(V >= 1, op, ": logits must have a non-empty vocabulary (V >= 1), got shape ",
              logits.sizes());
  check_tensor(draft_tokens, op, "draft_tokens", at::kLong, 2, logits.device());
  TORCH_CHECK(draft_tokens.size(0) == N && draft_tokens.size(1) == B - 1, op,
              ": draft_tokens must have shape [N, B-1] = [", N, ", ", B - 1,
              "] for logits of shape ", logits.sizes(), ", got ", draft_tokens.sizes());
  return VerifySizes{N, B, V};
}

struct CommitSizes {
  int64_t R, B, C, S, stop_row_stride;
};

inline CommitSizes check_commit_round(const at::Tensor& draft_tokens, const at::Tensor& accepted,
                                      const at::Tensor& bonus, const at::Tensor& stop_tokens,
                                      const at::Tensor& max_lengths, const at::Tensor& out_tokens,
                                      const at::Tensor& lengths, const at::Tensor& positions,
                                      const at::Tensor& anchor, const at::Tensor& done) {
  constexpr const char* op = "dflash_ext::commit_round";
  TORCH_CHECK(draft_tokens.defined(), op, ": draft_tokens is undefined");
  const c10::Device dev = draft_tokens.device();
  check_tensor(draft_tokens, op, "draft_tokens", at::kLong, 2, dev);
  const int64_t R = draft_tokens.size(0), B = draft_tokens.size(1) + 1;
  auto check_vec = [&](const at::Tensor& t, const char* name, at::ScalarType dtype) {
    check_tensor(t, op, name, dtype, 1, dev);
    TORCH_CHECK(t.size(0) == R, op, ": ", name, " must have shape [R] = [", R,
                "] (R = draft_tokens.size(0)), got ", t.sizes());
  };
  check_vec(accepted, "accepted", at::kLong);
  check_vec(bonus, "bonus", at::kLong);
  check_vec(max_lengths, "max_lengths", at::kLong);
  check_vec(lengths, "lengths", at::kLong);
  check_vec(positions, "positions", at::kLong);
  check_vec(anchor, "anchor", at::kLong);
  check_vec(done, "done", at::kBool);
  check_tensor(out_tokens, op, "out_tokens", at::kLong, 2, dev);
  TORCH_CHECK(out_tokens.size(0) == R, op, ": out_tokens must have shape [R, capacity] with R = ",
              R, ", got ", out_tokens.sizes());
  TORCH_CHECK(stop_tokens.defined(), op, ": stop_tokens is undefined (pass an empty tensor)");
  TORCH_CHECK(stop_tokens.dim() == 1 || stop_tokens.dim() == 2, op,
              ": stop_tokens must be 1-D [S] or 2-D [R, S], got shape ", stop_tokens.sizes());
  check_tensor(stop_tokens, op, "stop_tokens", at::kLong, stop_tokens.dim(), dev);
  int64_t S, stride;
  if (stop_tokens.dim() == 2) {
    TORCH_CHECK(stop_tokens.size(0) == R, op, ": stop_tokens must have shape [S] or [R, S] with R = ",
                R, ", got ", stop_tokens.sizes());
    S = stop_tokens.size(1);
    stride = S;
  } else {
    S = stop_tokens.size(0);
    stride = 0;
  }
  // The mutated buffers must not overlap each other or the inputs.
  const at::Tensor* mutated[] = {&out_tokens, &lengths, &positions, &anchor, &done};
  const at::Tensor* all[] = {&draft_tokens, &accepted, &bonus,     &stop_tokens, &max_lengths,
                             &out_tokens,   &lengths,  &positions, &anchor,      &done};
  const char* names[] = {"draft_tokens", "accepted", "bonus",     "stop_tokens", "max_lengths",
                         "out_tokens",   "lengths",  "positions", "anchor",      "done"};
  // (Meta/fake tensors have no addresses: skipped.)
  for (int i = 0; i < 5 && dev.type() != c10::DeviceType::Meta; ++i) {
    const at::Tensor& m = *mutated[i];
    if (m.numel() == 0) continue;
    const char* mb = static_cast<const char*>(m.const_data_ptr());
    const char* me = mb + m.numel() * m.itemsize();
    for (int k = 0; k < 10; ++k) {
      const at::Tensor& o = *all[k];
      if (&o == &m || o.numel() == 0) continue;
      const char* ob = static_cast<const char*>(o.const_data_ptr());
      const char* oe = ob + o.numel() * o.itemsize();
      TORCH_CHECK(me <= ob || oe <= mb, op, ": ", names[5 + i], " overlaps ", names[k],
                  " in memory; the in/out buffers must be distinct");
    }
  }
  return CommitSizes{R, B, out_tokens.size(1), S, stride};
}

}  // namespace torch_ops
}  // namespace dflash
