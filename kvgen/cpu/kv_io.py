"""decode_step's cache write and block read for the quantized KV formats fp8 and q4, with or
without stage.ExactTail, so a decode step over them stays one compiled call.

Model.forward reads a quantized cache through the format's `read`, which dequantizes every
block of the context into fresh fp32 tensors on every layer of every step: at 1k tokens that
copy, not the arithmetic, is the step. Here attention (paged_attention.py, the same tasks as
over fp32 rows) dequantizes one block of one KV head at a time into a scratch tile that stays in
L1 (`load`, kv_lanes.py's kernels), so a step touches the quantized bytes once and allocates
nothing per token. It is the CPU twin of the GPU kernels (kvgen/gpu/kernels/kv_append.cu,
flash_decode.cu):

- write: the new token's K/V goes where the format's own `write` would put it, byte for byte:
  ExactTail's exact rows while its block holds a slot (and the sink at position 0), else
  quantized into the store with fp8's scale growth (requantizing the block's other rows when
  the scale grows) or q4's per-token value groups and per-channel key scales. The host does
  ExactTail's bookkeeping first (prepare_decode: slots, flushes of full blocks), as for the GPU.
  Every float32 operation is the one quant.py specifies (IEEE "/", round half to even), so the
  write functions are compiled without fastmath, which would turn x / s into x * (1 / s).
- load: a block's K or V rows of one head as the format's read gives them, bit for bit.

Everything a kernel reads travels in one tuple (`Cache`, built by `cache_tuple`), the same types
for every format (unused members are empty arrays), so decode_step's step compiles once.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from kvgen.cpu import kv_lanes

PLAIN, FP8, Q4 = 0, 1, 2
FORMATS = {"fp32": PLAIN, "fp8": FP8, "q4": Q4}

# Decoded value of every fp8 (E4M3) byte and every float16 bit pattern, as torch converts them.
E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
# numpy, not torch, for the 65,536: a torch op that large runs on a worker pool of the importing
# thread, and a second pool slows every parallel step of the engine's (threads.py).
F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# Positions in the Cache tuple.
KIND, CODES, SCALE, VSCALE, KSCALE, ROWS, RECENT, SINK, FIRST, QK, GROUP, LUT8, LUT16 = range(13)


class _Plain:  # what cache_tuple needs to know of the plain fp32 format
    name, recent_slots, qk_scale = "fp32", 0, None


def _empty(ndim: int, dtype) -> np.ndarray:
    return np.zeros((0,) * ndim, dtype)


def cache_tuple(fmt, store: dict) -> tuple:
    """The Cache tuple of a format's store (fmt None: plain fp32, whose rows attention reads
    itself): (kind, codes, fp8 scale, q4 value scales, q4 key scales, exact rows, recent slot map,
    sink, first-token slot map, qk_scale, group size, the fp8 and float16 decode tables). float16
    scales travel as their uint16 bits, fp8 codes as bytes; what the format lacks is an empty
    array."""
    if fmt is None:
        fmt = _Plain
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


# ---- read ------------------------------------------------------------------------------

# Inlined where it is called, with the Cache tuple's members taken out once by the caller: a call
# passing the tuple, its members counted in and out, cost more than an fp8 block's dequantizing
# (0.55 against 0.22 us).
@njit(cache=True, nogil=True, inline="always")
def load(kind, codes, scale, kscale, vscale, group, rows, recent, sink, first, layer, kv, b, h, n,
         tile):  # pragma: no cover - compiled
    """tile[:n] = the first n rows of block b's K (kv=0) or V (1) for head h, as the format's read
    gives them (the arguments before layer: the Cache tuple's members of those names): exact rows
    where ExactTail holds the block, the sink at offset 0 where it holds the first token, else
    dequantized codes (kv_lanes.py)."""
    if recent.shape[0] and recent[b] >= 0:
        _copy_rows(rows, recent[b], layer, kv, h, n, tile)
    elif kind == FP8:
        _load_fp8(codes, scale, layer, kv, b, h, n, tile)
    elif kv == 0:
        _load_q4_keys(codes, kscale, layer, b, h, n, tile)
    else:
        _load_q4_values(codes, vscale, group, layer, b, h, n, tile)
    if first.shape[0] and first[b] >= 0 and n:
        _copy_sink(sink, first[b], layer, kv, h, tile)


def load_block(c, layer, kv, b, h, n, tile) -> None:
    """load from Python (the tests), with the Cache tuple c."""
    load(c[KIND], c[CODES], c[SCALE], c[KSCALE], c[VSCALE], c[GROUP], c[ROWS], c[RECENT], c[SINK], c[FIRST], layer,
         kv, b, h, n, tile)


@njit(cache=True, nogil=True)
def _copy_rows(rows, slot, layer, kv, h, n, tile):  # pragma: no cover - compiled
    """tile[:n] = ExactTail's exact rows of a slot."""
    for t in range(n):
        src = rows[slot, layer, kv, t, h]
        for i in range(tile.shape[1]):
            tile[t, i] = src[i]


@njit(cache=True, nogil=True)
def _copy_sink(sink, slot, layer, kv, h, tile):  # pragma: no cover - compiled
    """tile[0] = the sink's row (the sequence's first token, held exact)."""
    src = sink[slot, layer, kv, h]
    for i in range(tile.shape[1]):
        tile[0, i] = src[i]


# Flat offsets into the stores, whose rows kv_lanes' kernels dequantize a vector at a time.

@njit(cache=True, nogil=True)
def _load_fp8(codes, scales, layer, kv, b, h, n, tile):  # pragma: no cover - compiled
    kvh, hd = codes.shape[4], tile.shape[1]
    half = (b * codes.shape[1] + layer) * 2 + kv  # codes[b, layer, kv], scales[b, layer, kv]
    kv_lanes.fp8_rows(codes, (half * codes.shape[3] * kvh + h) * hd, kvh * hd, n, hd, scales, half * kvh + h, 0, 1,
                      tile)


@njit(cache=True, nogil=True)
def _load_q4_keys(codes, kscale, layer, b, h, n, tile):  # pragma: no cover - compiled
    """q4 keys: a float16 scale a channel."""
    kvh, hd, p = codes.shape[4], tile.shape[1], codes.shape[5]
    at = (b * codes.shape[1] + layer) * 2 * codes.shape[3] * kvh + h
    kv_lanes.q4_key_rows(codes, at * p, kvh * p, n, hd, kscale, ((b * codes.shape[1] + layer) * kvh + h) * hd, 0, 1,
                         tile)


@njit(cache=True, nogil=True)
def _load_q4_values(codes, vscale, group, layer, b, h, n, tile):  # pragma: no cover - compiled
    """q4 values: a float16 scale a token and group of channels."""
    kvh, hd, p = codes.shape[4], tile.shape[1], codes.shape[5]
    groups = hd // group
    at = ((b * codes.shape[1] + layer) * 2 + 1) * codes.shape[3] * kvh + h
    first = ((b * codes.shape[1] + layer) * codes.shape[3] * kvh + h) * groups  # row 0's scales
    kv_lanes.q4_value_rows(codes, at * p, kvh * p, n, hd, vscale, first, kvh * groups, group, tile)
