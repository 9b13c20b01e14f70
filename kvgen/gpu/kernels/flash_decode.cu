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
//     thread block each warp takes every 4th tile of 32 tokens. Scores: a lane per token, its
//     K row in 16-byte loads against q in shared memory, one warp max per head and tile (an
//     earlier design summed every token's dot product across the warp: five shuffles per
//     token and head, and on an H100 the kernel was bound by instruction issue at 17% of the
//     copy bandwidth). Values: a lane owns ceil(HD/32) consecutive dims of v and of the
//     accumulator, and the warp reads each V row of the tile in one pass. K and V are
//     dequantised in registers (fp8: e4m3 * block scale; q4: (code-8) * value group scale or
//     key channel scale). The 4 warps' states are merged in shared memory and the split writes
//     its unnormalised accumulator plus (running max m, sum of exp l) to float32 scratch.
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

// x[i] = dequantised cache element d0 + i of (blk, k|v, off, kvh) for i < n; 0 past n or HD.
// A full run of N (n == N, HD a multiple of N, d0 too) is contiguous and aligned, so it comes in
// one or two wide loads.
template <int FMT, int N>
__device__ __forceinline__ void kvg_fd_load(const DecodeArgs& a, i64 blk, int kv, int off, int kvh,
                                            int d0, int n, float (&x)[N]) {
  const bool wide = n == N && a.HD % N == 0;
  if (FMT == KVG_FMT_F32 || FMT == KVG_FMT_F16 || FMT == KVG_FMT_BF16) {
    const i64 base = kvg_fd_row(a, blk, kv, off, kvh, a.HD) + d0;
    if (wide && FMT == KVG_FMT_F32) {
#pragma unroll
      for (int c = 0; c < N / 4; ++c) {
        u32 w[4];
        kvg_fd_bits<16>((const float*)a.cache + base + 4 * c, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) x[4 * c + i] = kvg_u2f(w[i]);
      }
    } else if (wide) {  // fp16 / bf16: N halves = 2N bytes (8 or 16)
      u32 w[N / 2];
      kvg_fd_bits<N * 2>((const u16*)a.cache + base, w);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const u16 h = (u16)(w[i / 2] >> (16 * (i & 1)));
        x[i] = FMT == KVG_FMT_F16 ? kvg_f16_to_f32(h) : kvg_bf16_to_f32(h);
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i)
        x[i] = (i < n && d0 + i < a.HD) ? kvg_load<FMT>(a.cache, base + i) : 0.0f;  // FMT == dtype id
    }
  } else if (FMT == KVG_FMT_FP8) {
    const u8* c = (const u8*)a.cache + kvg_fd_row(a, blk, kv, off, kvh, a.HD) + d0;
    const float s = ((const float*)a.cache_scale)[((blk * a.L + a.layer) * 2 + kv) * a.KVH + kvh];
    if (wide) {  // N bytes (4 or 8)
      u32 w[N / 4];
      kvg_fd_bits<N>(c, w);
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = kvg_e4m3_to_f32((u8)(w[i / 4] >> (8 * (i & 3)))) * s;
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) x[i] = (i < n && d0 + i < a.HD) ? kvg_e4m3_to_f32(c[i]) * s : 0.0f;
    }
  } else {  // q4
    const u8* c = (const u8*)a.cache + kvg_fd_row(a, blk, kv, off, kvh, a.HD / 2);
    // values: a scale per token and group of `group` dims; keys: one per channel of the block
    const int per = kv ? a.group : 1;
    const u16* sc = kv ? (const u16*)a.cache_scale + (((blk * a.L + a.layer) * a.BS + off) * a.KVH + kvh) * (i64)(a.HD / a.group)
                       : (const u16*)a.key_scale + ((blk * a.L + a.layer) * a.KVH + kvh) * (i64)a.HD;
    if (wide) {  // N nibbles = N / 2 bytes (2 or 4), low nibble first
      u32 w[1];
      kvg_fd_bits<N / 2>(c + (d0 >> 1), w);
#pragma unroll
      for (int i = 0; i < N; ++i)
        x[i] = (float)((int)((w[0] >> (4 * i)) & 15u) - 8) * kvg_f16_to_f32(sc[(d0 + i) / per]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int d = d0 + i;
        if (i < n && d < a.HD) {
          const u32 byte = c[d >> 1];
          const int code = (int)((d & 1) ? (byte >> 4) : (byte & 15u));
          x[i] = (float)(code - 8) * kvg_f16_to_f32(sc[d / per]);
        } else {
          x[i] = 0.0f;
        }
      }
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

// V dims d0 .. d0 + dpl of token (blk, off), from the exact tail where it holds them.
template <int FMT, int DPL>
__device__ __forceinline__ void kvg_fd_load_v(const DecodeArgs& a, i64 blk, int off, int kvh, int d0, int dpl,
                                              float (&vx)[DPL]) {
  const void* src;
  i64 base, kv_stride;
  if (kvg_fd_exact(a, blk, off, kvh, &src, &base, &kv_stride)) {
#pragma unroll
    for (int i = 0; i < DPL; ++i)
      vx[i] = (i < dpl && d0 + i < a.HD) ? kvg_load_dt(src, base + kv_stride + d0 + i, a.exact_dt) : 0.0f;
    return;
  }
  kvg_fd_load<FMT, DPL>(a, blk, 1, off, kvh, d0, dpl, vx);
}

template <int FMT, int QT, int DPL>
__device__ void kvg_decode_split(const DecodeArgs& a) {
  __shared__ float s_m[KVG_FD_WARPS][KVG_FD_MAX_G];
  __shared__ float s_l[KVG_FD_WARPS][KVG_FD_MAX_G];
  __shared__ float s_acc[KVG_FD_WARPS][KVG_FD_MAX_G][DPL * 32];
  alignas(16) __shared__ float s_q[KVG_FD_MAX_G][DPL * 32];  // q * qk_scale, 0 past HD / ng
  __shared__ float s_p[KVG_FD_WARPS][KVG_FD_MAX_G][32];  // a tile's softmax weights

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

  for (int e = threadIdx.x; e < KVG_FD_MAX_G * DPL * 32; e += blockDim.x) {
    const int g = e / (DPL * 32), d = e % (DPL * 32);
    s_q[g][d] = (g < ng && d < a.HD) ? kvg_load<QT>(a.q, ((i64)b * a.H + h0 + g) * a.HD + d) * a.qk_scale : 0.0f;
  }
  __syncthreads();

  // m: running max (the same in every lane); l: this lane's share of the sum of exp; acc: this
  // lane's dims d0 .. d0 + dpl of the unnormalised output.
  float m[KVG_FD_MAX_G], l[KVG_FD_MAX_G], acc[KVG_FD_MAX_G][DPL];
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g) {
    m[g] = KVG_NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
  }

  // A warp takes 32 tokens at a time (the warps interleave tiles). Scores: a lane per token, its
  // whole K row in wide loads against q from shared memory (a broadcast), so no per-token
  // shuffle reduction; then one max per head for the tile. Values: a lane per dims again,
  // token by token, each V row read by the warp in one coalesced pass.
  for (int tile = t0 + warp * 32; tile < t1; tile += KVG_FD_WARPS * 32) {
    const int t = tile + lane;
    const int id = t < t1 ? a.block_tables[(i64)b * a.max_blocks + t / a.BS] : -1;
    const int off = t % a.BS;
    float s[KVG_FD_MAX_G];
#pragma unroll
    for (int g = 0; g < KVG_FD_MAX_G; ++g) s[g] = 0.0f;
    if (id >= 0) {
      const void* src;
      i64 base, kv_stride;
      if (kvg_fd_exact(a, id, off, kvh, &src, &base, &kv_stride)) {
        for (int d = 0; d < a.HD; ++d) {
          const float k = kvg_load_dt(src, base + d, a.exact_dt);
#pragma unroll
          for (int g = 0; g < KVG_FD_MAX_G; ++g) s[g] += s_q[g][d] * k;
        }
      } else {
#pragma unroll 4  // four 16-byte loads in flight per lane
        for (int d = 0; d < a.HD; d += 8) {
          float x[8];
          kvg_fd_load<FMT, 8>(a, id, 0, off, kvh, d, min(8, a.HD - d), x);
#pragma unroll
          for (int g = 0; g < KVG_FD_MAX_G; ++g) {
            if (g < ng) {  // q's 8 dims in two 16-byte shared loads (one per element before)
              u32 qa[4], qb[4];
              kvg_fd_bits<16>(&s_q[g][d], qa);
              kvg_fd_bits<16>(&s_q[g][d + 4], qb);
#pragma unroll
              for (int i = 0; i < 4; ++i) s[g] += kvg_u2f(qa[i]) * x[i];
#pragma unroll
              for (int i = 0; i < 4; ++i) s[g] += kvg_u2f(qb[i]) * x[4 + i];
            }
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < KVG_FD_MAX_G; ++g) {
      if (g < ng) {  // uniform across the warp
        const float sg = id >= 0 ? s[g] : KVG_NEG_INF;
        // Online softmax over the tile: rescale the running sums to the new max once.
        const float mn = fmaxf(m[g], kvg_warp_max(sg));
        float p = 0.0f, alpha = 1.0f;
        if (mn != KVG_NEG_INF) {  // else no token seen yet (a -1 table entry: not expected)
          alpha = exp2f(m[g] - mn);  // exp2f(-inf) = 0 at the start
          p = exp2f(sg - mn);        // 0 for a lane without a token
        }
        l[g] = l[g] * alpha + p;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] *= alpha;
        s_p[warp][g][lane] = p;
        m[g] = mn;
      }
    }
    __syncwarp();
    const int n = min(32, t1 - tile);
    for (int j = 0; j < n; ++j) {
      const int idj = __shfl_sync(0xffffffffu, id, j);
      if (idj < 0) continue;  // warp-uniform
      float vx[DPL];
      kvg_fd_load_v<FMT, DPL>(a, idj, (tile + j) % a.BS, kvh, d0, dpl, vx);
#pragma unroll
      for (int g = 0; g < KVG_FD_MAX_G; ++g) {
        if (g < ng) {
          const float p = s_p[warp][g][j];
#pragma unroll
          for (int i = 0; i < DPL; ++i) acc[g][i] += p * vx[i];
        }
      }
    }
    __syncwarp();  // s_p is rewritten by the next tile
  }
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g)
    if (g < ng) l[g] = kvg_warp_sum(l[g]);

  // Merge the warps (each saw every 4th tile) in shared memory.
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
