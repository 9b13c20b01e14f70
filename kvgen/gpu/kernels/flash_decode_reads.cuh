// flash_decode.cu's reads of the paged cache: the kernel's arguments, row addressing, the wide
// loads of K chunks and V dims for every store format, and the exact tail's lookup. Included
// by flash_decode.cu after common.cuh (ops.kernel_source pastes both in for NVRTC).
#pragma once

struct DecodeArgs {
  const void* q;            // [B, H, HD] in dtype QT
  const void* cache;        // kv (plain, fp8) or q (q4)
  const void* cache_scale;  // fp8: f32 [NB, L, 2, KVH]; q4: f16 values [NB, L, BS, KVH, HD/G]
  const void* key_scale;    // q4: f16 keys [NB, L, KVH, HD]
  const int* block_tables;  // [B, max_blocks]
  const int* context_lens;  // [B]
  const void* exact_rows;   // exact tail (see above); unused when exact_dt < 0
  const i64* recent_of;
  const void* sink;
  const i64* first_of;
  float* part_acc;          // [B, H, S, HD] unnormalised partial outputs
  float* part_ml;           // [B, H, S, 2] (running max m, sum of exp l), base 2
  int max_blocks, len_offset, H, KVH, HD, L, layer, BS, group, num_splits;
  int exact_dt;             // KVG_F32 / F16 / BF16 of exact_rows and sink; -1: no exact tail
  float qk_scale;           // sm_scale * log2(e)
};

__device__ __forceinline__ i64 kvg_fd_row(const DecodeArgs& a, i64 blk, int kv, int off, int kvh,
                                          int width) {
  return ((((blk * a.L + a.layer) * 2 + kv) * a.BS + off) * a.KVH + kvh) * (i64)width;
}

// Vector views for wide loads (alignas: no CUDA header needed, g++ builds them too).
struct alignas(8) kvg_fd_v2 { u32 x, y; };
struct alignas(16) kvg_fd_v4 { u32 x, y, z, w; };

// Raw bits of NB bytes at p (NB = 2, 4, 8 or 16; p aligned to NB) as 32-bit words, w[0]
// holding the lowest bytes: one load instruction instead of one per element.
template <int NB>
__device__ __forceinline__ void kvg_fd_bits(const void* p, u32 (&w)[(NB + 3) / 4]) {
  if constexpr (NB == 16) {
    const kvg_fd_v4 v = *(const kvg_fd_v4*)p;
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else if constexpr (NB == 8) {
    const kvg_fd_v2 v = *(const kvg_fd_v2*)p;
    w[0] = v.x;
    w[1] = v.y;
  } else if constexpr (NB == 4) {
    w[0] = *(const u32*)p;
  } else {
    w[0] = *(const u16*)p;
  }
}

// Every read below is one or two wide loads and none sits behind a branch of its own: ops.py
// requires HD % 8 == 0, so a K chunk of 8 dims and a lane's DPL dims of V are whole, aligned
// runs. (The first GPU run of this design had a narrow fallback beside each wide load; the
// branches kept ptxas from hoisting one load above the last one's use, so a lane had one load
// in flight and the kernel read KV at a third of the copy bandwidth.)

// The fp8 block scale of token rows (blk, k|v, kvh); 1 for the other formats.
template <int FMT>
__device__ __forceinline__ float kvg_fd_scale(const DecodeArgs& a, i64 blk, int kv, int kvh) {
  if constexpr (FMT == KVG_FMT_FP8)
    return ((const float*)a.cache_scale)[((blk * a.L + a.layer) * 2 + kv) * a.KVH + kvh];
  return 1.0f;
}

// A token's V row as an index into the store's rows of its width (kvg_fd_row / width, < 2^31:
// ops.py checks) and, for q4, its row of value scales: computed once by the lane that owns
// the token in the score pass and shuffled to the warp for the value pass, which so spends a
// few instructions per row on addressing instead of a division by BS and 64-bit products.
__device__ __forceinline__ int kvg_fd_vrow(const DecodeArgs& a, int blk, int off, int kvh) {
  return (((blk * a.L + a.layer) * 2 + 1) * a.BS + off) * a.KVH + kvh;
}
__device__ __forceinline__ int kvg_fd_vscale_row(const DecodeArgs& a, int blk, int off, int kvh) {
  return ((blk * a.L + a.layer) * a.BS + off) * a.KVH + kvh;
}

// x[i] = dequantised element e + i of the store (e: its index among the store's elements, a
// multiple of N), N = 8 (a K chunk) or DPL (a lane's V dims). s: the fp8 block scale. sc: q4's
// scales, from the run's first element on: K's per channel, N contiguous halves read in one load
// (CHANNELS); V's per token and group of `group` dims, the run's dims d0 .. d0 + N of the row.
template <int FMT, int N, bool CHANNELS>
__device__ __forceinline__ void kvg_fd_run(const DecodeArgs& a, i64 e, float s, const u16* sc, int d0,
                                           float (&x)[N]) {
  if constexpr (FMT == KVG_FMT_F32) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      u32 w[4];
      kvg_fd_bits<16>((const float*)a.cache + e + 4 * c, w);
#pragma unroll
      for (int i = 0; i < 4; ++i) x[4 * c + i] = kvg_u2f(w[i]);
    }
  } else if constexpr (FMT == KVG_FMT_F16 || FMT == KVG_FMT_BF16) {
    u32 w[N / 2];
    kvg_fd_bits<N * 2>((const u16*)a.cache + e, w);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const u16 h = (u16)(w[i / 2] >> (16 * (i & 1)));
      x[i] = FMT == KVG_FMT_F16 ? kvg_f16_to_f32(h) : kvg_bf16_to_f32(h);
    }
  } else if constexpr (FMT == KVG_FMT_FP8) {
    u32 w[N / 4];
    kvg_fd_bits<N>((const u8*)a.cache + e, w);
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = kvg_e4m3_to_f32((u8)(w[i / 4] >> (8 * (i & 3)))) * s;
  } else {  // q4: N codes, low nibble first
    u32 w[1];
    kvg_fd_bits<N / 2>((const u8*)a.cache + (e >> 1), w);
    if constexpr (CHANNELS) {
      u32 c[N / 2];
      kvg_fd_bits<N * 2>(sc, c);
#pragma unroll
      for (int i = 0; i < N; ++i)
        x[i] = (float)((int)((w[0] >> (4 * i)) & 15u) - 8) * kvg_f16_to_f32((u16)(c[i / 2] >> (16 * (i & 1))));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i)
        x[i] = (float)((int)((w[0] >> (4 * i)) & 15u) - 8) * kvg_f16_to_f32(sc[(d0 + i) / a.group]);
    }
  }
}

// Where the exact tail holds token (blk, off): its K row's element index in *src and V's distance
// from it; false when the token is read from the store (or there is no exact tail).
__device__ __forceinline__ bool kvg_fd_exact(const DecodeArgs& a, i64 blk, int off, int kvh, const void** src,
                                             i64* base, i64* kv_stride) {
  if (a.exact_dt < 0) return false;
  const i64 first = off == 0 ? a.first_of[blk] : -1;
  if (first >= 0) {  // sink [slots, L, 2, KVH, HD]
    *src = a.sink;
    *base = ((first * a.L + a.layer) * 2 * a.KVH + kvh) * (i64)a.HD;
    *kv_stride = (i64)a.KVH * a.HD;
    return true;
  }
  const i64 slot = a.recent_of[blk];
  if (slot < 0) return false;
  *src = a.exact_rows;  // [slots, L, 2, BS, KVH, HD]
  *base = kvg_fd_row(a, slot, 0, off, kvh, a.HD);
  *kv_stride = (i64)a.BS * a.KVH * a.HD;
  return true;
}

// Only fp8 and q4 stores have an exact tail; for the others the check compiles away.
template <int FMT>
__device__ __forceinline__ bool kvg_fd_exact_at(const DecodeArgs& a, i64 blk, int off, int kvh, const void** src,
                                                i64* base, i64* kv_stride) {
  if constexpr (FMT == KVG_FMT_FP8 || FMT == KVG_FMT_Q4) return kvg_fd_exact(a, blk, off, kvh, src, base, kv_stride);
  return false;
}
