// torch.ops.dflash_ext.*: schemas, CPU implementations and Meta (fake) implementations.
// The CUDA implementations are in ops_cuda.cpp (built only with a CUDA torch + nvcc).
// Light includes on purpose (no torch/extension.h): this TU is most of the CPU build time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "checks.h"
#include "dflash_kernels.h"
#include "dflash_kernels_detail.h"

namespace dflash {
namespace torch_ops {
namespace {

std::tuple<at::Tensor, at::Tensor> verify_greedy_cpu(const at::Tensor& logits,
                                                     const at::Tensor& draft_tokens) {
  const VerifySizes s = check_verify_greedy(logits, draft_tokens);
  TORCH_CHECK(logits.device().is_cpu(), "dflash_ext::verify_greedy: CPU kernel got logits on ",
              logits.device());
  auto opts = draft_tokens.options();
  at::Tensor accepted = at::empty({s.N}, opts);
  at::Tensor bonus = at::empty({s.N}, opts);
  if (s.N == 0) return {accepted, bonus};
  const int64_t rows = s.N * s.B, V = s.V, B = s.B;
  std::vector<int64_t> am(static_cast<size_t>(rows));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "dflash_verify_greedy_cpu", [&] {
    const scalar_t* x = logits.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 32768 / V);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        am[r] = dflash::detail::argmax_row(x + r * V, V,
                                           [](scalar_t v) { return static_cast<float>(v); });
    });
  });
  const int64_t* d = draft_tokens.const_data_ptr<int64_t>();
  int64_t* acc = accepted.mutable_data_ptr<int64_t>();
  int64_t* bon = bonus.mutable_data_ptr<int64_t>();
  for (int64_t n = 0; n < s.N; ++n) {
    const int64_t a = dflash::detail::accepted_prefix(am.data() + n * B, d + n * (B - 1), B);
    acc[n] = a;
    bon[n] = am[n * B + a];
  }
  return {accepted, bonus};
}

std::tuple<at::Tensor, at::Tensor> verify_greedy_meta(const at::Tensor& logits,
                                                      const at::Tensor& draft_tokens) {
  const VerifySizes s = check_verify_greedy(logits, draft_tokens);
  auto opts = draft_tokens.options();
  return {at::empty({s.N}, opts), at::empty({s.N}, opts)};
}

at::Tensor commit_round_cpu(const at::Tensor& draft_tokens, const at::Tensor& accepted,
                            const at::Tensor& bonus, const at::Tensor& stop_tokens,
                            const at::Tensor& max_lengths, at::Tensor& out_tokens,
                            at::Tensor& lengths, at::Tensor& positions, at::Tensor& anchor,
                            at::Tensor& done) {
  constexpr const char* op = "dflash_ext::commit_round";
  const CommitSizes s = check_commit_round(draft_tokens, accepted, bonus, stop_tokens,
                                           max_lengths, out_tokens, lengths, positions, anchor,
                                           done);
  TORCH_CHECK(draft_tokens.device().is_cpu(), op, ": CPU kernel got tensors on ",
              draft_tokens.device());
  at::Tensor num_new = at::empty({s.R}, accepted.options());
  const int64_t* d = draft_tokens.const_data_ptr<int64_t>();
  const int64_t* acc = accepted.const_data_ptr<int64_t>();
  const int64_t* bon = bonus.const_data_ptr<int64_t>();
  const int64_t* stop = stop_tokens.const_data_ptr<int64_t>();
  const int64_t* maxl = max_lengths.const_data_ptr<int64_t>();
  int64_t* out = out_tokens.mutable_data_ptr<int64_t>();
  int64_t* len = lengths.mutable_data_ptr<int64_t>();
  int64_t* pos = positions.mutable_data_ptr<int64_t>();
  int64_t* anc = anchor.mutable_data_ptr<int64_t>();
  uint8_t* dn = reinterpret_cast<uint8_t*>(done.mutable_data_ptr<bool>());
  int64_t* nn = num_new.mutable_data_ptr<int64_t>();
  // Value checks first (cheap on the host), so that a failure writes nothing.
  for (int64_t r = 0; r < s.R; ++r) {
    if (dn[r]) continue;
    switch (dflash::detail::commit_check(acc[r], len[r], maxl[r], s.B, s.C)) {
      case dflash::detail::kBadAccepted:
        TORCH_CHECK(false, op, ": accepted[", r, "] = ", acc[r], " is outside [0, B-1] = [0, ",
                    s.B - 1, "]");
      case dflash::detail::kBadLength:
        TORCH_CHECK(false, op, ": lengths[", r, "] = ", len[r],
                    " is outside [0, capacity] = [0, ", s.C, "] of out_tokens");
      case dflash::detail::kBadMaxLength:
        TORCH_CHECK(false, op, ": max_lengths[", r, "] = ", maxl[r],
                    " exceeds the capacity of out_tokens (", s.C, ")");
      default:
        break;
    }
  }
  for (int64_t r = 0; r < s.R; ++r) {
    if (dn[r]) {
      nn[r] = 0;
      continue;
    }
    dflash::detail::commit_one(d + r * (s.B - 1), acc[r], bon[r],
                               s.S > 0 ? stop + r * s.stop_row_stride : nullptr, s.S, maxl[r],
                               out + r * s.C, len + r, pos + r, anc + r, dn + r, nn + r);
  }
  return num_new;
}

at::Tensor commit_round_meta(const at::Tensor& draft_tokens, const at::Tensor& accepted,
                             const at::Tensor& bonus, const at::Tensor& stop_tokens,
                             const at::Tensor& max_lengths, at::Tensor& out_tokens,
                             at::Tensor& lengths, at::Tensor& positions, at::Tensor& anchor,
                             at::Tensor& done) {
  const CommitSizes s = check_commit_round(draft_tokens, accepted, bonus, stop_tokens,
                                           max_lengths, out_tokens, lengths, positions, anchor,
                                           done);
  return at::empty({s.R}, accepted.options());
}

}  // namespace
}  // namespace torch_ops
}  // namespace dflash

TORCH_LIBRARY(dflash_ext, m) {
  m.def(
      "verify_greedy(Tensor logits, Tensor draft_tokens) -> (Tensor accepted, Tensor bonus)");
  m.def(
      "commit_round(Tensor draft_tokens, Tensor accepted, Tensor bonus, Tensor stop_tokens, "
      "Tensor max_lengths, Tensor(a!) out_tokens, Tensor(b!) lengths, Tensor(c!) positions, "
      "Tensor(d!) anchor, Tensor(e!) done) -> Tensor num_new");
}

TORCH_LIBRARY_IMPL(dflash_ext, CPU, m) {
  m.impl("verify_greedy", &dflash::torch_ops::verify_greedy_cpu);
  m.impl("commit_round", &dflash::torch_ops::commit_round_cpu);
}

TORCH_LIBRARY_IMPL(dflash_ext, Meta, m) {
  m.impl("verify_greedy", &dflash::torch_ops::verify_greedy_meta);
  m.impl("commit_round", &dflash::torch_ops::commit_round_meta);
}

#ifdef DFLASH_PYTHON_MODULE
// A minimal Python module so that `import dflash_kernels._C` loads the library (the ops register
// themselves in torch.ops.dflash_ext at load time). No pybind11: it would double the build time.
#include <Python.h>

#ifndef DFLASH_WITH_CUDA
#define DFLASH_WITH_CUDA 0
#endif

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C",
                                   "dflash-kernels compiled ops (torch.ops.dflash_ext.*)", -1,
                                   nullptr};
  PyObject* mod = PyModule_Create(&def);
  if (mod == nullptr) return nullptr;
  if (PyModule_AddIntConstant(mod, "WITH_CUDA", DFLASH_WITH_CUDA) < 0 ||
      PyModule_AddIntConstant(mod, "ABI_VERSION", DFLASH_KERNELS_ABI_VERSION) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
#endif
