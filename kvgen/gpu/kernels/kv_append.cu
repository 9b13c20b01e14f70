// Decode-step KV append into the paged cache at a GPU-resident position.
//
// Each batch row b writes one new token (k[b], v[b]: [kv_heads, head_dim]) for one layer at
// position pos = seq_lens[b] of its sequence, i.e. block block_tables[b][pos / BS], offset
// pos % BS. Both numbers are read on the device, so the host never syncs per token and the
// whole decode step can be captured in a CUDA graph. Padding rows write nothing: a row is
// skipped when seq_lens[b] < 0, when pos / BS is past the block table, or when the table
// holds -1 there. kv_increment (once per step, after the last layer) advances seq_lens.
//
// Cache layout (kvgen/engine/kv/formats.py), every tensor [num_blocks, L, 2 (k|v), BS, ...]:
//   plain: kv    [NB, L, 2, BS, KVH, HD]        f32 / f16 / bf16
//   fp8:   kv    [NB, L, 2, BS, KVH, HD]        e4m3fn bits
//          scale [NB, L, 2, KVH]                f32, one per block, layer, k|v, kv head
//   q4:    q      [NB, L, 2, BS, KVH, HD / 2]  two 4-bit codes per byte
//          vscale [NB, L, BS, KVH, HD / G]     f16 bits: values, one per token and group
//          kscale [NB, L, KVH, HD]             f16 bits: keys, one per channel over the block
//
// Exact tail (ExactTail in kvgen/engine/kv/stage.py; exact_dt >= 0): a quantized store whose
// sequences keep their newest block and their first token exact, in the compute dtype exact_dt:
//   exact_rows [slots, L, 2, BS, KVH, HD]  newest blocks; recent_of [NB] int64 slot of a block, -1
//   sink       [4 * slots, L, 2, KVH, HD]  first tokens;  first_of [NB] int64 slot of a block, -1
// A row whose block holds a recent slot is written there (cast) instead of into the store; a
// row at position 0 is also written to its block's sink slot. The host takes and gives back
// the slots before the step (ExactTail.prepare_decode), so the kernel only reads the maps.
//
// Grid (B, KVH, 2): one thread block per batch row, kv head and k|v, 128 threads.
// Requires head_dim <= 256 (checked by ops.py).
#include "common.cuh"

#define KVG_APPEND_THREADS 128
#define KVG_MAX_HEAD_DIM 256

struct AppendArgs {
  const void* k;           // [B, KVH, HD], input dtype
  const void* v;           // [B, KVH, HD]
  void* cache;             // kv (plain, fp8) or q (q4)
  void* cache_scale;       // fp8: f32 scales; q4: f16 value scales; plain: unused
  void* key_scale;         // q4: f16 key scales; others: unused
  const int* block_tables; // [B, max_blocks]
  const int* seq_lens;     // [B] tokens already cached = position of the new token
  void* exact_rows;        // exact tail (see above); unused when exact_dt < 0
  const i64* recent_of;
  void* sink;
  const i64* first_of;
  int max_blocks, L, layer, BS, KVH, HD, group;
  int exact_dt;            // KVG_F32 / F16 / BF16 of exact_rows and sink; -1: no exact tail
};

// Where row b's new token goes; false for padding rows.
__device__ __forceinline__ bool kvg_slot(const AppendArgs& a, int b, i64* blk, int* off) {
  const int pos = a.seq_lens[b];
  if (pos < 0) return false;
  const int bi = pos / a.BS;
  if (bi >= a.max_blocks) return false;
  const int id = a.block_tables[(i64)b * a.max_blocks + bi];
  if (id < 0) return false;
  *blk = id;
  *off = pos % a.BS;
  return true;
}

// Index of (block, k|v, offset, kv head) in a [NB, L, 2, BS, KVH, width] tensor, in elements.
__device__ __forceinline__ i64 kvg_row(const AppendArgs& a, i64 blk, int kv, int off, int kvh,
                                       int width) {
  return ((((blk * a.L + a.layer) * 2 + kv) * a.BS + off) * a.KVH + kvh) * (i64)width;
}

// ---- exact tail: the row goes to its block's exact slot (and position 0 to the sink) -------
template <int IT>
__device__ __forceinline__ void kvg_copy_row(void* dst, i64 out, const void* src, i64 in, int HD, int dt) {
#pragma unroll 1
  for (int d = threadIdx.x; d < HD; d += blockDim.x) kvg_store_dt(dst, out + d, kvg_load<IT>(src, in + d), dt);
}

// True when the row was written exact (the caller then leaves the store alone). Uniform per
// thread block, so a caller returning on it skips no barrier.
template <int IT>
__device__ __forceinline__ bool kvg_append_exact(const AppendArgs& a, int b, int kvh, int kv, i64 blk,
                                                 int off) {
  if (a.exact_dt < 0) return false;
  const void* src = kv ? a.v : a.k;
  const i64 in = ((i64)b * a.KVH + kvh) * a.HD;
  const i64 first = a.seq_lens[b] == 0 ? a.first_of[blk] : -1;
  if (first >= 0)  // the sequence's first token: kept in the sink as well
    kvg_copy_row<IT>(a.sink, (((first * a.L + a.layer) * 2 + kv) * a.KVH + kvh) * (i64)a.HD, src, in, a.HD,
                     a.exact_dt);
  const i64 slot = a.recent_of[blk];
  if (slot < 0) return false;
  // exact_rows has the store's row layout, with slots for blocks
  kvg_copy_row<IT>(a.exact_rows, kvg_row(a, slot, kv, off, kvh, a.HD), src, in, a.HD, a.exact_dt);
  return true;
}

// ---- fp32 / fp16 / bf16: cast and store --------------------------------------------------
template <int CT, int IT>
__device__ void kvg_append_plain(const AppendArgs& a) {
  const int b = blockIdx.x, kvh = blockIdx.y, kv = blockIdx.z;
  i64 blk;
  int off;
  if (!kvg_slot(a, b, &blk, &off) || kvg_append_exact<IT>(a, b, kvh, kv, blk, off)) return;
  const void* src = kv ? a.v : a.k;
  const i64 in = ((i64)b * a.KVH + kvh) * a.HD;
  const i64 out = kvg_row(a, blk, kv, off, kvh, a.HD);
  for (int d = threadIdx.x; d < a.HD; d += blockDim.x)
    kvg_store<CT>(a.cache, out + d, kvg_load<IT>(src, in + d));
}

// ---- fp8: one scale per (block, layer, k|v, kv head), grown on write -------------------
// new_scale = max(old_scale, absmax(row) / 448), old_scale taken as 0 at offset 0. When the
// scale grows, the rows already in the block are requantised with it
// (dequantise with the old scale, quantise with the new) so they stay decodable with the
// single per-block scale. Same float32 operations as Fp8Format.write (bit-exact).
template <int IT>
__device__ void kvg_append_fp8(const AppendArgs& a) {
  __shared__ float scratch[32];
  const int b = blockIdx.x, kvh = blockIdx.y, kv = blockIdx.z;
  i64 blk;
  int off;
  // uniform per thread block: no barrier skipped
  if (!kvg_slot(a, b, &blk, &off) || kvg_append_exact<IT>(a, b, kvh, kv, blk, off)) return;
  const void* src = kv ? a.v : a.k;
  const i64 in = ((i64)b * a.KVH + kvh) * a.HD;
  u8* cache = (u8*)a.cache;
  float* scale_p = (float*)a.cache_scale + ((blk * a.L + a.layer) * 2 + kv) * a.KVH + kvh;

  float amax = 0.0f;
  for (int d = threadIdx.x; d < a.HD; d += blockDim.x) amax = fmaxf(amax, fabsf(kvg_load<IT>(src, in + d)));
  amax = kvg_block_max_nonneg(amax, scratch);  // ends with a barrier

  const float old_scale = off == 0 ? 0.0f : *scale_p;  // every thread reads before the write below
  const float new_scale = fmaxf(old_scale, amax / KVG_FP8_MAX);

  if (off > 0 && new_scale > old_scale) {
    // Every other row of this head in the block, like Fp8Format.write (rows past `off` hold
    // nothing live, but requantising them too keeps the store byte-identical to the
    // reference). Rows are KVH * HD elements apart; row `off` is written below.
    const i64 row0 = kvg_row(a, blk, kv, 0, kvh, a.HD);
    const i64 row_stride = (i64)a.KVH * a.HD;
    for (int i = threadIdx.x; i < a.BS * a.HD; i += blockDim.x) {
      const int r = i / a.HD;
      if (r == off) continue;
      const i64 p = row0 + (i64)r * row_stride + i % a.HD;
      cache[p] = kvg_fp8_quantize(kvg_e4m3_to_f32(cache[p]) * old_scale, new_scale);
    }
  }
  const i64 out = kvg_row(a, blk, kv, off, kvh, a.HD);
  for (int d = threadIdx.x; d < a.HD; d += blockDim.x)
    cache[out + d] = kvg_fp8_quantize(kvg_load<IT>(src, in + d), new_scale);
  __syncthreads();  // all threads have read old_scale
  if (threadIdx.x == 0) *scale_p = new_scale;
}

// ---- q4 values: per token and group of G dims, scale = f16(absmax / 7) -------------------
// Phase 1: one thread per group computes and stores the scale (kept in shared memory).
// Phase 2: one thread per output byte packs elements 2i (low nibble) and 2i+1 (high).
template <int IT>
__device__ void kvg_append_q4_values(const AppendArgs& a, int b, int kvh, i64 blk, int off) {
  __shared__ float s_scale[KVG_MAX_HEAD_DIM];
  const void* src = a.v;
  const i64 in = ((i64)b * a.KVH + kvh) * a.HD;
  const int G = a.group, ngroups = a.HD / G;

  u16* scales = (u16*)a.cache_scale + (((blk * a.L + a.layer) * a.BS + off) * a.KVH + kvh) * (i64)ngroups;
  for (int g = threadIdx.x; g < ngroups; g += blockDim.x) {
    float amax = 0.0f;
    for (int j = 0; j < G; ++j) amax = fmaxf(amax, fabsf(kvg_load<IT>(src, in + g * G + j)));
    const u16 h = kvg_f32_to_f16(amax / 7.0f);
    scales[g] = h;
    s_scale[g] = kvg_f16_to_f32(h);  // quantise with the rounded (stored) scale
  }
  __syncthreads();

  u8* codes = (u8*)a.cache + kvg_row(a, blk, 1, off, kvh, a.HD / 2);
  for (int i = threadIdx.x; i < a.HD / 2; i += blockDim.x) {
    const int d0 = 2 * i, d1 = 2 * i + 1;
    const u32 lo = kvg_q4_code(kvg_load<IT>(src, in + d0), s_scale[d0 / G]);
    const u32 hi = kvg_q4_code(kvg_load<IT>(src, in + d1), s_scale[d1 / G]);
    codes[i] = (u8)(lo | (hi << 4));
  }
}

// ---- q4 keys: per channel over the block, scale grown on write -----------------------------
// Per channel d: new = max(old, f16(|x_d| / 7)), old taken as 0 at offset 0. One thread per
// byte (channels 2i, 2i+1): if either scale grew, the block's other rows of that byte are
// re-encoded (decode with old, encode with new; an identity where a scale did not change).
// Same float32 operations as formats._GroupFormat._write (bit-exact).
template <int IT>
__device__ void kvg_append_q4_keys(const AppendArgs& a, int b, int kvh, i64 blk, int off) {
  const i64 in = ((i64)b * a.KVH + kvh) * a.HD;
  u16* ks = (u16*)a.key_scale + ((blk * a.L + a.layer) * a.KVH + kvh) * (i64)a.HD;
  u8* codes = (u8*)a.cache;
  const i64 row0 = kvg_row(a, blk, 0, 0, kvh, a.HD / 2);
  const i64 row_stride = (i64)a.KVH * (a.HD / 2);
  for (int i = threadIdx.x; i < a.HD / 2; i += blockDim.x) {
    const int d0 = 2 * i, d1 = 2 * i + 1;
    const float x0 = kvg_load<IT>(a.k, in + d0), x1 = kvg_load<IT>(a.k, in + d1);
    const float old0 = off == 0 ? 0.0f : kvg_f16_to_f32(ks[d0]);
    const float old1 = off == 0 ? 0.0f : kvg_f16_to_f32(ks[d1]);
    const float new0 = fmaxf(old0, kvg_f16_to_f32(kvg_f32_to_f16(fabsf(x0) / 7.0f)));
    const float new1 = fmaxf(old1, kvg_f16_to_f32(kvg_f32_to_f16(fabsf(x1) / 7.0f)));
    if (off > 0 && (new0 > old0 || new1 > old1)) {
      for (int r = 0; r < a.BS; ++r) {
        if (r == off) continue;  // written below
        u8* p = codes + row0 + (i64)r * row_stride + i;
        const u32 byte = *p;
        const float y0 = (float)((int)(byte & 15u) - 8) * old0;
        const float y1 = (float)((int)(byte >> 4) - 8) * old1;
        *p = (u8)(kvg_q4_code(y0, new0) | (kvg_q4_code(y1, new1) << 4));
      }
    }
    codes[kvg_row(a, blk, 0, off, kvh, a.HD / 2) + i] = (u8)(kvg_q4_code(x0, new0) | (kvg_q4_code(x1, new1) << 4));
    ks[d0] = kvg_f32_to_f16(new0);  // this thread's channels only: no race
    ks[d1] = kvg_f32_to_f16(new1);
  }
}

template <int IT>
__device__ void kvg_append_q4(const AppendArgs& a) {
  const int b = blockIdx.x, kvh = blockIdx.y, kv = blockIdx.z;
  i64 blk;
  int off;
  if (!kvg_slot(a, b, &blk, &off)) return;
  if (kvg_append_exact<IT>(a, b, kvh, kv, blk, off)) return;
  if (kv)
    kvg_append_q4_values<IT>(a, b, kvh, blk, off);
  else
    kvg_append_q4_keys<IT>(a, b, kvh, blk, off);
}

// ---- entry points: kv_append_<cache format>_<input dtype> ---------------------------------
#define KVG_APPEND_PARAMS                                                                   \
  const void *k, const void *v, void *cache, void *cache_scale, void *key_scale,             \
      const int *block_tables, const int *seq_lens, void *exact_rows, const i64 *recent_of,   \
      void *sink, const i64 *first_of, int max_blocks, int L, int layer, int BS, int KVH,     \
      int HD, int group, int exact_dt
#define KVG_APPEND_ARGNAMES                                                                   \
  k, v, cache, cache_scale, key_scale, block_tables, seq_lens, exact_rows, recent_of, sink,   \
      first_of, max_blocks, L, layer, BS, KVH, HD, group, exact_dt
#define KVG_APPEND_ARGS \
  AppendArgs { KVG_APPEND_ARGNAMES }

#define KVG_DEFINE_APPEND(NAME, BODY)                                                       \
  extern "C" __global__ void __launch_bounds__(KVG_APPEND_THREADS) NAME(KVG_APPEND_PARAMS) { \
    BODY(KVG_APPEND_ARGS);                                                                  \
  }

KVG_DEFINE_APPEND(kv_append_fp32_f32, (kvg_append_plain<KVG_F32, KVG_F32>))
KVG_DEFINE_APPEND(kv_append_fp32_f16, (kvg_append_plain<KVG_F32, KVG_F16>))
KVG_DEFINE_APPEND(kv_append_fp32_bf16, (kvg_append_plain<KVG_F32, KVG_BF16>))
KVG_DEFINE_APPEND(kv_append_fp16_f32, (kvg_append_plain<KVG_F16, KVG_F32>))
KVG_DEFINE_APPEND(kv_append_fp16_f16, (kvg_append_plain<KVG_F16, KVG_F16>))
KVG_DEFINE_APPEND(kv_append_fp16_bf16, (kvg_append_plain<KVG_F16, KVG_BF16>))
KVG_DEFINE_APPEND(kv_append_bf16_f32, (kvg_append_plain<KVG_BF16, KVG_F32>))
KVG_DEFINE_APPEND(kv_append_bf16_f16, (kvg_append_plain<KVG_BF16, KVG_F16>))
KVG_DEFINE_APPEND(kv_append_bf16_bf16, (kvg_append_plain<KVG_BF16, KVG_BF16>))
KVG_DEFINE_APPEND(kv_append_fp8_f32, kvg_append_fp8<KVG_F32>)
KVG_DEFINE_APPEND(kv_append_fp8_f16, kvg_append_fp8<KVG_F16>)
KVG_DEFINE_APPEND(kv_append_fp8_bf16, kvg_append_fp8<KVG_BF16>)
KVG_DEFINE_APPEND(kv_append_q4_f32, kvg_append_q4<KVG_F32>)
KVG_DEFINE_APPEND(kv_append_q4_f16, kvg_append_q4<KVG_F16>)
KVG_DEFINE_APPEND(kv_append_q4_bf16, kvg_append_q4<KVG_BF16>)

// seq_lens[b] += n for every row with seq_lens[b] >= 0 and (if has_valid) valid[b] != 0.
// Run once per decode step after the last layer's append. Grid ceil(B / 128), 128 threads.
extern "C" __global__ void kv_increment(int* seq_lens, const u8* valid, int has_valid, int B, int n) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int len = seq_lens[b];
  if (len >= 0 && (!has_valid || valid[b])) seq_lens[b] = len + n;
}
