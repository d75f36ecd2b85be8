// The vector kernels compiled for AVX2 + FMA (e.g. AMD Zen 2/3, which have no AVX-512): bindings.cpp runs them where
// the CPU has these and no AVX-512.
// Every header is included before the target pragma, so only this file's own (internal) functions are compiled
// for AVX2 + FMA; the kernels themselves live in norm_silu.h, attention.h, linear_f32.h and argmax_int8.h.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <new>

#include "dflash_cpu.h"

#pragma GCC target("avx2,fma,bmi,bmi2,lzcnt,popcnt,f16c")
#define DFLASH_CPU_AVX2 1

#include "attention.h"
#include "linear_f32.h"
#include "argmax_int8.h"  // (after linear_f32.h: its tile)
#include "norm_silu.h"

const dflash_cpu::VectorKernels dflash_cpu::kAvx2 = {"avx2", add_rms_norm, silu_mul, block_attention, inject_kv,
  linear<float>, linear<uint16_t>, argmax_int8};
