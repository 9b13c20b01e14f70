// Flash-decoding attention over the paged KV cache (one new query token per sequence).
//
// out[b, h] = softmax(q[b, h] . K[b, :len]^T * sm_scale) V[b, :len], len = context_lens[b] +
// len_offset (tokens in the cache including the new one; <= 0 gives zeros). Query head h
// uses kv head h / (H / KVH) (GQA: consecutive query heads share a kv head).
//
// Two kernels:
//  1. flash_decode_split_*: grid (num_splits, KVH * head_chunks, B), 128 threads (4 warps).
//     The sequence's cache blocks are cut into num_splits ranges of whole blocks; each thread
//     block runs an online softmax over its range for up to 8 query heads that share one kv
//     head, so every K/V row is read from memory once for all of them (GQA). Within the
//     thread block each warp takes every 4th token; a lane owns ceil(HD/32) consecutive dims
//     of q, k, v and of the accumulator, and scores are summed across the warp with shuffles.
//     K and V are dequantised in registers (fp8: e4m3 * block scale; q4: (code-8) * value
//     group scale or key channel scale). The 4 warps' states are merged in shared memory and the split writes its
//     unnormalised accumulator plus (running max m, sum of exp l) to float32 scratch.
//  2. flash_decode_reduce_*: grid (H, B): merges the splits with log-sum-exp rescaling,
//     out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s.
// Scores are kept in base 2 (q is pre-multiplied by sm_scale * log2(e)), so exp2f is used.
//
// Exact tail (kvgen/engine/kv/stage.py ExactTail; exact_dt >= 0): a token whose block holds a
// recent slot (recent_of[block] >= 0) is read from the exact rows, and row 0 of a block with a
// first-token slot (first_of[block] >= 0) from the sink (before the rows, as ExactTail.read);
// every other token from the quantized store. Layouts in kv_append.cu.
//
// Cache layout: see kv_append.cu. Requires head_dim <= 32 * DPL (DPL = 4 or 8, i.e. 128 or
// 256), chosen by ops.py.
#include "common.cuh"

#define KVG_FD_WARPS 4
#define KVG_FD_THREADS (KVG_FD_WARPS * 32)
#define KVG_FD_MAX_G 8  // query heads per thread block; more per kv head -> more head chunks

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

// x[i] = dequantised cache element d0 + i of (blk, k|v, off, kvh) for i < dpl; 0 past HD.
template <int FMT, int DPL>
__device__ __forceinline__ void kvg_fd_load(const DecodeArgs& a, i64 blk, int kv, int off, int kvh,
                                            int d0, int dpl, float (&x)[DPL]) {
  if (FMT == KVG_FMT_F32 || FMT == KVG_FMT_F16 || FMT == KVG_FMT_BF16) {
    const i64 base = kvg_fd_row(a, blk, kv, off, kvh, a.HD) + d0;
#pragma unroll
    for (int i = 0; i < DPL; ++i)
      x[i] = (i < dpl && d0 + i < a.HD) ? kvg_load<FMT>(a.cache, base + i) : 0.0f;  // FMT == dtype id
  } else if (FMT == KVG_FMT_FP8) {
    const u8* c = (const u8*)a.cache + kvg_fd_row(a, blk, kv, off, kvh, a.HD) + d0;
    const float s = ((const float*)a.cache_scale)[((blk * a.L + a.layer) * 2 + kv) * a.KVH + kvh];
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = (i < dpl && d0 + i < a.HD) ? kvg_e4m3_to_f32(c[i]) * s : 0.0f;
  } else {  // q4
    const u8* c = (const u8*)a.cache + kvg_fd_row(a, blk, kv, off, kvh, a.HD / 2);
    // values: a scale per token and group of `group` dims; keys: one per channel of the block
    const int per = kv ? a.group : 1;
    const u16* sc = kv ? (const u16*)a.cache_scale + (((blk * a.L + a.layer) * a.BS + off) * a.KVH + kvh) * (i64)(a.HD / a.group)
                       : (const u16*)a.key_scale + ((blk * a.L + a.layer) * a.KVH + kvh) * (i64)a.HD;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = d0 + i;
      if (i < dpl && d < a.HD) {
        const u32 byte = c[d >> 1];
        const int code = (int)((d & 1) ? (byte >> 4) : (byte & 15u));
        x[i] = (float)(code - 8) * kvg_f16_to_f32(sc[d / per]);
      } else {
        x[i] = 0.0f;
      }
    }
  }
}

// K and V of token (blk, off): from the exact tail where it holds them, else the store.
// Uniform across the warp (one token per warp).
template <int FMT, int DPL>
__device__ __forceinline__ void kvg_fd_load_kv(const DecodeArgs& a, i64 blk, int off, int kvh, int d0,
                                               int dpl, float (&kx)[DPL], float (&vx)[DPL]) {
  if (a.exact_dt >= 0) {
    const void* src = a.exact_rows;
    i64 base = -1, kv_stride = 0;  // element index of the K row, and V's distance from it
    const i64 first = off == 0 ? a.first_of[blk] : -1;
    if (first >= 0) {  // sink [slots, L, 2, KVH, HD]
      src = a.sink;
      base = ((first * a.L + a.layer) * 2 * a.KVH + kvh) * (i64)a.HD;
      kv_stride = (i64)a.KVH * a.HD;
    } else {
      const i64 slot = a.recent_of[blk];
      if (slot >= 0) {  // exact_rows [slots, L, 2, BS, KVH, HD]
        base = kvg_fd_row(a, slot, 0, off, kvh, a.HD);
        kv_stride = (i64)a.BS * a.KVH * a.HD;
      }
    }
    if (base >= 0) {
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const bool ok = i < dpl && d0 + i < a.HD;
        kx[i] = ok ? kvg_load_dt(src, base + d0 + i, a.exact_dt) : 0.0f;
        vx[i] = ok ? kvg_load_dt(src, base + kv_stride + d0 + i, a.exact_dt) : 0.0f;
      }
      return;
    }
  }
  kvg_fd_load<FMT, DPL>(a, blk, 0, off, kvh, d0, dpl, kx);
  kvg_fd_load<FMT, DPL>(a, blk, 1, off, kvh, d0, dpl, vx);
}

template <int FMT, int QT, int DPL>
__device__ void kvg_decode_split(const DecodeArgs& a) {
  __shared__ float s_m[KVG_FD_WARPS][KVG_FD_MAX_G];
  __shared__ float s_l[KVG_FD_WARPS][KVG_FD_MAX_G];
  __shared__ float s_acc[KVG_FD_WARPS][KVG_FD_MAX_G][DPL * 32];

  const int split = blockIdx.x, b = blockIdx.z;
  const int G = a.H / a.KVH;  // query heads per kv head
  const int chunks = (G + KVG_FD_MAX_G - 1) / KVG_FD_MAX_G;
  const int kvh = blockIdx.y / chunks;
  const int h0 = kvh * G + (blockIdx.y % chunks) * KVG_FD_MAX_G;  // first query head here
  const int ng = min(KVG_FD_MAX_G, kvh * G + G - h0);              // query heads here
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int dpl = (a.HD + 31) >> 5;  // dims per lane (<= DPL)
  const int d0 = lane * dpl;

  // This split's token range [t0, t1): whole cache blocks, the same count for every split.
  int len = a.context_lens[b] + a.len_offset;
  len = min(len, a.max_blocks * a.BS);  // never read past the block table
  int t0, t1;
  kvg_split_range(len, a.BS, a.num_splits, split, &t0, &t1);

  float qr[KVG_FD_MAX_G][DPL];
  float m[KVG_FD_MAX_G], l[KVG_FD_MAX_G], acc[KVG_FD_MAX_G][DPL];
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g) {
    m[g] = KVG_NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const bool ok = g < ng && i < dpl && d0 + i < a.HD;
      qr[g][i] = ok ? kvg_load<QT>(a.q, ((i64)b * a.H + h0 + g) * a.HD + d0 + i) * a.qk_scale : 0.0f;
      acc[g][i] = 0.0f;
    }
  }

  for (int t = t0 + warp; t < t1; t += KVG_FD_WARPS) {
    const int id = a.block_tables[(i64)b * a.max_blocks + t / a.BS];
    if (id < 0) continue;  // not expected inside len; warp-uniform, so shuffles stay safe
    const int off = t % a.BS;
    float kx[DPL], vx[DPL];
    kvg_fd_load_kv<FMT, DPL>(a, id, off, kvh, d0, dpl, kx, vx);
#pragma unroll
    for (int g = 0; g < KVG_FD_MAX_G; ++g) {
      if (g < ng) {  // uniform across the warp
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) s += qr[g][i] * kx[i];
        s = kvg_warp_sum(s);
        // Online softmax: rescale the running sums to the new max (exp2f(-inf) = 0 at start).
        const float mn = fmaxf(m[g], s);
        const float alpha = exp2f(m[g] - mn);
        const float p = exp2f(s - mn);
        l[g] = l[g] * alpha + p;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * alpha + p * vx[i];
        m[g] = mn;
      }
    }
  }

  // Merge the warps (each saw every 4th token) in shared memory.
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g) {
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i)
      if (i < dpl) s_acc[warp][g][d0 + i] = acc[g][i];
  }
  __syncthreads();

  for (int e = threadIdx.x; e < ng * a.HD; e += blockDim.x) {
    const int g = e / a.HD, d = e % a.HD;
    float M = KVG_NEG_INF;
#pragma unroll
    for (int w = 0; w < KVG_FD_WARPS; ++w) M = fmaxf(M, s_m[w][g]);
    float L = 0.0f, A = 0.0f;
    if (M != KVG_NEG_INF) {  // else no token in this split: m = -inf, l = 0, acc = 0
#pragma unroll
      for (int w = 0; w < KVG_FD_WARPS; ++w) {
        const float wgt = exp2f(s_m[w][g] - M);
        L += s_l[w][g] * wgt;
        A += s_acc[w][g][d] * wgt;
      }
    }
    const i64 o = ((i64)b * a.H + h0 + g) * a.num_splits + split;
    a.part_acc[o * a.HD + d] = A;
    if (d == 0) {
      a.part_ml[o * 2] = M;
      a.part_ml[o * 2 + 1] = L;
    }
  }
}

// Merge the splits of one (b, h): grid (H, B), 128 threads over head_dim.
template <int QT>
__device__ void kvg_decode_reduce(const float* part_acc, const float* part_ml, void* out, int H,
                                  int HD, int S) {
  const int h = blockIdx.x, b = blockIdx.y;
  const i64 o = ((i64)b * H + h) * S;
  float M = KVG_NEG_INF;
  for (int s = 0; s < S; ++s) M = fmaxf(M, part_ml[(o + s) * 2]);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float L = 0.0f, A = 0.0f;
    if (M != KVG_NEG_INF) {
      for (int s = 0; s < S; ++s) {
        const float w = exp2f(part_ml[(o + s) * 2] - M);  // empty split: exp2f(-inf) = 0
        L += part_ml[(o + s) * 2 + 1] * w;
        A += part_acc[(o + s) * HD + d] * w;
      }
    }
    kvg_store<QT>(out, ((i64)b * H + h) * HD + d, L > 0.0f ? A / L : 0.0f);
  }
}

// ---- entry points ---------------------------------------------------------------------
// flash_decode_split_<cache format>_<q dtype>_hd<32 * DPL>, flash_decode_reduce_<out dtype>.
#define KVG_SPLIT_PARAMS                                                                        \
  const void *q, const void *cache, const void *cache_scale, const void *key_scale,              \
      const int *block_tables, const int *context_lens, const void *exact_rows,                 \
      const i64 *recent_of, const void *sink, const i64 *first_of, float *part_acc,             \
      float *part_ml, int max_blocks, int len_offset, int H, int KVH, int HD, int L, int layer, \
      int BS, int group, int num_splits, int exact_dt, float qk_scale
#define KVG_SPLIT_ARGNAMES                                                                      \
  q, cache, cache_scale, key_scale, block_tables, context_lens, exact_rows, recent_of, sink,     \
      first_of, part_acc, part_ml, max_blocks, len_offset, H, KVH, HD, L, layer, BS, group,     \
      num_splits, exact_dt, qk_scale
#define KVG_SPLIT_ARGS \
  DecodeArgs { KVG_SPLIT_ARGNAMES }

#define KVG_DEFINE_SPLIT(NAME, FMT, QT, DPL)                                                  \
  extern "C" __global__ void __launch_bounds__(KVG_FD_THREADS) NAME(KVG_SPLIT_PARAMS) {        \
    kvg_decode_split<FMT, QT, DPL>(KVG_SPLIT_ARGS);                                           \
  }

#define KVG_DEFINE_SPLIT_Q(FMTNAME, FMT, DPL, HDNAME)                                         \
  KVG_DEFINE_SPLIT(flash_decode_split_##FMTNAME##_f32_##HDNAME, FMT, KVG_F32, DPL)            \
  KVG_DEFINE_SPLIT(flash_decode_split_##FMTNAME##_f16_##HDNAME, FMT, KVG_F16, DPL)            \
  KVG_DEFINE_SPLIT(flash_decode_split_##FMTNAME##_bf16_##HDNAME, FMT, KVG_BF16, DPL)

#define KVG_DEFINE_SPLIT_ALL(DPL, HDNAME)                     \
  KVG_DEFINE_SPLIT_Q(fp32, KVG_FMT_F32, DPL, HDNAME)          \
  KVG_DEFINE_SPLIT_Q(fp16, KVG_FMT_F16, DPL, HDNAME)          \
  KVG_DEFINE_SPLIT_Q(bf16, KVG_FMT_BF16, DPL, HDNAME)         \
  KVG_DEFINE_SPLIT_Q(fp8, KVG_FMT_FP8, DPL, HDNAME)           \
  KVG_DEFINE_SPLIT_Q(q4, KVG_FMT_Q4, DPL, HDNAME)

KVG_DEFINE_SPLIT_ALL(4, hd128)
KVG_DEFINE_SPLIT_ALL(8, hd256)

#define KVG_DEFINE_REDUCE(NAME, QT)                                                           \
  extern "C" __global__ void __launch_bounds__(128)                                            \
      NAME(const float* part_acc, const float* part_ml, void* out, int H, int HD, int S) {     \
    kvg_decode_reduce<QT>(part_acc, part_ml, out, H, HD, S);                                  \
  }

KVG_DEFINE_REDUCE(flash_decode_reduce_f32, KVG_F32)
KVG_DEFINE_REDUCE(flash_decode_reduce_f16, KVG_F16)
KVG_DEFINE_REDUCE(flash_decode_reduce_bf16, KVG_BF16)
