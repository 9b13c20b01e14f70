// Shared helpers for the kvgen CUDA kernels (included by every .cu in this folder).
//
// No CUDA headers are included on purpose: NVRTC (CuPy RawModule) may run on a machine
// without the toolkit's cuda_fp16.h / cuda_fp8.h, and the software conversions below are
// also compiled for the host by tests/gpu/test_host_helpers.py and checked bit-exactly against
// torch. fp16, bf16 and fp8 values are passed around as their raw bits.
//
// Every conversion rounds to nearest, ties to even, like torch's casts and like
// __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) (the callers clamp to +-448 first).
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC compiles device code only and has the math builtins without headers.
#define KVG_HD __device__ __forceinline__
#else
#include <cstring>
#include <cmath>
#define KVG_HD __host__ __device__ __forceinline__
#endif

// Element types of the tensors the kernels see (template arguments; mirrored in ops.py).
#define KVG_F32 0
#define KVG_F16 1
#define KVG_BF16 2

// KV cache formats (template arguments; mirrored in ops.py).
#define KVG_FMT_F32 0
#define KVG_FMT_F16 1
#define KVG_FMT_BF16 2
#define KVG_FMT_FP8 3
#define KVG_FMT_Q4 4

#define KVG_FP8_MAX 448.0f
// -inf without <cmath>'s INFINITY (NVRTC has no such macro without headers).
#define KVG_NEG_INF kvg_u2f(0xFF800000u)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

KVG_HD u32 kvg_f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  u32 u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

KVG_HD float kvg_u2f(u32 u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// 2^k as a float for -126 <= k <= 127 (built from the exponent bits: exact).
KVG_HD float kvg_exp2i(int k) { return kvg_u2f((u32)(k + 127) << 23); }

// Round a >= 0 (finite) to a small float format with MB mantissa bits and exponent bias
// BIAS; returns the format's bits without the sign. No overflow handling (callers check).
template <int MB, int BIAS>
KVG_HD u32 kvg_round_small(float a) {
  const u32 u = kvg_f2u(a);
  const int e = (int)(u >> 23) - 127;  // unbiased exponent (f32 zero/subnormal: -127)
  if (e < 1 - BIAS) {
    // Below the target's smallest normal the spacing is fixed at 2^(1-BIAS-MB): scale by a
    // power of two (exact) and round to an integer with rintf (ties to even). A result of
    // 2^MB is the smallest normal's bit pattern, so the carry is right.
    return (u32)rintf(a * kvg_exp2i(BIAS - 1 + MB));
  }
  // Normal: drop the low 23-MB mantissa bits, ties to even; a carry into the exponent
  // field is the right result. Then rebias the exponent from 127 to BIAS.
  const u32 drop = 23 - MB;
  const u32 r = u + ((1u << (drop - 1)) - 1) + ((u >> drop) & 1u);
  return (r >> drop) - ((u32)(127 - BIAS) << MB);
}

// ---- fp16 -----------------------------------------------------------------------------
KVG_HD u16 kvg_f32_to_f16(float x) {
  const u32 sign = (kvg_f2u(x) >> 16) & 0x8000u;
  const float a = fabsf(x);
  if (!(a == a)) return 0x7E00u;                    // nan
  if (a >= 65520.0f) return (u16)(sign | 0x7C00u);  // rounds to inf (includes inf)
  return (u16)(sign | kvg_round_small<10, 15>(a));
}

KVG_HD float kvg_f16_to_f32(u16 h) {
#if defined(__CUDA_ARCH__)
  // The hardware conversion: exact like the code below (fp16 -> fp32 never rounds), one
  // instruction instead of a dozen on the flash-decode read path.
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const u32 sign = (u32)(h & 0x8000u) << 16;
  const u32 e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 0) {  // zero / subnormal: m * 2^-24 (exact)
    const float v = (float)m * kvg_exp2i(-24);
    return kvg_u2f(kvg_f2u(v) | sign);
  }
  if (e == 31) return kvg_u2f(sign | 0x7F800000u | (m << 13));  // inf / nan
  return kvg_u2f(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// ---- bf16 -----------------------------------------------------------------------------
KVG_HD u16 kvg_f32_to_bf16(float x) {
  const u32 u = kvg_f2u(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40u);  // quiet nan
  // bf16 shares f32's exponent: round the low 16 bits away, ties to even (torch's method).
  return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

KVG_HD float kvg_bf16_to_f32(u16 b) { return kvg_u2f((u32)b << 16); }

// ---- fp8 e4m3fn -----------------------------------------------------------------------
// x must already be clamped to [-448, 448] (or nan).
KVG_HD u8 kvg_f32_to_e4m3(float x) {
  const u32 sign = (kvg_f2u(x) >> 24) & 0x80u;
  const float a = fabsf(x);
  if (!(a == a)) return (u8)(sign | 0x7Fu);
  return (u8)(sign | kvg_round_small<3, 7>(a));
}

KVG_HD float kvg_e4m3_to_f32(u8 q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // sm_89+ converts e4m3 pairs in hardware; e4m3 -> fp16 -> fp32 is exact, as below.
  u32 h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)q));
  return kvg_f16_to_f32((u16)(h2 & 0xFFFFu));
#else
  const u32 sign = (u32)(q & 0x80u) << 24;
  const u32 e = (q >> 3) & 15u, m = q & 7u;
  if (e == 0) {  // zero / subnormal: m * 2^-9
    const float v = (float)m * kvg_exp2i(-9);
    return kvg_u2f(kvg_f2u(v) | sign);
  }
  if (e == 15 && m == 7) return kvg_u2f(sign | 0x7FC00000u);  // e4m3fn has no inf, only nan
  return kvg_u2f(sign | ((e + 120u) << 23) | (m << 20));
#endif
}

// fp8 quantize exactly as kvgen.engine.kv.quant.fp8_quantize: x / scale (IEEE division,
// 0 when scale == 0), clamp to +-448, round to e4m3.
KVG_HD u8 kvg_fp8_quantize(float x, float scale) {
  float y = scale > 0.0f ? x / scale : 0.0f;
  y = fminf(fmaxf(y, -KVG_FP8_MAX), KVG_FP8_MAX);
  return kvg_f32_to_e4m3(y);
}

// q4 code (0..15) exactly as quant.q4_quantize: clamp(rint(x / s), -8, 7) + 8, 8 where s == 0.
KVG_HD u32 kvg_q4_code(float x, float s) {
  if (!(s > 0.0f)) return 8u;
  const float r = fminf(fmaxf(rintf(x / s), -8.0f), 7.0f);
  return (u32)((int)r + 8);
}

// ---- flash-decode work split ------------------------------------------------------------
// Tokens [*t0, *t1) of split `split` out of num_splits for a sequence of len tokens in
// blocks of bs: every split gets the same number of whole cache blocks (the last ones may
// get fewer or none, then *t0 >= *t1), so a split never shares a cache block with another.
KVG_HD void kvg_split_range(int len, int bs, int num_splits, int split, int* t0, int* t1) {
  const int nblk = len > 0 ? (len + bs - 1) / bs : 0;
  const int per = (nblk + num_splits - 1) / num_splits;  // cache blocks per split
  *t0 = split * per * bs;
  *t1 = len < *t0 + per * bs ? len : *t0 + per * bs;
}

// ---- typed loads / stores of raw element bits -------------------------------------------
template <int T>
KVG_HD float kvg_load(const void* p, i64 i) {
  if (T == KVG_F32) return ((const float*)p)[i];
  if (T == KVG_F16) return kvg_f16_to_f32(((const u16*)p)[i]);
  return kvg_bf16_to_f32(((const u16*)p)[i]);
}

template <int T>
KVG_HD void kvg_store(void* p, i64 i, float v) {
  if (T == KVG_F32) ((float*)p)[i] = v;
  else if (T == KVG_F16) ((u16*)p)[i] = kvg_f32_to_f16(v);
  else ((u16*)p)[i] = kvg_f32_to_bf16(v);
}

// The same with the element type known only at run time (ExactTail's rows and first tokens are
// in the model's compute dtype, which the kernels' templates do not name). Warp-uniform branch.
KVG_HD float kvg_load_dt(const void* p, i64 i, int dt) {
  if (dt == KVG_F32) return ((const float*)p)[i];
  if (dt == KVG_F16) return kvg_f16_to_f32(((const u16*)p)[i]);
  return kvg_bf16_to_f32(((const u16*)p)[i]);
}

KVG_HD void kvg_store_dt(void* p, i64 i, float v, int dt) {
  if (dt == KVG_F32) ((float*)p)[i] = v;
  else if (dt == KVG_F16) ((u16*)p)[i] = kvg_f32_to_f16(v);
  else ((u16*)p)[i] = kvg_f32_to_bf16(v);
}

#if defined(__CUDACC__)
// Sum / max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float kvg_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float kvg_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max of non-negative values over the thread block (blockDim.x a multiple of 32, <= 1024);
// every thread gets it. `scratch` is __shared__ float[32]. Ends with a barrier, so scratch
// can be reused after.
__device__ __forceinline__ float kvg_block_max_nonneg(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = kvg_warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  float r = lane < nw ? scratch[lane] : 0.0f;  // 0 is neutral for non-negative values
  r = kvg_warp_max(r);
  __syncthreads();
  return r;
}
#endif
