// The vector kernels compiled for AVX-512 (F, BW, DQ, VL) + FMA: bindings.cpp runs them where the CPU has these.
// Every header is included before the target pragma, so only this file's own (internal) functions are compiled
// for AVX-512; the kernels themselves live in norm_silu.h, attention.h, linear_f32.h and argmax_int8.h.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <new>

#include "dflash_cpu.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,lzcnt,popcnt,f16c")
#define DFLASH_CPU_AVX512 1

#include "attention.h"
#include "linear_f32.h"
#include "argmax_int8.h"  // (after linear_f32.h: its tile)
#include "norm_silu.h"

const dflash_cpu::VectorKernels dflash_cpu::kAvx512 = {"avx512", add_rms_norm, silu_mul, block_attention, inject_kv,
  linear<float>, linear<uint16_t>, argmax_int8};
