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
//     copy bandwidth). Values: HD / DPL lanes cover a row, DPL dims each, so a pass of the warp
//     reads 32 / (HD / DPL) rows (one at head_dim 128, two at 64). A lane issues several
//     rows' (K: chunks') loads before it uses any, so DRAM latency is paid once per group,
//     not once per load. K and V are
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
// Cache layout: see kv_append.cu. Requires head_dim % 8 == 0 and head_dim <= 32 * DPL (DPL = 4
// or 8, i.e. 128 or 256), chosen by ops.py.
#include "common.cuh"
#include "flash_decode_reads.cuh"

#define KVG_FD_WARPS 4
#define KVG_FD_THREADS (KVG_FD_WARPS * 32)
#define KVG_FD_MAX_G 4  // query heads per thread block; more per kv head -> more head chunks
// 0: every loop over a thread block's heads runs all KVG_FD_MAX_G of them (a head past ng has
// q = 0 and is never written out), so no branch splits the loops and ptxas interleaves the
// heads' multiply-add chains; 1: heads past ng are skipped (less work where ng < MAX_G).
#define KVG_FD_GUARD 0
#define KVG_FD_LIVE(g) (!KVG_FD_GUARD || (g) < ng)
// Thread blocks per SM that the register budget must allow at head_dim <= 128 (4: at most 128
// registers; left to itself ptxas picked 96 for some entry points and spilled); 2 at 256.
#define KVG_FD_MIN_BLOCKS 4
#define KVG_FD_KU 4     // K chunks of 8 dims a lane has in flight
#define KVG_FD_KU_Q4 2  // for q4 (each chunk brings its 8 channel scales: registers)
#define KVG_FD_VU 8        // V rows a lane has in flight
#define KVG_FD_VU_SMALL 4  // for q4 (a scale per element) or head_dim 256 (8 dims a lane); half for both

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
  // Values: lpr lanes cover a row, DPL dims each, so a pass of the warp reads R rows (2 at
  // head_dim 64). Lanes past R * lpr shadow lane 0's dims and are not written out.
  const int lpr = a.HD / DPL, R = 32 / lpr;
  const bool vlane = lane < R * lpr;
  const int sub = vlane ? lane / lpr : 0, d0 = vlane ? (lane % lpr) * DPL : 0;
  const int kchunks = a.HD / 8;  // K chunks of 8 dims
  constexpr int KU = FMT == KVG_FMT_Q4 ? KVG_FD_KU_Q4 : KVG_FD_KU;  // registers decide both
  constexpr int VU = FMT == KVG_FMT_Q4 && DPL > 4 ? KVG_FD_VU_SMALL / 2
                     : FMT == KVG_FMT_Q4 || DPL > 4 ? KVG_FD_VU_SMALL : KVG_FD_VU;
  static_assert((32 * DPL) % (8 * KU) == 0, "K chunk groups never run past s_q");

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
  // lane's dims d0 .. d0 + DPL of the unnormalised output, over its rows (sub, sub + R, ...).
  float m[KVG_FD_MAX_G], l[KVG_FD_MAX_G], acc[KVG_FD_MAX_G][DPL];
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g) {
    m[g] = KVG_NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
  }

  // A warp takes 32 tokens at a time (the warps interleave tiles). Scores: a lane per token, its
  // K row in groups of KU 8-dim chunks, each group's loads issued before any is used, against q
  // from shared memory (a broadcast), so no per-token shuffle reduction; then one max per head
  // for the tile. Values: VU passes' rows loaded before they are weighed.
  for (int tile = t0 + warp * 32; tile < t1; tile += KVG_FD_WARPS * 32) {
    const int t = tile + lane;
    const int id = t < t1 ? a.block_tables[(i64)b * a.max_blocks + t / a.BS] : -1;
    const int off = t % a.BS;
    float s[KVG_FD_MAX_G];
#pragma unroll
    for (int g = 0; g < KVG_FD_MAX_G; ++g) s[g] = 0.0f;
    // This lane's token's V row for the value pass (row 0, weight 0, without a token), and
    // whether the exact tail holds it.
    int vrow = 0, vsrow = 0, vexact = 0;
    float vscale = 0.0f;
    if (id >= 0) {
      vrow = kvg_fd_vrow(a, id, off, kvh);
      if constexpr (FMT == KVG_FMT_Q4) vsrow = kvg_fd_vscale_row(a, id, off, kvh);
      vscale = kvg_fd_scale<FMT>(a, id, 1, kvh);
      const void* src;
      i64 base, kv_stride;
      if (kvg_fd_exact_at<FMT>(a, id, off, kvh, &src, &base, &kv_stride)) {
        vexact = 1;
        for (int d = 0; d < a.HD; ++d) {
          const float k = kvg_load_dt(src, base + d, a.exact_dt);
#pragma unroll
          for (int g = 0; g < KVG_FD_MAX_G; ++g) s[g] += s_q[g][d] * k;
        }
      } else {
        const float ks = kvg_fd_scale<FMT>(a, id, 0, kvh);
        const i64 krow = kvg_fd_row(a, id, 0, off, kvh, a.HD);  // K row's first element
        const u16* kscales = (const u16*)a.key_scale + ((id * a.L + a.layer) * a.KVH + kvh) * (i64)a.HD;  // q4
        for (int c0 = 0; c0 < kchunks; c0 += KU) {
          // A group past the last chunk rereads it (a valid address) against q's zeros.
          float x[KU][8];
#pragma unroll
          for (int u = 0; u < KU; ++u) {
            const int d = 8 * min(c0 + u, kchunks - 1);
            kvg_fd_run<FMT, 8, true>(a, krow + d, ks, kscales + d, 0, x[u]);
          }
#pragma unroll
          for (int u = 0; u < KU; ++u) {
            const int d = 8 * (c0 + u);
#pragma unroll
            for (int g = 0; g < KVG_FD_MAX_G; ++g) {
              if (KVG_FD_LIVE(g)) {  // q's 8 dims in two 16-byte shared loads
                u32 qa[4], qb[4];
                kvg_fd_bits<16>(&s_q[g][d], qa);
                kvg_fd_bits<16>(&s_q[g][d + 4], qb);
#pragma unroll
                for (int i = 0; i < 4; ++i) s[g] += kvg_u2f(qa[i]) * x[u][i];
#pragma unroll
                for (int i = 0; i < 4; ++i) s[g] += kvg_u2f(qb[i]) * x[u][4 + i];
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < KVG_FD_MAX_G; ++g) {
      if (KVG_FD_LIVE(g)) {  // uniform across the warp
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
    // Row j = j0 + u * R + sub of the tile. A row past n (or of a -1 entry) has weight 0 and
    // reads the store's row 0 instead (a valid address), which adds exact zeros.
    const int n = min(32, t1 - tile);
    for (int j0 = 0; j0 < n; j0 += VU * R) {
      float vx[VU][DPL];
#pragma unroll
      for (int u = 0; u < VU; ++u) {
        const int j = min(j0 + u * R + sub, 31);
        const int row = __shfl_sync(0xffffffffu, vrow, j);
        const float sc = FMT == KVG_FMT_FP8 ? __shfl_sync(0xffffffffu, vscale, j) : 1.0f;
        const int srow = FMT == KVG_FMT_Q4 ? __shfl_sync(0xffffffffu, vsrow, j) : 0;
        if constexpr (FMT == KVG_FMT_FP8 || FMT == KVG_FMT_Q4) {
          const int exact = __shfl_sync(0xffffffffu, vexact, j);
          const int idj = __shfl_sync(0xffffffffu, id, j);
          const void* src;
          i64 base, kv_stride;
          if (exact && kvg_fd_exact(a, idj, (tile + j) % a.BS, kvh, &src, &base, &kv_stride)) {
#pragma unroll
            for (int i = 0; i < DPL; ++i) vx[u][i] = kvg_load_dt(src, base + kv_stride + d0 + i, a.exact_dt);
            continue;
          }
        }
        const u16* vscales = (const u16*)a.cache_scale + (i64)srow * (a.HD / a.group);  // q4
        kvg_fd_run<FMT, DPL, false>(a, (i64)row * a.HD + d0, sc, vscales, d0, vx[u]);
      }
#pragma unroll
      for (int u = 0; u < VU; ++u) {
        const int j = j0 + u * R + sub;
#pragma unroll
        for (int g = 0; g < KVG_FD_MAX_G; ++g) {
          if (KVG_FD_LIVE(g)) {
            const float p = j < 32 ? s_p[warp][g][j] : 0.0f;  // 0 for a lane without a token
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] += p * vx[u][i];
          }
        }
      }
    }
    __syncwarp();  // s_p is rewritten by the next tile
  }
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g) {
    if (KVG_FD_LIVE(g)) {
      l[g] = kvg_warp_sum(l[g]);
      // Lanes sub = 1 .. R-1 hold the same dims for other rows: add them to sub 0, in order.
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        float v = acc[g][i];
        for (int r = 1; r < R; ++r) v += __shfl_sync(0xffffffffu, acc[g][i], (lane + r * lpr) & 31);
        acc[g][i] = v;
      }
    }
  }

  // Merge the warps (each saw every 4th tile) in shared memory.
#pragma unroll
  for (int g = 0; g < KVG_FD_MAX_G; ++g) {
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = l[g];
    }
    if (lane < lpr) {
#pragma unroll
      for (int i = 0; i < DPL; ++i) s_acc[warp][g][d0 + i] = acc[g][i];
    }
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
  extern "C" __global__ void __launch_bounds__(KVG_FD_THREADS, (DPL) > 4 ? 2 : KVG_FD_MIN_BLOCKS) NAME(KVG_SPLIT_PARAMS) {        \
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
