"""FusedDecode's cache write and attention over the quantized KV formats fp8 and q4, with or
without stage.ExactTail, so a decode step over them stays one compiled call.

Model.forward reads a quantized cache through the format's `read`, which dequantizes every
block of the context into fresh fp32 tensors on every layer of every step: at 1k tokens that
copy, not the arithmetic, is the step. Here attention dequantizes one block at a time into a
scratch tile that stays in L1 (fp8 by moving its bits, q4 from its nibbles), so a step
touches the quantized bytes once and allocates nothing per token. It is the CPU twin of the GPU
kernels (kvgen/gpu/kernels/kv_append.cu, flash_decode.cu):

- write: the new token's K/V goes where the format's own `write` would put it, byte for byte:
  ExactTail's exact rows while its block holds a slot (and the sink at position 0), else
  quantized into the store with fp8's scale growth (requantizing the block's other rows when
  the scale grows) or q4's per-token value groups and per-channel key scales. The host does
  ExactTail's bookkeeping first (prepare_decode: slots, flushes of full blocks), as for the GPU.
  Every float32 operation is the one quant.py specifies (IEEE "/", round half to even), so the
  write functions are compiled without fastmath, which would turn x / s into x * (1 / s).
- attend: split-K decoding (FlashDecoding): each task is one row, one KV head (all the query
  heads of its group, so a key is dequantized once for the group, not once per query head) and
  one run of blocks; the tasks' partial softmaxes are merged at the end. The splits keep both
  cores busy at batch 1, which has only as many (row, KV head) pairs as KV heads. A block's
  dequantized tile goes through key_lanes' kernels, as plain_attention's cache rows do (at 1k
  tokens of context: fp8 88 -> 123 tok/s, q4 79 -> 101).

Everything a kernel reads travels in one tuple (`Cache`, built by `cache_tuple`), the same types
for every format (unused members are empty arrays), so FusedDecode's step compiles once.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from kvgen.engine import (
    cpu_kernels,  # noqa: F401  (first: it points Numba's cache, numba_cache.py)
    exp_kernels,
    key_lanes,
)

PLAIN, FP8, Q4 = 0, 1, 2
FORMATS = {"fp32": PLAIN, "fp8": FP8, "q4": Q4}

# Decoded value of every fp8 (E4M3) byte and every float16 bit pattern, as torch converts them.
E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
# numpy, not torch, for the 65,536: a torch op that large runs on a worker pool of the importing
# thread, and a second pool slows every parallel step of the engine's (threads.py).
F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# Positions in the Cache tuple.
KIND, CODES, SCALE, VSCALE, KSCALE, ROWS, RECENT, SINK, FIRST, QK, GROUP, LUT8, LUT16 = range(13)


def _empty(ndim: int, dtype) -> np.ndarray:
    return np.zeros((0,) * ndim, dtype)


def cache_tuple(fmt, store: dict) -> tuple:
    """The Cache tuple of a format's store: (kind, codes, fp8 scale, q4 value scales, q4 key scales,
    exact rows, recent slot map, sink, first-token slot map, qk_scale, group size, the fp8 and
    float16 decode tables). float16 scales
    travel as their uint16 bits, fp8 codes as bytes; what the format lacks is an empty array."""
    kind = FORMATS[fmt.name]
    codes, scale = _empty(6, np.uint8), _empty(4, np.float32)
    vscale, kscale = _empty(5, np.uint16), _empty(4, np.uint16)
    rows, recent, sink, first = _empty(6, np.float32), _empty(1, np.int64), _empty(5, np.float32), _empty(1, np.int64)
    if kind == FP8:
        codes, scale = store["kv"].view(torch.uint8).numpy(), store["scale"].numpy()
    elif kind == Q4:
        codes = store["q"].numpy()
        vscale, kscale = store["vscale"].view(torch.int16).numpy().view(np.uint16), \
            store["kscale"].view(torch.int16).numpy().view(np.uint16)
    if fmt.recent_slots:
        rows, recent, sink, first = (t.numpy() for t in fmt.exact_tensors(store))
    qk = fmt.qk_scale.numpy() if fmt.qk_scale is not None else _empty(3, np.float32)
    return (kind, codes, scale, vscale, kscale, rows, recent, sink, first, qk,
            getattr(fmt, "group_size", 1), E4M3, F16)


# ---- bit-exact rounding (quant.py's spec; no fastmath) -------------------------------------

@njit(cache=True, nogil=True)
def _round_small(a, mant, bias):  # pragma: no cover - compiled
    """Bits (sign excluded) of a >= 0 rounded to nearest even in a float format with `mant`
    mantissa bits and exponent bias `bias` (no overflow handling). Scaling by a power of two is
    exact, so rint on the scaled value rounds exactly as the bit-level conversion does."""
    if a < math.ldexp(1.0, 1 - bias):  # subnormal: a fixed spacing of 2^(1 - bias - mant)
        return int(np.rint(math.ldexp(float(a), bias - 1 + mant)))
    m, e = math.frexp(float(a))  # a = m 2^e, 0.5 <= m < 1
    e -= 1
    r = int(np.rint(math.ldexp(m, mant + 1)))  # 2^mant <= r <= 2^(mant + 1)
    if r == 1 << (mant + 1):
        r, e = 1 << mant, e + 1
    return ((e + bias) << mant) | (r - (1 << mant))


@njit(cache=True, nogil=True)
def f16_bits(x):  # pragma: no cover - compiled
    """float16 bits of float32 x >= 0 (scales only), round to nearest even."""
    if x >= np.float32(65520):
        return 0x7C00
    return _round_small(x, 10, 15)


@njit(cache=True, nogil=True)
def fp8_code(x, scale):  # pragma: no cover - compiled
    """quant.fp8_quantize of float32 x with float32 scale, as a byte."""
    y = x / scale if scale > 0 else np.float32(0)
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0  # -0 and nan keep their sign, as in torch's cast
    if y != y:  # nan (a stale byte of a reused block, requantized): stays nan
        return sign | 0x7F
    return sign | _round_small(min(abs(y), np.float32(448)), 3, 7)


@njit(cache=True, nogil=True)
def q4_code(x, s):  # pragma: no cover - compiled
    """quant.q4_encode's 0..15 code of float32 x with float32 scale s."""
    if not s > 0:
        return 8
    return int(min(max(np.rint(x / s), np.float32(-8)), np.float32(7))) + 8


# ---- write ------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def write(c, layer, pos, b, off, k, v, kvh):  # pragma: no cover - compiled
    """Store one token's k, v ([kvh * HD] float32, contiguous heads) at block b, offset off,
    position pos, as the format's write (through ExactTail when it has one) does."""
    codes, rows, recent, sink, first = c[CODES], c[ROWS], c[RECENT], c[SINK], c[FIRST]
    hd = k.shape[0] // kvh
    if first.shape[0] and pos == 0 and first[b] >= 0:  # the sequence's first token: the sink too
        for h in range(kvh):
            for i in range(hd):
                sink[first[b], layer, 0, h, i] = k[h * hd + i]
                sink[first[b], layer, 1, h, i] = v[h * hd + i]
    if recent.shape[0] and recent[b] >= 0:  # the block is held exact: nothing reaches the store
        for h in range(kvh):
            for i in range(hd):
                rows[recent[b], layer, 0, off, h, i] = k[h * hd + i]
                rows[recent[b], layer, 1, off, h, i] = v[h * hd + i]
        return
    if c[KIND] == FP8:
        for kv in range(2):
            x = k if kv == 0 else v
            for h in range(kvh):
                _write_fp8(codes, c[SCALE], layer, kv, h, b, off, x[h * hd:(h + 1) * hd], c[LUT8])
    else:
        for h in range(kvh):
            _write_q4(codes, c[VSCALE], c[KSCALE], layer, h, b, off, k[h * hd:(h + 1) * hd],
                      v[h * hd:(h + 1) * hd], c[GROUP], c[LUT16])


@njit(cache=True, nogil=True)
def _write_fp8(codes, scales, layer, kv, h, b, off, x, lut):  # pragma: no cover - compiled
    """Fp8Format.write for one (block, k|v, head): the scale grows to cover x, the block's other
    rows are requantized when it does (an offset-0 write starts the block over)."""
    amax = np.float32(0)
    for i in range(x.shape[0]):
        amax = max(amax, abs(x[i]))
    old = np.float32(0) if off == 0 else scales[b, layer, kv, h]
    new = max(old, amax / np.float32(448))
    if off > 0 and new > old:
        for r in range(codes.shape[3]):
            for i in range(x.shape[0]):
                codes[b, layer, kv, r, h, i] = fp8_code(lut[codes[b, layer, kv, r, h, i]] * old, new)
    scales[b, layer, kv, h] = new
    for i in range(x.shape[0]):
        codes[b, layer, kv, off, h, i] = fp8_code(x[i], new)


@njit(cache=True, nogil=True)
def _write_q4(codes, vscale, kscale, layer, h, b, off, k, v, group, lut):  # pragma: no cover - compiled
    """Q4Format.write for one (block, head): values with a float16 scale per group, keys with
    per-channel float16 scales grown as rows arrive (other rows re-encoded where a scale grew)."""
    hd = v.shape[0]
    s = np.empty(hd, np.float32)
    for g in range(hd // group):
        amax = np.float32(0)
        for i in range(g * group, (g + 1) * group):
            amax = max(amax, abs(v[i]))
        bits = f16_bits(amax / np.float32(7))
        vscale[b, layer, off, h, g] = bits
        for i in range(g * group, (g + 1) * group):
            s[i] = lut[bits]
    for j in range(hd // 2):
        codes[b, layer, 1, off, h, j] = q4_code(v[2 * j], s[2 * j]) | (q4_code(v[2 * j + 1], s[2 * j + 1]) << 4)
    for i in range(hd):  # keys: s = the new channel scales, old ones re-encoded where they grew
        old = np.float32(0) if off == 0 else lut[kscale[b, layer, h, i]]
        bits = f16_bits(abs(k[i]) / np.float32(7))
        new = max(old, lut[bits])
        if off > 0 and new > old:
            shift = 4 * (i % 2)
            for r in range(codes.shape[3]):
                if r != off:
                    byte = codes[b, layer, 0, r, h, i // 2]
                    y = np.float32((byte >> shift) & 15) - np.float32(8)
                    code = q4_code(y * old, new)
                    codes[b, layer, 0, r, h, i // 2] = (byte & (0xF0 >> shift)) | (code << shift)
        kscale[b, layer, h, i] = f16_bits(new)
        s[i] = new
    for j in range(hd // 2):
        codes[b, layer, 0, off, h, j] = q4_code(k[2 * j], s[2 * j]) | (q4_code(k[2 * j + 1], s[2 * j + 1]) << 4)


# ---- attend -----------------------------------------------------------------------------

@njit(fastmath=True, cache=True, nogil=True)
def _load(c, layer, kv, b, h, n, tile):  # pragma: no cover - compiled
    """tile[:n] = the first n rows of block b's K (kv=0) or V (1) for head h, as the format's read
    gives them: exact rows where ExactTail holds the block, the sink at offset 0 where it holds
    the first token, else dequantized codes."""
    rows, recent, sink, first, codes = c[ROWS], c[RECENT], c[SINK], c[FIRST], c[CODES]
    f16 = c[LUT16]
    hd = tile.shape[1]
    # Through 1-D views of each source and tile row: with every index but the innermost fixed,
    # LLVM vectorizes the loops over head_dim (six-index element reads ran several times slower).
    if recent.shape[0] and recent[b] >= 0:
        tile[:n] = rows[recent[b], layer, kv, :n, h]
    elif c[KIND] == FP8:
        # E4M3's bits moved into float32's places (sign to bit 31, exponent and mantissa up by 20)
        # make a float32 of the code's value times 2^-120 (the exponent biases differ by 120;
        # subnormal codes land on float32 subnormals, the same way): integer ops that vectorize,
        # where a lookup table is a load per element (fp8 decode at 1k context 66.6 -> 74.5
        # tok/s when this replaced the table).
        s = c[SCALE][b, layer, kv, h] * np.float32(2.0 ** 120)
        bits = tile.view(np.int32)
        for t in range(n):
            src, dst, out = codes[b, layer, kv, t, h], bits[t], tile[t]
            for i in range(hd):
                x = np.int32(src[i])
                dst[i] = ((x & 0x7F) << 20) | ((x & 0x80) << 24)
            for i in range(hd):
                out[i] *= s
    elif kv == 0:  # q4 keys: one scale per channel
        ks = c[KSCALE][b, layer, h]
        sc = np.empty(hd, np.float32)
        for i in range(hd):
            sc[i] = f16[ks[i]]
        for t in range(n):
            src, dst = codes[b, layer, 0, t, h], tile[t]
            for j in range(hd // 2):
                byte = src[j]
                dst[2 * j] = np.float32(np.int32(byte & 15) - 8) * sc[2 * j]
                dst[2 * j + 1] = np.float32(np.int32(byte >> 4) - 8) * sc[2 * j + 1]
    else:  # q4 values: one scale per token and group
        group = c[GROUP]
        for t in range(n):
            src, dst, vs = codes[b, layer, 1, t, h], tile[t], c[VSCALE][b, layer, t, h]
            for gi in range(hd // group):
                s = f16[vs[gi]]
                for j in range(gi * group // 2, (gi + 1) * group // 2):
                    byte = src[j]
                    dst[2 * j] = np.float32(np.int32(byte & 15) - 8) * s
                    dst[2 * j + 1] = np.float32(np.int32(byte >> 4) - 8) * s
    if first.shape[0] and first[b] >= 0 and n:
        tile[0] = sink[first[b], layer, kv, h]


# No fastmath: Numba would put its flags on key_lanes' additions (plain_attention.py says why).
@njit(cache=True, nogil=True)
def _attend_split(q, c, layer, table, r, kh, group, n_keys, j0, j1, block, scale, top, total, acc):  # pragma: no cover
    """The query heads of KV head kh over blocks j0..j1 of row r's table: their softmax's max
    (top), sum (total) and unnormalised weighted values (acc [group, head_dim], contiguous), to
    be merged with other splits. A block is dequantized into a tile, whose scores and values
    key_lanes' kernels take as plain_attention's take the cache's rows."""
    head_dim = acc.shape[1]
    t0 = j0 * block
    width = min(n_keys, j1 * block) - t0
    scores = np.empty((group, width + key_lanes.TILE), np.float32)  # a tile's scores past the keys
    tile = np.empty((-(-block // key_lanes.TILE) * key_lanes.TILE, head_dim), np.float32)
    sf, tf, qf, af = scores.reshape(-1), tile.reshape(-1), q.reshape(-1), acc.reshape(-1)
    for j in range(j0, j1):
        n = min(block, n_keys - j * block)
        _load(c, layer, 0, table[j], kh, n, tile)
        for g in range(group):
            for t in range(0, n, key_lanes.TILE):
                key_lanes.scores_rows(tf, t * head_dim, head_dim, qf, r * q.shape[1] + (kh * group + g) * head_dim,
                                      head_dim, scale, sf, g * scores.shape[1] + j * block + t - t0)
    for g in range(group):
        m = exp_kernels.largest(scores[g], width)
        top[g], total[g] = m, exp_kernels.exp_shifted(scores[g], width, m)
    for j in range(j0, j1):
        n = min(block, n_keys - j * block)
        _load(c, layer, 1, table[j], kh, n, tile)
        for g0 in range(0, group, key_lanes.MAX_HEADS):
            key_lanes.values(min(key_lanes.MAX_HEADS, group - g0), tf, 0, head_dim, n, sf,
                             g0 * scores.shape[1] + j * block - t0, scores.shape[1], head_dim, af, g0 * head_dim)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def attend(q, c, layer, tables, positions, heads, kv_heads, head_dim, block, out):  # pragma: no cover
    """out[r, h] = softmax(q_rh K^T / sqrt(D)) V over row r's positions 0..positions[r] (q rows
    hold the query heads first, as FusedDecode's fused qkv output does)."""
    rows, group = q.shape[0], heads // kv_heads
    scale = np.float32(1.0 / math.sqrt(head_dim))
    width = 0
    for r in range(rows):
        width = max(width, positions[r] // block + 1)
    base = rows * kv_heads
    splits = max(1, min(width, -(-16 // base)))  # ~16 tasks: even work on a few cores
    top = np.zeros((rows, splits, heads), np.float32)
    total = np.zeros((rows, splits, heads), np.float32)
    acc = np.zeros((rows, splits, heads, head_dim), np.float32)  # a split's group of heads: contiguous
    for task in prange(base * splits):
        r, kh, sp = task // (kv_heads * splits), task // splits % kv_heads, task % splits
        n_keys = positions[r] + 1
        nblk = -(-n_keys // block)
        per = -(-nblk // splits)
        j0, j1 = sp * per, min(nblk, (sp + 1) * per)
        if j0 < j1:  # (a split past the row's blocks keeps total 0: the merge skips it)
            _attend_split(q, c, layer, tables[r], r, kh, group, n_keys, j0, j1, block, scale,
                          top[r, sp, kh * group:(kh + 1) * group], total[r, sp, kh * group:(kh + 1) * group],
                          acc[r, sp, kh * group:(kh + 1) * group])
    for r in range(rows):  # merge the splits' partial softmaxes (no infinities: fastmath assumes none)
        for h in range(heads):
            m = top[r, 0, h]  # split 0 is never empty
            for sp in range(splits):
                if total[r, sp, h] > 0:
                    m = max(m, top[r, sp, h])
            tot = np.float32(0)
            o = out[r, h * head_dim:(h + 1) * head_dim]
            o[:] = 0
            for sp in range(splits):
                if total[r, sp, h] > 0:
                    f = math.exp(top[r, sp, h] - m)
                    tot += f * total[r, sp, h]
                    for i in range(head_dim):
                        o[i] += f * acc[r, sp, h, i]
            for i in range(head_dim):
                o[i] /= tot
