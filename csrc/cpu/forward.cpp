// The lean target's decoder layer as one call: the kernels of its op path (LeanTarget's layer loop on the "cpu"
// backend) in the same order on the same buffers, so the same bits, without a Python call per kernel
// (dflash_kernels.cpu.forward calls this once per layer). Torch-free: the fallback projection is a function the
// caller passes (bindings.cpp: torch's linear).
#include <cstring>

#include "dflash_cpu.h"

namespace dflash_cpu {
namespace {

// y [M, N] = x [M, K] W^T + b by the projection's route; 0, or 2 without memory.
int project(const LayerArgs& a, const Projection& p, const float* x, long K, float* y) {
  switch (p.route) {
    case Route::kAmx: {
      AmxLinearArgs args{x, K, a.M, K, {}, y, a.threads};
      for (int i = 0; i < p.nblocks; ++i) args.blocks[i] = p.tiles[i];
      return amx_linear(args) ? 2 : 0;
    }
    case Route::kAvx512:
    case Route::kAvx2:
      (p.route == Route::kAvx512 ? kAvx512 : kAvx2).linear({x, a.M, K, p.blocks, p.nblocks, y, a.threads});
      return 0;
    case Route::kAvx512Bf16:
    case Route::kAvx2Bf16:
      (p.route == Route::kAvx512Bf16 ? kAvx512 : kAvx2).linear_bf16({x, a.M, K, p.packed, p.nblocks, y, a.threads});
      return 0;
    case Route::kFallback:
      return a.fallback(x, a.M, K, p.blocks, p.nblocks, y) ? 2 : 0;
  }
  return 2;
}

}  // namespace

int forward_layer(const LayerArgs& a) {
  const VectorKernels& k = *a.kernels;
  const long H = a.hidden;
  k.add_rms_norm({a.first ? a.h : a.delta, H, a.first ? nullptr : a.h, a.input_norm, a.x, a.M, H, a.input_eps,
                  a.threads});
  for (int t = 0; t < a.ntaps; ++t)
    for (long r = 0; r < a.M; ++r) std::memcpy(a.taps[t].out + r * a.taps[t].ld, a.h + r * H, sizeof(float) * H);
  if (project(a, a.qkv_proj, a.x, H, a.qkv)) return 2;
  if (k.block_attention(a.attention)) return 1;
  const long attn_width = a.attention.nH * a.attention.D;
  if (project(a, a.o_proj, a.attn, attn_width, a.delta)) return 2;
  k.add_rms_norm({a.delta, H, a.h, a.post_norm, a.x, a.M, H, a.post_eps, a.threads});
  if (project(a, a.gate_up_proj, a.x, H, a.gu)) return 2;
  k.silu_mul({a.gu, 2 * a.inter, a.act, a.M, a.inter, a.threads});
  return project(a, a.down_proj, a.act, a.inter, a.delta);
}

}  // namespace dflash_cpu
