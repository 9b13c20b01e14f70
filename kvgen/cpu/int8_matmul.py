"""Block matmuls with int8 activations and vpdpbusd: block_matmul's kernels for the q4 (Q4_0, Q4_1, Q4_K),
q8 (Q8_0), q5 (Q5_0), q5m (Q5_1, Q5_K) and q6h (Q6_K) kinds, at every row count, where CPU_ACTIVATIONS=int8
(features.INT8); the int16 kernels everywhere else, and for the other kinds (q4i, q3h, q2hm, q8h, q8hm) always.

vector_matmul rounds each activation row's block of 32 inputs to int16 (2^-16 of the block's
largest |x|) and multiplies by vpdpwssd, 32 int16 multiply-adds an instruction. Steps of many rows
(a prompt chunk, 16 decode streams) are then compute-bound, where llama.cpp, whose activations
are int8 (Q8_0 / Q8_K: 2^-8), multiplies 64 u8 x s8 pairs an instruction (vpdpbusd). This module
does the same over the codes and scales BlockLinear holds, read exactly as vector_matmul reads them.

What it computes:

    quantize_int8(x, halves=1) -> (xq, dx, xs, xi): per row r and block g of 32 inputs, with top = the
        block's largest |x|, dx[r, g] = top / 127 (float32), and each x rounded half to even
        (llvm.rint) in steps of dx: q = rint(x * (127 / top)) in [-127, 127] (0 for a zero block);
        xi the integer sums of q (int32): one a block, xi[r, g] (halves 1), or one per 16 inputs,
        xi[r, 2g + h] (halves 2); xs[r, g] = dx[r, g] * (the block's sum) (float32: llama.cpp's Q8_1 "s").
        The codes are laid out for the kernels, xq [M, K] int8, block g's 32 bytes in 8 dwords: with
        halves 1 (q4's order) dword p holds [q(2p), q(2p+1), q(2p+16), q(2p+17)], the 4 inputs one q4 code
        pair p covers; with halves 2 (the inputs' order) dword p holds q(4p .. 4p+3), within one half.
    <kind>_matmul_int8(xq, dx, xs, xi, qs, scales, [layout,] y): per block g, in order, with dot the exact
        int32 dot of the block's codes u as unsigned bytes (q4's nibbles, the packed kinds' whole 5 or
        6-bit codes, q8's codes + 128) and the int8 activations, less OFFSETS[kind] times the activations'
        integer sum (so the dot of the codes the weights are made of: Q4_0's u - 8, Q5_0's u - 16, Q6_K's
        u - 32, Q8_0's (u + 128) - 128), and d, m the block's scale and minimum as vector_matmul.block_scales
        expands them:
            q4 (Q4_0), q5, q8:  y = fma(d, dx * float(dot), y)
            q4 (Q4_1, Q4_K), q5m: y = fma(m, xs, fma(d, dx * float(dot), y))
            q6h, a scale per 16 inputs: y = fma(dx, fma(d1, float(dot1), d0 * float(dot0)), y), each
                half's dot less 32 times its own sum (xi per half: quantize_int8(x, 2))
        With the minimum term on the rounded sum, each block adds sum_i w_i dx xq_i: the file's weights
        times the rounded activations, so the error against the fp32 matmul is sum_i w_i e_i, |e_i| <= dx / 2.
    <kind>_linear_int8(x, qs, scales, [layout,] y): the two above.

The kernel, per tile of TILE (16) weight rows, one zmm of int32 sums a row (two for q6h: its halves): per
block, 8 weight lanes, each a dword a row holding the 4 codes that one activation dword multiplies
(_lanes says how each kind's bytes are moved there); vpdpbusd(acc, lane, broadcast activation dword)
adds each row's dot over those 4 inputs. One unpacked weight vector serves ROWS_AT_ONCE activation
rows (the rest of a call in passes of 4, 2, 1), each row's sums in CHAINS chains (vpdpbusd's latency).
vpdpbusd multiplies unsigned by signed bytes: the codes go on the unsigned side as unsigned integers and the
kinds' offsets come off through the activations' integer sums, once a block and row (the chain starts at
-offset xi); q8's signed codes are moved up by 128 (xor 0x80: an instruction a lane, shared by its rows). q6h's
scale per 16 inputs needs each dword within one half, hence its activations in the inputs' order. The
epilogue is a multiply and two FMAs a row and block (one FMA for Q4_0, Q5_0, Q8_0), which on a Zen 4 take
the two pipes vpdpbusd takes: by that count 88 (Q4_0 80) cycles a block of 8 rows where the vpdpbusd alone
take 64. Needs AVX512-VNNI (features.VNNI): elsewhere the kernels' intrinsic refuses to compile.

Measured (bench/int8_matmul.py; Zen 4 EPYC, a core runs 3.65 G zmm vpdpbusd a second, 233 G
u8 x s8 multiply-adds): a 2048 x 2048 matmul on one thread at 16 to 512 rows took the int16
kernels 84-94 GMAC/s, the q4 kernel 153-159 (Q4_K) and 162-171 (Q4_0, 151-161 before its minimum went
into the integers): 1.7-1.8x, and 1.2x at 1 row from the caches. ROWS_AT_ONCE 4: 124-151; 12:
151-163; 16: 132-161 (spills); CHAINS 2 no faster than 1. The kinds added after, in one run of the bench on
2 threads (a 2-core Zen 4, quiet), int16 time / int8 time over the three matrices of a 1.7B llama at 1, 4, 16
and 64 rows: Q8_0 1.02-1.04, 1.18-1.30, 1.40-1.60, 1.58-1.64; Q6_K 1.12-1.17, 1.44-1.52, 1.62-1.90,
1.77-1.91; Q5_K 1.09, 1.47-1.54, 1.72-1.75, 1.71-1.74; Q5_1 1.10-1.12, 1.55-1.61, 1.76-1.78, 1.76-1.78;
Q5_0 1.23-1.26, 1.58-1.67, 1.95-1.98, 1.97-2.00 (q4 in the same run: Q4_K 1.26-1.28 at 1 row, 1.65-1.68 at
64; Q4_0 1.16-1.31, 1.83-1.88). At 1 row from DRAM (a decode step's weights) the two run alike.

Unlike vector_matmul's kernels, FMA makes no promise of bit-identity with any other path: a row's
output still does not depend on the other rows or how many there are (the same instructions per
row whichever pass it is in), but it differs from the int16 kernels' by the int8 rounding.

Numba's cache ordering (numba/numba#8578): a cached function calling a parallel one segfaults if
the process loads it from the cache before its callee; call compile_int8_kernels() first.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.features import LANES, VNNI
from kvgen.cpu.llvm_ir import (
    FLOATS,
    I8,
    I16,
    I32,
    INTS,
    add_all,
    arguments,
    broadcast,
    fma,
    i64,
    largest_magnitude,
    load_block,
    splat,
    vector,
)
from kvgen.cpu.threads import PARTS
from kvgen.cpu.vector_matmul import (
    F16,
    F16_MIN,
    KINDS,
    LAYOUTS,
    PACKED,
    SUB,
    SUB_MIN,
    TILE,
    _bad_layout,
    _check_sums,
    block_scales,
    check_shapes,
    scale_shape,
)

# Activation rows one unpacked weight vector serves (the rest of a call in passes of 4, 2, 1), and
# independent vpdpbusd chains a row's block dot (each half's, q6h) is summed in.
ROWS_AT_ONCE = 8
CHAINS = 1
# Rows from which quantize_int8 splits the rows among the threads.
ROUND_IN_PARALLEL = 16
_PAIRS = 8  # dwords of activations a block: 4 inputs each
# The int8 kernels' kinds and what each takes off its codes in the integers (offset times the activations'
# integer sum: the codes sit on vpdpbusd's unsigned side, as unsigned integers).
OFFSETS = {"q4": 8, "q5": 16, "q5m": 0, "q8": 128, "q6h": 32}  # q4: Q4_0 (F16) only; Q4_1, Q4_K take m xs


def _dpbusd(builder, acc, u8, s8):
    """acc + per dword the sum of 4 u8 x s8 byte products (vpdpbusd): u8 the weights' lanes, s8
    the activations' broadcast dword (folded into the instruction as a {1to16} load)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(INTS, [INTS, INTS, INTS]),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, u8, s8])


def _dwords(value: int):
    """value (32 bits) in every dword of a vector, as the signed int32 LLVM's constants take."""
    return vector(I32, [value - (1 << 32) if value >= 1 << 31 else value] * TILE)


def _shifted(builder, v, by: int):
    """v << by (by > 0), v >> by (by < 0, logical) or v, per dword."""
    if by > 0:
        return builder.shl(v, _dwords(by))
    return builder.lshr(v, _dwords(-by)) if by < 0 else v


def _offset(kind: str, layout: int) -> int:
    """What the kernel takes off a block's dot in the integers (offset x its activations' sum)."""
    return OFFSETS[kind] if kind != "q4" or layout == F16 else 0


def _lanes(builder, kind: str, load) -> list:
    """One tile's block of weights as vpdpbusd's unsigned operand: [(dword p, half h, lane)], lane a
    vector of TILE dwords, row c's the 4 codes (as unsigned bytes, the offset not taken) of the inputs
    the activations' dword p holds. load(pair): a code pair's 32 bytes as TILE words, row c's 2 bytes.

    q4, q5, q5m (activations in q4's order, dword p: inputs 2p, 2p+1, 2p+16, 2p+17): the nibble pair p
    zero-extended (vpmovzxwd) and spread, (w | w << 12) & 0x0F0F0F0F, bytes [lo(b0), lo(b1), hi(b0),
    hi(b1)]. A packed kind's high bit (bit i of plane byte j for input j + 4 i) is bit p // 2 of the plane
    pair p mod 2 spread the same way (t = h | h << 12: byte 2's low nibble is h0's high one, the
    bits above p // 2 <= 3 never read), moved to bit 4; q5's plane holds u ^ 16, so it is flipped.
    q8 (the same order): pair p's and pair p + 8's words side by side, each code + 128 (xor 0x80).
    q6h (inputs in order, dword p: inputs 4p .. 4p+3, half p // 4): nibble pairs 2k and 2k+1 side by
    side, whose low nibbles are dword k and high ones dword 4 + k; plane pairs 8 + 2j, 9 + 2j side by side
    are the plane bytes 4j .. 4j+3, whose 2-bit fields i (bits 2i) are inputs 4j + 8i + 0..3: dword p's
    high bits are field p // 2 of plane dword p mod 2, held as u ^ 32 (xor 0xAA.. flips them back)."""
    def side_by_side(a: int, b: int):  # row c's dword: pair a's 2 bytes, then pair b's
        # two vpmovzxwd, a shift, an or: on Zen 4 Q8_0 ran 1.56-1.66x the int16 kernel at 64 rows (1.00-1.06x
        # at 1) where one vpermt2w of the two loads ran 1.36-1.44x (0.85-0.90x); Q6_K 1.77-1.92x, against 1.69-1.83x
        return builder.or_(builder.zext(load(a), INTS), builder.shl(builder.zext(load(b), INTS), _dwords(16)))

    if kind == "q8":
        return [(p, 0, builder.xor(side_by_side(p, p + 8), _dwords(0x80808080))) for p in range(_PAIRS)]
    if kind == "q6h":
        nibbles = [side_by_side(2 * k, 2 * k + 1) for k in range(4)]
        planes = [builder.xor(side_by_side(8 + 2 * j, 9 + 2 * j), _dwords(0xAAAAAAAA)) for j in range(2)]
        out = []
        for p in range(_PAIRS):
            low = builder.and_(_shifted(builder, nibbles[p % 4], -4 * (p // 4)), _dwords(0x0F0F0F0F))
            high = builder.and_(_shifted(builder, planes[p % 2], 4 - 2 * (p // 2)), _dwords(0x30303030))
            out.append((p, p // 4, builder.or_(low, high)))
        return out

    def spread(pair: int):  # [b0, b1, b0 >> 4, b1 >> 4] in a row's dword (bits above a byte's nibble left)
        w = builder.zext(load(pair), INTS)
        return builder.or_(w, builder.shl(w, _dwords(12)))

    planes = {}
    out = []
    for p in range(_PAIRS):
        lane = builder.and_(spread(p), _dwords(0x0F0F0F0F))
        if kind in PACKED:
            if p % 2 not in planes:
                t = spread(8 + p % 2)
                planes[p % 2] = builder.xor(t, _dwords(0xFFFFFFFF)) if PACKED[kind][1] else t
            lane = builder.or_(lane, builder.and_(_shifted(builder, planes[p % 2], 4 - p // 2), _dwords(0x10101010)))
        out.append((p, 0, lane))
    return out


def _tile_int8(kind: str, layout: int, rows: int):
    """An intrinsic: y[r, c] for `rows` activation rows and the TILE weight rows of one tile (the
    module docstring's sum, blocks in order, in registers). Arguments (arrays flat): codes, the
    tile's first code byte; groups; xq, row 0's first byte, the distance between rows (k); dx, xs,
    xi, row 0's first block; scales, the tile's first scale byte; y, row 0's first output, the
    distance between output rows."""
    pairs, halves, _ = KINDS[kind]
    offset = _offset(kind, layout)
    names = ("codes", "base", "groups", "xq", "xbase", "k", "dx", "xs", "xi", "sbase", "scales", "at", "y",
             "ybase", "ystride")
    words = ir.VectorType(I16, TILE)

    @intrinsic
    def tile_int8(typingctx, codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase, ystride):
        if not VNNI or LANES != TILE:
            raise TypeError("int8_matmul needs AVX512-VNNI")
        if xq.dtype != types.int8 or codes.dtype.bitwidth != 8 or xi.dtype != types.int32:
            raise TypeError("int8_matmul: xq, xi must be int8, int32 (quantize_int8's), the codes bytes")
        sig = types.void(codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase, ystride)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            total = [cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(rows)]
            with cgutils.for_range(builder, a["groups"]) as loop:
                g = loop.index
                q = at(a["codes"], a["base"], builder.mul(g, i64(pairs * TILE * 2)))
                xrow = [builder.bitcast(at(a["xq"], a["xbase"], builder.mul(a["k"], i64(i)), builder.mul(g, i64(32))),
                                        I32.as_pointer()) for i in range(rows)]
                blocks = [add_all(builder, (a["sbase"], builder.mul(a["groups"], i64(i)), g)) for i in range(rows)]
                # per row and half, CHAINS sums; the offset in the integers: the first starts at -offset xi
                chains = [[ir.Constant(INTS, None)] * (halves * CHAINS) for _ in range(rows)]
                if offset:
                    for i in range(rows):
                        for h in range(halves):
                            s = builder.load(at(a["xi"], builder.mul(blocks[i], i64(halves)), i64(h)))
                            chains[i][h * CHAINS] = broadcast(builder, builder.mul(s, ir.Constant(I32, -offset)), INTS)

                def load(pair, q=q):
                    ptr = builder.bitcast(builder.gep(q, [i64(pair * TILE * 2)]), words.as_pointer())
                    return builder.load(ptr, align=1)

                for p, h, lane in _lanes(builder, kind, load):
                    for i in range(rows):
                        c = h * CHAINS + p % CHAINS
                        v = builder.load(builder.gep(xrow[i], [i64(p)]), align=4)
                        chains[i][c] = _dpbusd(builder, chains[i][c], lane, broadcast(builder, v, INTS))
                scales = block_scales(builder, kind, layout, a["scales"], a["at"], g, 0)
                for i in range(rows):
                    dots = [builder.sitofp(add_all(builder, chains[i][h * CHAINS:(h + 1) * CHAINS]), FLOATS)
                            for h in range(halves)]
                    step = splat(builder, at(a["dx"], blocks[i]))
                    if halves == 2:  # dx (d0 dot0 + d1 dot1): one multiply fewer than each half's own dx
                        (d0, _), (d1, _) = scales
                        t = fma(builder, step, fma(builder, d1, dots[1], builder.fmul(d0, dots[0])),
                                builder.load(total[i]))
                    else:
                        ((d, m),) = scales
                        t = fma(builder, d, builder.fmul(step, dots[0]), builder.load(total[i]))
                        if m is not None and not offset:
                            t = fma(builder, m, splat(builder, at(a["xs"], blocks[i])), t)
                    builder.store(t, total[i])
            for i in range(rows):
                out = at(a["y"], a["ybase"], builder.mul(a["ystride"], i64(i)))
                builder.store(builder.load(total[i]), builder.bitcast(out, FLOATS.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_int8


def _rows_int8(kind: str, layout: int):
    """A tile's pass over the next ROWS_AT_ONCE, 4, 2 or 1 rows (Numba cannot pick an intrinsic
    from a tuple: the choice is spelled out). Returns the rows it did."""
    big, four, two, one = (_tile_int8(kind, layout, n) for n in (ROWS_AT_ONCE, 4, 2, 1))

    @njit(nogil=True, inline="always")
    def rows(n, codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase,
             ystride):  # pragma: no cover
        if n >= ROWS_AT_ONCE:
            big(codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase, ystride)
            return ROWS_AT_ONCE
        if n >= 4:
            four(codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase, ystride)
            return 4
        if n >= 2:
            two(codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase, ystride)
            return 2
        one(codes, base, groups, xq, xbase, k, dx, xs, xi, sbase, scales, at, y, ybase, ystride)
        return 1

    return rows


_q4_f16, _q4_f16_min, _q4_sub_min = (_rows_int8("q4", layout) for layout in LAYOUTS["q4"])
_q8_f16, _q8_sub = (_rows_int8("q8", layout) for layout in LAYOUTS["q8"])
_q5_f16 = _rows_int8("q5", F16)
_q5m_f16_min, _q5m_sub_min = (_rows_int8("q5m", layout) for layout in LAYOUTS["q5m"])
_q6h_sub = _rows_int8("q6h", SUB)


# The matmuls: y [M, >= N] from quantize_int8's xq, dx, xs, xi (halves 2 for q6h, else 1), a BlockLinear's
# qs and scales, its layout. The tiles cut in runs of consecutive tiles, one a thread, as vector_matmul's; a
# tile's rows in passes of ROWS_AT_ONCE, 4, 2, 1 (each row's instructions the same whichever pass it is in).

@njit(nogil=True, inline="always")
def _flat(xq, dx, xs, xi, qs, scales, y):  # pragma: no cover - compiled
    """The arrays flat, as the intrinsics read them, and a tile's codes' and scales' sizes."""
    codes, sf = qs.reshape(-1), scales.reshape(-1)
    return (codes, xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), xi.reshape(-1), sf, y.reshape(-1),
            codes.size // qs.shape[0], sf.size // qs.shape[0])


@njit(parallel=True, cache=True, nogil=True)
def q4_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y):  # pragma: no cover - compiled
    """Q4_0 (F16), Q4_1 (F16_MIN), Q4_K (SUB_MIN)."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 8, 1, scales, layout, y)
    _check_sums(xs, dx, 1)
    _check_sums(xi, dx, 1)
    if layout != F16 and layout != F16_MIN and layout != SUB_MIN:
        _bad_layout()
    codes, xf, dxf, xsf, xif, sf, yf, per_tile, per_scales = _flat(xq, dx, xs, xi, qs, scales, y)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            r0 = 0
            while r0 < rows:
                n, yat = rows - r0, r0 * y.shape[1] + t * TILE
                if layout == F16:
                    n = _q4_f16(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                t * per_scales, yf, yat, y.shape[1])
                elif layout == F16_MIN:
                    n = _q4_f16_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                    t * per_scales, yf, yat, y.shape[1])
                else:
                    n = _q4_sub_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                    t * per_scales, yf, yat, y.shape[1])
                r0 += n


@njit(parallel=True, cache=True, nogil=True)
def q8_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y):  # pragma: no cover - compiled
    """Q8_0 (F16); SUB (int8 codes under super-block scales, vector_matmul.q8_matmul's)."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 16, 1, scales, layout, y)
    _check_sums(xs, dx, 1)
    _check_sums(xi, dx, 1)
    if layout != F16 and layout != SUB:
        _bad_layout()
    codes, xf, dxf, xsf, xif, sf, yf, per_tile, per_scales = _flat(xq, dx, xs, xi, qs, scales, y)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            r0 = 0
            while r0 < rows:
                n, yat = rows - r0, r0 * y.shape[1] + t * TILE
                if layout == F16:
                    n = _q8_f16(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                t * per_scales, yf, yat, y.shape[1])
                else:
                    n = _q8_sub(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                t * per_scales, yf, yat, y.shape[1])
                r0 += n


@njit(parallel=True, cache=True, nogil=True)
def q5_matmul_int8(xq, dx, xs, xi, qs, scales, y):  # pragma: no cover - compiled
    """Q5_0: packed 5-bit codes less 16, layout F16."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 10, 1, scales, F16, y)
    _check_sums(xs, dx, 1)
    _check_sums(xi, dx, 1)
    codes, xf, dxf, xsf, xif, sf, yf, per_tile, per_scales = _flat(xq, dx, xs, xi, qs, scales, y)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            r0 = 0
            while r0 < rows:
                r0 += _q5_f16(rows - r0, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups,
                              sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q5m_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y):  # pragma: no cover - compiled
    """Q5_1 (F16_MIN), Q5_K (SUB_MIN): packed 5-bit codes with q4's minimum term."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 10, 1, scales, layout, y)
    _check_sums(xs, dx, 1)
    _check_sums(xi, dx, 1)
    if layout != F16_MIN and layout != SUB_MIN:
        _bad_layout()
    codes, xf, dxf, xsf, xif, sf, yf, per_tile, per_scales = _flat(xq, dx, xs, xi, qs, scales, y)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            r0 = 0
            while r0 < rows:
                n, yat = rows - r0, r0 * y.shape[1] + t * TILE
                if layout == F16_MIN:
                    n = _q5m_f16_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                     t * per_scales, yf, yat, y.shape[1])
                else:
                    n = _q5m_sub_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                     t * per_scales, yf, yat, y.shape[1])
                r0 += n


@njit(parallel=True, cache=True, nogil=True)
def q6h_matmul_int8(xq, dx, xs, xi, qs, scales, y):  # pragma: no cover - compiled
    """Q6_K: packed 6-bit codes less 32, a scale per 16 inputs (layout SUB); the activations in input
    order, xi per half (quantize_int8(x, 2))."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 12, 2, scales, SUB, y)
    _check_sums(xs, dx, 1)
    _check_sums(xi, dx, 2)
    codes, xf, dxf, xsf, xif, sf, yf, per_tile, per_scales = _flat(xq, dx, xs, xi, qs, scales, y)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            r0 = 0
            while r0 < rows:
                r0 += _q6h_sub(rows - r0, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups,
                               sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


_F16 = ir.VectorType(ir.FloatType(), 16)
_I32X16 = ir.VectorType(I32, 16)
# The activations' byte orders: q4's (dword p: [q(2p), q(2p+1), q(2p+16), q(2p+17)] from (q(0..15), q(16..31)),
# the inputs a nibble pair covers) and the inputs' own (dword p: inputs 4p .. 4p+3, within one half of 16)
_ORDER = [2 * p + e if e < 2 else 16 + 2 * p + e - 2 for p in range(_PAIRS) for e in range(4)]
_IN_ORDER = list(range(32))


def _rounding(order: list, halves: int):
    """An intrinsic rounding one row's blocks (the module docstring's rule), its bytes in `order`, an
    integer sum a block (halves 1) or one per 16 inputs (2)."""

    @intrinsic
    def round_blocks(typingctx, x, xq, dx, xs, xi, groups):
        """Per block g of 32 inputs of one row (contiguous): dx[g] = top / 127, xq's 32 bytes the codes
        rint(x 127 / top) in `order`, xi[g] (xi[2g], xi[2g + 1]: each half's) their integer sum, xs[g] =
        dx[g] times the block's; top the block's largest |x| (a zero block: codes 0, dx 0)."""
        if x.dtype != types.float32 or xq.dtype != types.int8 or xi.dtype != types.int32:
            raise TypeError("quantize_int8: x must be float32 (xq int8, xi int32)")
        sig = types.void(x, xq, dx, xs, xi, groups)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, ("x", "xq", "dx", "xs", "xi", "groups"))
            f32 = ir.FloatType()
            rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F16, [_F16]), "llvm.rint.v16f32")
            reduce_add = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [_I32X16]),
                                                        "llvm.vector.reduce.add.v16i32")

            with cgutils.for_range(builder, a["groups"]) as loop:
                g = loop.index
                lo, hi = load_block(builder, a["x"], g)
                top = largest_magnitude(builder, lo, hi)  # the same block maximum as vector_matmul's int16 rounding
                step = builder.fdiv(top, ir.Constant(f32, 127.0))
                positive = builder.fcmp_ordered(">", top, ir.Constant(f32, 0.0))
                inv = builder.select(positive, builder.fdiv(ir.Constant(f32, 127.0), top), ir.Constant(f32, 0.0))
                inv = broadcast(builder, inv, _F16)
                ql, qh = (builder.fptosi(builder.call(rint, [builder.fmul(v, inv)]), _I32X16) for v in (lo, hi))
                if halves == 2:
                    sums = [builder.call(reduce_add, [ql]), builder.call(reduce_add, [qh])]
                    total = builder.add(*sums)
                else:
                    sums = [total] = [builder.call(reduce_add, [builder.add(ql, qh)])]
                builder.store(step, builder.gep(a["dx"], [g]))
                builder.store(builder.fmul(step, builder.sitofp(total, f32)), builder.gep(a["xs"], [g]))
                for h, s in enumerate(sums):
                    builder.store(s, builder.gep(a["xi"], [builder.add(builder.mul(g, i64(halves)), i64(h))]))
                small = ir.VectorType(I8, 16)
                codes = builder.shuffle_vector(builder.trunc(ql, small), builder.trunc(qh, small), vector(I32, order))
                out = builder.gep(a["xq"], [builder.mul(g, i64(32))])
                builder.store(codes, builder.bitcast(out, ir.VectorType(I8, 32).as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return round_blocks


_round_blocks_int8, _round_halves_int8 = _rounding(_ORDER, 1), _rounding(_IN_ORDER, 2)


@njit(nogil=True, inline="always")
def _round_row(x, xq, dx, xs, xi, halves):  # pragma: no cover - compiled
    if halves == 2:
        _round_halves_int8(x, xq, dx, xs, xi, dx.shape[0])
    else:
        _round_blocks_int8(x, xq, dx, xs, xi, dx.shape[0])


@njit(parallel=True, cache=True, nogil=True)
def _quantize_parallel(x, xq, dx, xs, xi, halves):  # pragma: no cover - compiled
    rows = x.shape[0]
    parts = min(rows, PARTS)
    for part in prange(parts):
        for r in range(part * rows // parts, (part + 1) * rows // parts):
            _round_row(x[r], xq[r], dx[r], xs[r], xi[r], halves)


@njit(cache=True, nogil=True)
def quantize_int8(x, halves=1):  # pragma: no cover - compiled
    """x [M, K] float32 (K a multiple of 32) -> (xq [M, K] int8 in the kernels' order, dx, xs [M, K/32]
    float32, xi int32 [M, K/32] (halves 1: q4's order) or [M, K/16] (halves 2: the inputs' order, a sum
    per 16 inputs)): the module docstring's rounding. Rows are cut among the threads from ROUND_IN_PARALLEL
    rows; a row's numbers are the same either way."""
    if x.shape[1] % 32:
        raise ValueError("quantize_int8: the inputs are not whole blocks of 32")
    if halves != 1 and halves != 2:
        raise ValueError("quantize_int8: halves must be 1 or 2")
    rows, groups = x.shape[0], x.shape[1] // 32
    x = np.ascontiguousarray(x)
    xq = np.empty(x.shape, np.int8)
    dx, xs = np.empty((rows, groups), np.float32), np.empty((rows, groups), np.float32)
    xi = np.empty((rows, halves * groups), np.int32)
    if rows >= ROUND_IN_PARALLEL:
        _quantize_parallel(x, xq, dx, xs, xi, halves)
    else:
        for r in range(rows):
            _round_row(x[r], xq[r], dx[r], xs[r], xi[r], halves)
    return xq, dx, xs, xi


# y = x W^T for a BlockLinear's qs, scales (and layout), x [M, K] float32 rounded to int8 per block of 32
# (quantize_int8), y [M, >= N] float32: block_matmul's linears under CPU_ACTIVATIONS=int8.

@njit(cache=True, nogil=True)
def q4_linear_int8(x, qs, scales, layout, y):  # pragma: no cover - compiled
    xq, dx, xs, xi = quantize_int8(x)
    q4_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y)


@njit(cache=True, nogil=True)
def q8_linear_int8(x, qs, scales, layout, y):  # pragma: no cover - compiled
    xq, dx, xs, xi = quantize_int8(x)
    q8_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y)


@njit(cache=True, nogil=True)
def q5_linear_int8(x, qs, scales, y):  # pragma: no cover - compiled
    xq, dx, xs, xi = quantize_int8(x)
    q5_matmul_int8(xq, dx, xs, xi, qs, scales, y)


@njit(cache=True, nogil=True)
def q5m_linear_int8(x, qs, scales, layout, y):  # pragma: no cover - compiled
    xq, dx, xs, xi = quantize_int8(x)
    q5m_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y)


@njit(cache=True, nogil=True)
def q6h_linear_int8(x, qs, scales, y):  # pragma: no cover - compiled
    xq, dx, xs, xi = quantize_int8(x, 2)
    q6h_matmul_int8(xq, dx, xs, xi, qs, scales, y)


def unorder(xq: np.ndarray, halves: int = 1) -> np.ndarray:
    """quantize_int8's xq back in input order (for tests and checks): [M, K] int8."""
    if halves == 2:
        return xq.copy()
    rows, k = xq.shape
    out = np.empty_like(xq).reshape(rows, k // 32, 32)
    out[..., _ORDER] = xq.reshape(rows, k // 32, 32)
    return out.reshape(rows, k)


def compile_int8_kernels() -> None:
    """Compile (or load from the cache) this module's kernels, the parallel callees first
    (numba/numba#8578): call before any linear or quantize_int8 here in a process."""
    if not VNNI:
        return
    x = np.zeros((ROUND_IN_PARALLEL, 256), np.float32)  # one super-block: every layout's shapes hold
    xq, dx, xs = np.zeros(x.shape, np.int8), np.zeros((len(x), 8), np.float32), np.zeros((len(x), 8), np.float32)
    xi, xi2 = np.zeros((len(x), 8), np.int32), np.zeros((len(x), 16), np.int32)
    _quantize_parallel(x, xq, dx, xs, xi, 1)
    y = np.zeros((len(x), TILE), np.float32)

    def codes(pairs: int, dtype=np.uint8) -> np.ndarray:
        return np.zeros((1, 8, pairs, TILE, 2), dtype)

    def scales(layout: int, halves: int = 1) -> np.ndarray:
        return np.zeros((1, *scale_shape.py_func(layout, halves, 8)), np.uint8)

    q4_matmul_int8(xq, dx, xs, xi, codes(8), scales(SUB_MIN), SUB_MIN, y)
    q8_matmul_int8(xq, dx, xs, xi, codes(16, np.int8), scales(F16), F16, y)
    q5_matmul_int8(xq, dx, xs, xi, codes(10), scales(F16), y)
    q5m_matmul_int8(xq, dx, xs, xi, codes(10), scales(SUB_MIN), SUB_MIN, y)
    q6h_matmul_int8(xq, dx, xs, xi2, codes(12), scales(SUB, 2), y)
    quantize_int8(x)
    quantize_int8(x, 2)
    q4_linear_int8(x, codes(8), scales(SUB_MIN), SUB_MIN, y)
    q8_linear_int8(x, codes(16, np.int8), scales(F16), F16, y)
    q5_linear_int8(x, codes(10), scales(F16), y)
    q5m_linear_int8(x, codes(10), scales(SUB_MIN), SUB_MIN, y)
    q6h_linear_int8(x, codes(12), scales(SUB, 2), y)
