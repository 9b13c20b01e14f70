"""A GGUF tensor's blocks written straight into the block kernels' layouts (vector_matmul.py's), by
compiled loops over the file's bytes: what weight_blocks.FileBlocks runs at load, for every type in
COMPILED_TYPES (the K-quants, IQ4_XS, Q5_0, Q5_1) or AS_FILED (the types whose codes are the file's
bytes as they are). WeightBlocks' numpy parse (weight_blocks._parse, _pack) is the readable
reference they are held to, bit for bit (tests/cpu/test_weight_blocks.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvgen.cpu.vector_matmul import SUPER

# The K-quants' blocks (Q4_K, Q5_K, Q6_K: what llama-quantize's Q*_K_M files hold) as compiled loops over
# the file's bytes, straight to the kinds' layouts: what weight_blocks' _parse then _pack give, bit for bit
# (tests/cpu/test_weight_blocks.py checks every bit against gguf-py), at ~1 GB/s a core where those numpy
# passes ran 45-200 MB/s (a 1.7B Q4_K_M file's took 10 s of a 30 s start). They write a row's codes as
# pairs of bytes (uint16) into out [rows / lanes, pairs, lanes]: lanes 1 is WeightBlocks' [N, G, B]
# layout, lanes TILE BlockLinear's tiles, so a FileBlocks' codes go from the file to the kernels' layout
# in one pass. Output row first + i is the file's row rows[i] (a fused weight's part, its rows
# rearranged); its scales go to row first + i of d, m (fp16 bits) and the int8 sub-block scales.


@njit(nogil=True, inline="always")
def _u16(blk, at):  # pragma: no cover - compiled
    """The little-endian 16 bits at byte `at` of a block: an fp16's bits, or two code bytes as one pair."""
    return blk[at] | (np.uint16(blk[at + 1]) << 8)


@njit(cache=True, nogil=True)
def k_codes(b, five, rows, first, out, d, m, sc, mn):  # pragma: no cover - compiled
    """Q4_K (five False) or Q5_K blocks b [R, S, 144 or 176] -> out: q4's 8 pairs a block (byte i holds
    inputs i and i + 16), q5m's 10 (then the plane of 5th bits: byte j inputs j + 4 i at bit i); d and m
    [N, S] the fp16 bits of d and -dmin, sc and mn [N, 8 S] the 6-bit sub-block scales and mins."""
    lanes, pairs = out.shape[2], 10 if five else 8
    at = 48 if five else 16  # the nibbles: 4 chunks of 32 bytes, sub-block 2j low, 2j + 1 high
    for i in range(rows.shape[0]):
        dst = first + i
        a, c = dst // lanes, dst % lanes
        for s in range(b.shape[1]):
            blk = b[rows[i], s]
            d[dst, s] = _u16(blk, 0)
            m[dst, s] = _u16(blk, 2) ^ 0x8000  # -dmin: the sign bit flipped
            for j in range(4):  # get_scale_min_k4
                dj, mj, mdj = blk[4 + j], blk[8 + j], blk[12 + j]
                sc[dst, 8 * s + j] = dj & 63
                sc[dst, 8 * s + 4 + j] = (mdj & 15) | ((dj >> 2) & 48)
                mn[dst, 8 * s + j] = mj & 63
                mn[dst, 8 * s + 4 + j] = (mdj >> 4) | ((mj >> 2) & 48)
            for j in range(4):
                q, x = at + 32 * j, (8 * s + 2 * j) * pairs
                for p in range(8):
                    lo0, lo1, hi0, hi1 = blk[q + 2 * p], blk[q + 2 * p + 1], blk[q + 16 + 2 * p], blk[q + 17 + 2 * p]
                    out[a, x + p, c] = (lo0 & 15) | ((hi0 & 15) << 4) | ((lo1 & 15) << 8) | ((hi1 & 15) << 12)
                    out[a, x + pairs + p, c] = (lo0 >> 4) | (hi0 & 240) | ((lo1 >> 4) << 8) | ((hi1 & 240) << 8)
            if five:  # sub-block k's 5th bits: bit k of qh[t] for its input t
                for k in range(8):
                    for p in range(2):
                        v = 0
                        for e in range(2):
                            for bit in range(8):
                                v |= ((blk[16 + 2 * p + e + 4 * bit] >> k) & 1) << (bit + 8 * e)
                        out[a, (8 * s + k) * pairs + 8 + p, c] = v


@njit(cache=True, nogil=True)
def q6k_codes(b, rows, first, out, d, ds):  # pragma: no cover - compiled
    """Q6_K blocks b [R, S, 210] -> out: q6h's 12 pairs a block (q4's nibbles of u = q + 32, then the
    plane of the high 2 bits of u ^ 32: byte j inputs j + 8 i at bits 2 i); d [N, S] the fp16 bits,
    ds [N, 8 S, 2] the int8 scales per 16 inputs."""
    lanes = out.shape[2]
    for i in range(rows.shape[0]):
        dst = first + i
        a, c = dst // lanes, dst % lanes
        for s in range(b.shape[1]):
            blk = b[rows[i], s]
            d[dst, s] = _u16(blk, 208)
            for j in range(16):
                ds[dst, 8 * s + j // 2, j % 2] = blk[192 + j]
            for g in range(8):  # block g's input t: the low nibble ((g % 4) // 2) of ql[64 h + 32 (g % 2) + t],
                h, shift = g // 4, 4 * ((g % 4) // 2)  # the high bits 2 (g % 4) of qh[32 h + t]
                lo, hi, up, x = 64 * h + 32 * (g % 2), 128 + 32 * h, 2 * (g % 4), (8 * s + g) * 12
                for p in range(8):
                    v = 0
                    for e in range(2):
                        t = 2 * p + e
                        v |= (((blk[lo + t] >> shift) & 15) | (((blk[lo + 16 + t] >> shift) & 15) << 4)) << (8 * e)
                    out[a, x + p, c] = v
                for p in range(4):
                    v = 0
                    for e in range(2):
                        for bit in range(4):
                            v |= (((blk[hi + 2 * p + e + 8 * bit] >> up) & 3) ^ 2) << (2 * bit + 8 * e)
                    out[a, x + 8 + p, c] = v


@njit(cache=True, nogil=True)
def iq4xs_codes(b, rows, first, out, d, ds):  # pragma: no cover - compiled
    """IQ4_XS blocks b [R, S, 136] -> out: q4i's 8 pairs a block (the file's nibble bytes as they are: byte
    j holds inputs j and j + 16); d [N, S] the fp16 bits, ds [N, 8 S] the int8 sub-block scales ls - 32."""
    lanes = out.shape[2]
    for i in range(rows.shape[0]):
        dst = first + i
        a, c = dst // lanes, dst % lanes
        for s in range(b.shape[1]):
            blk = b[rows[i], s]
            d[dst, s] = _u16(blk, 0)
            high = _u16(blk, 2)
            for g in range(8):
                low = (blk[4 + g // 2] >> (4 * (g % 2))) & 15
                ds[dst, 8 * s + g] = np.int8((low | (((high >> (2 * g)) & 3) << 4)) - 32)
                for p in range(8):
                    at = 8 + 16 * g + 2 * p
                    out[a, (8 * s + g) * 8 + p, c] = _u16(blk, at)


@njit(cache=True, nogil=True)
def low_bit_codes(b, three, rows, first, out, d, m, ds, ms):  # pragma: no cover - compiled
    """Q3_K (three True; m, ms unused) or Q2_K blocks b [R, S, 110 or 84] -> out: q3h's 6 pairs a block (a plane
    of the codes' low 2 bits: byte j holding input j + 8 i at bit 2 i; then one of Q3_K's high bits, of u ^ 4:
    byte j holding input j + 4 i at bit i), q2hm's 4 (the plane of 2 bits); d (and m, the file's -dmin) [N, S]
    fp16 bits, ds (and ms) [N, 8 S, 2] the int8 scales (and mins) per 16 inputs. Block g's input t: bits
    2 (g % 4) of qs[32 (g // 4) + t], and Q3_K's bit g of hmask[t] (clear: the code - 4, so u ^ 4's bit set)."""
    lanes = out.shape[2]
    q = 32 if three else 16  # where qs starts
    pairs = 6 if three else 4
    for i in range(rows.shape[0]):
        dst = first + i
        a, c = dst // lanes, dst % lanes
        for s in range(b.shape[1]):
            blk = b[rows[i], s]
            if three:
                d[dst, s] = _u16(blk, 108)
                for k in range(16):  # scale k: a nibble of byte k % 8, 2 bits of byte 8 + k % 4
                    low, high = (blk[96 + k % 8] >> (4 * (k // 8))) & 15, (blk[104 + k % 4] >> (2 * (k // 4))) & 3
                    ds[dst, 8 * s + k // 2, k % 2] = np.int8((low | (high << 4)) - 32)
            else:
                d[dst, s] = _u16(blk, 80)
                m[dst, s] = _u16(blk, 82) ^ 0x8000  # -dmin: the sign bit flipped
                for k in range(16):
                    ds[dst, 8 * s + k // 2, k % 2] = blk[k] & 15
                    ms[dst, 8 * s + k // 2, k % 2] = blk[k] >> 4
            for g in range(8):
                at, shift = q + 32 * (g // 4), 2 * (g % 4)
                for p in range(pairs):
                    v = 0
                    for e in range(2):
                        j, byte = 2 * p + e, 0
                        if p < 4:  # the low bits' plane
                            for f in range(4):
                                byte |= ((blk[at + j + 8 * f] >> shift) & 3) << (2 * f)
                        else:  # Q3_K's high bits' plane
                            for f in range(8):
                                byte |= (((blk[j - 8 + 4 * f] >> g) & 1) ^ 1) << f
                        v |= np.uint16(byte) << (8 * e)
                    out[a, (8 * s + g) * pairs + p, c] = v


@njit(cache=True, nogil=True)
def q5_codes(b, one, rows, first, out, d, m):  # pragma: no cover - compiled
    """Q5_0 (one False; m unused) or Q5_1 blocks b [R, G, 22 or 24] -> out: q5's / q5m's 10 pairs a block,
    the file's nibble bytes as they are, then the plane of 5th bits (of u ^ 16 for Q5_0: its offset): byte j
    holding input j + 4 i's at bit i; d (and m) [N, G] the fp16 bits."""
    lanes = out.shape[2]
    at = 4 if one else 2  # qh, a little-endian uint32 whose bit t is input t's 5th bit, then the nibbles
    flip = 0 if one else 1
    for i in range(rows.shape[0]):
        dst = first + i
        a, c = dst // lanes, dst % lanes
        for g in range(b.shape[1]):
            blk = b[rows[i], g]
            d[dst, g] = _u16(blk, 0)
            if one:
                m[dst, g] = _u16(blk, 2)
            qh = np.uint32(blk[at]) | (np.uint32(blk[at + 1]) << 8) | (np.uint32(blk[at + 2]) << 16) | \
                (np.uint32(blk[at + 3]) << 24)
            for p in range(8):
                out[a, g * 10 + p, c] = _u16(blk, at + 4 + 2 * p)
            for p in range(2):
                v = 0
                for e in range(2):
                    j = 2 * p + e
                    for bit in range(8):
                        v |= np.uint16(((qh >> (j + 4 * bit)) & 1) ^ flip) << (bit + 8 * e)
                out[a, g * 10 + 8 + p, c] = v


@njit(cache=True, nogil=True)
def gather_codes(src, rows, first, out):  # pragma: no cover - compiled
    """src [R, G, P] a weight's code bytes in pairs (uint16; a view of the file's blocks, or of a
    WeightBlocks' codes) -> out as k_codes writes it: output row first + i is src's row rows[i]."""
    lanes, groups, pairs = out.shape[2], src.shape[1], src.shape[2]
    for i in range(rows.shape[0]):
        dst = first + i
        a, c = dst // lanes, dst % lanes
        for g in range(groups):
            for p in range(pairs):
                out[a, g * pairs + p, c] = src[rows[i], g, p]


# the types the compiled loops above convert (FileBlocks), and how each's scales are held
COMPILED_TYPES = {"Q4_K": "SUB_MIN", "Q5_K": "SUB_MIN", "Q6_K": "SUB", "IQ4_XS": "SUB", "Q3_K": "SUB",
                  "Q2_K": "SUB_MIN4", "Q5_0": "F16", "Q5_1": "F16_MIN"}
# the types whose codes are the file's bytes as they are: (first byte of the codes in a block, fp16 d's, m's)
AS_FILED = {"Q4_0": (2, 0, None), "Q4_1": (4, 0, 2), "Q8_0": (2, 0, None), "IQ4_NL": (2, 0, None)}


def scale_arrays(type_name: str, n: int, groups: int) -> tuple:
    """Empty (d, m, ds, ms) for n rows of groups blocks of a compiled type: fp16 bits (uint16) and int8 (None:
    not held)."""
    if type_name in ("Q5_0", "Q5_1"):  # an fp16 d (and m) per block
        return np.empty((n, groups), np.uint16), np.empty((n, groups), np.uint16) if type_name == "Q5_1" else None, \
            None, None
    supers = groups // SUPER
    if type_name in ("Q6_K", "Q3_K"):
        return np.empty((n, supers), np.uint16), None, np.empty((n, 8 * supers, 2), np.int8), None
    if type_name == "IQ4_XS":
        return np.empty((n, supers), np.uint16), None, np.empty((n, 8 * supers), np.int8), None
    if type_name == "Q2_K":
        return (np.empty((n, supers), np.uint16), np.empty((n, supers), np.uint16),
                np.empty((n, 8 * supers, 2), np.int8), np.empty((n, 8 * supers, 2), np.int8))
    return (np.empty((n, supers), np.uint16), np.empty((n, supers), np.uint16), np.empty((n, 8 * supers), np.int8),
            np.empty((n, 8 * supers), np.int8))
