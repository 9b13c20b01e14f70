// common.cuh's conversion and quantisation helpers exported to the host as C functions, for
// tests/gpu/test_host_helpers.py to compare bit-exactly with torch through ctypes.
//
// A .cu file, not .cpp: the helpers are __host__ __device__ functions, so nvcc compiles this
// (the host half only ends up in the shared library); g++ alone does not know those keywords.
#include "common.cuh"

// y[i] = FN(x[i]) over n elements.
#define MAP(NAME, IN, OUT, FN) \
  void NAME(const IN* x, OUT* y, long n) { for (long i = 0; i < n; ++i) y[i] = FN(x[i]); }
// y[i] = FN(x[i], s[i]): a value and its (already computed) scale.
#define MAP2(NAME, OUT, FN) \
  void NAME(const float* x, const float* s, OUT* y, long n) {     \
    for (long i = 0; i < n; ++i) y[i] = FN(x[i], s[i]);            \
  }

extern "C" {
MAP(f32_to_f16, float, unsigned short, kvg_f32_to_f16)
MAP(f32_to_bf16, float, unsigned short, kvg_f32_to_bf16)
MAP(f32_to_e4m3, float, unsigned char, kvg_f32_to_e4m3)
MAP(f16_to_f32, unsigned short, float, kvg_f16_to_f32)
MAP(bf16_to_f32, unsigned short, float, kvg_bf16_to_f32)
MAP(e4m3_to_f32, unsigned char, float, kvg_e4m3_to_f32)
MAP2(fp8_quantize, unsigned char, kvg_fp8_quantize)
MAP2(q4_code, unsigned char, kvg_q4_code)

// The token range [t[0], t[1]) that split `split` of `num_splits` covers.
void split_range(int len, int bs, int num_splits, int split, int* t) {
  kvg_split_range(len, bs, num_splits, split, t, t + 1);
}
}
