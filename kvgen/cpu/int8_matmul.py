"""q4 block matmuls with int8 activations and vpdpbusd: block_matmul.q4_linear's kernel, at every row
count, where CPU_ACTIVATIONS=int8 (features.INT8); the int16 kernels everywhere else.

vector_matmul rounds each activation row's block of 32 inputs to int16 (2^-16 of the block's
largest |x|) and multiplies by vpdpwssd, 32 int16 multiply-adds an instruction. Steps of many rows
(a prompt chunk, 16 decode streams) are then compute-bound, where llama.cpp, whose activations
are int8 (Q8_0 / Q8_K: 2^-8), multiplies 64 u8 x s8 pairs an instruction (vpdpbusd). This module
does the same for the q4 kind (Q4_0: F16, Q4_1: F16_MIN, Q4_K: SUB_MIN; the codes and scales
BlockLinear holds, read exactly as vector_matmul reads them); the other kinds keep int16.

What it computes:

    quantize_int8(x) -> (xq, dx, xs, xi): per row r and block g of 32 inputs, with top = the
        block's largest |x|, dx[r, g] = top / 127 (float32), and each x rounded half to even
        (llvm.rint) in steps of dx: q = rint(x * (127 / top)) in [-127, 127] (0 for a zero block);
        xi[r, g] = the block's integer sum of q (int32) and xs[r, g] = dx[r, g] * xi[r, g]
        (float32: llama.cpp's Q8_1 "s"). The codes are laid out for the kernel, xq [M, K] int8
        with block g's 32 bytes in 8 dwords, dword p holding [q(2p), q(2p+1), q(2p+16), q(2p+17)]:
        the 4 inputs one q4 code pair p covers.
    q4_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y): y[r, c] = sum over blocks g, in order,
        of fma(m[c, g], xs[r, g], fma(d[c, g], dx[r, g] * float(dot[r, c, g]), y)) where dot is
        the exact int32 dot of the block's 32 codes (0..15) and int8 activations, and d, m the
        block's scale and minimum as vector_matmul.block_scales expands them; for Q4_0 (m = -8 d)
        the minimum is taken in the integers, fma(d, dx * float(dot - 8 xi), y), one FMA less.
        With the minimum term on the rounded sum, each block adds sum_i (d q_i + m) dx xq_i: the
        weights (centred) times the rounded activations, so the error against the fp32 matmul is
        sum_i w_i e_i, |e_i| <= dx / 2.
    q4_linear_int8(x, qs, scales, layout, y): the two above.

The kernel, per tile of TILE (16) weight rows, one zmm of int32 sums: per block and code pair p,
the 32 bytes [16 rows][2 bytes] are zero-extended to dwords w (vpmovzxwd) and made one weight
lane per row, (w | w << 12) & 0x0F0F0F0F: bytes [lo(b0), lo(b1), hi(b0), hi(b1)], the codes of
inputs 2p, 2p+1, 2p+16, 2p+17 as unsigned bytes; vpdpbusd(acc, lane, broadcast activation dword)
adds each row's dot over those 4 inputs; 8 pairs make the block. One unpacked weight vector
serves ROWS_AT_ONCE activation rows (the rest of a call in passes of 4, 2, 1), each row's sums
in CHAINS chains (vpdpbusd's latency). The epilogue is a multiply and two FMAs a row and block
(one FMA for Q4_0), which on a Zen 4 take the two pipes vpdpbusd takes: by that count 88 (Q4_0
80) cycles a block of 8 rows where the vpdpbusd alone take 64. Needs AVX512-VNNI
(features.VNNI): elsewhere the kernel's intrinsic refuses to compile.

Measured (bench/int8_matmul.py; Zen 4 EPYC, a core runs 3.65 G zmm vpdpbusd a second, 233 G
u8 x s8 multiply-adds): a 2048 x 2048 matmul on one thread at 16 to 512 rows took the int16
kernels 84-94 GMAC/s, this one 153-159 (Q4_K) and 162-171 (Q4_0, 151-161 before its minimum went
into the integers): 1.7-1.8x, and 1.2x at 1 row from the caches. ROWS_AT_ONCE 4: 124-151; 12:
151-163; 16: 132-161 (spills); CHAINS 2 no faster than 1.

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
from kvgen.cpu.vector_matmul import (
    F16,
    F16_MIN,
    PARTS,
    SUB_MIN,
    TILE,
    _bad_layout,
    _check_sums,
    block_scales,
    check_shapes,
    scale_shape,
)

# Activation rows one unpacked weight vector serves (the rest of a call in passes of 4, 2, 1), and
# independent vpdpbusd chains a row's block dot is summed in.
ROWS_AT_ONCE = 8
CHAINS = 1
# Rows from which quantize_int8 splits the rows among the threads.
ROUND_IN_PARALLEL = 16
_PAIRS = 8  # code pairs a q4 block: [TILE rows][2 bytes] each, 4 inputs a row
_BLOCK_BYTES = _PAIRS * TILE * 2  # a tile's codes of one block


def _dpbusd(builder, acc, u8, s8):
    """acc + per dword the sum of 4 u8 x s8 byte products (vpdpbusd): u8 the weights' lanes, s8
    the activations' broadcast dword (folded into the instruction as a {1to16} load)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(INTS, [INTS, INTS, INTS]),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, u8, s8])


def _tile_int8(layout: int, rows: int):
    """An intrinsic: y[r, c] for `rows` activation rows and the TILE weight rows of one tile (the
    module docstring's sum, blocks in order, in registers). Arguments (arrays flat): codes, the
    tile's first code byte; groups; xq, row 0's first byte, the distance between rows (k); dx, xs,
    row 0's first block; scales, the tile's first scale byte; y, row 0's first output, the
    distance between output rows."""
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
            nibbles = vector(I32, [0x0F0F0F0F] * TILE)
            with cgutils.for_range(builder, a["groups"]) as loop:
                g = loop.index
                q = at(a["codes"], a["base"], builder.mul(g, i64(_BLOCK_BYTES)))
                xrow = [builder.bitcast(at(a["xq"], a["xbase"], builder.mul(a["k"], i64(i)), builder.mul(g, i64(32))),
                                        I32.as_pointer()) for i in range(rows)]
                chains = [[ir.Constant(INTS, None)] * CHAINS for _ in range(rows)]
                if layout == F16:  # Q4_0's minimum in the integers: chain 0 starts at -8 xi
                    for i in range(rows):
                        s = builder.load(at(a["xi"], a["sbase"], builder.mul(a["groups"], i64(i)), g))
                        chains[i][0] = broadcast(builder, builder.mul(s, ir.Constant(I32, -8)), INTS)
                for p in range(_PAIRS):
                    w = builder.load(builder.bitcast(builder.gep(q, [i64(p * TILE * 2)]), words.as_pointer()),
                                     align=1)
                    w = builder.zext(w, INTS)  # vpmovzxwd: row c's 2 bytes in dword c
                    lane = builder.and_(builder.or_(w, builder.shl(w, vector(I32, [12] * TILE))), nibbles)
                    for i in range(rows):
                        v = builder.load(builder.gep(xrow[i], [i64(p)]), align=4)
                        chains[i][p % CHAINS] = _dpbusd(builder, chains[i][p % CHAINS], lane,
                                                        broadcast(builder, v, INTS))
                ((d, m),) = block_scales(builder, "q4", layout, a["scales"], a["at"], g, 0)
                for i in range(rows):
                    block = (a["sbase"], builder.mul(a["groups"], i64(i)), g)
                    dot = builder.sitofp(add_all(builder, chains[i]), FLOATS)
                    t = fma(builder, d, builder.fmul(splat(builder, at(a["dx"], *block)), dot),
                            builder.load(total[i]))
                    if layout != F16:
                        t = fma(builder, m, splat(builder, at(a["xs"], *block)), t)
                    builder.store(t, total[i])
            for i in range(rows):
                out = at(a["y"], a["ybase"], builder.mul(a["ystride"], i64(i)))
                builder.store(builder.load(total[i]), builder.bitcast(out, FLOATS.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_int8


def _rows_int8(layout: int):
    """A tile's pass over the next ROWS_AT_ONCE, 4, 2 or 1 rows (Numba cannot pick an intrinsic
    from a tuple: the choice is spelled out). Returns the rows it did."""
    big, four, two, one = (_tile_int8(layout, n) for n in (ROWS_AT_ONCE, 4, 2, 1))

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


_f16, _f16_min, _sub_min = _rows_int8(F16), _rows_int8(F16_MIN), _rows_int8(SUB_MIN)


@njit(parallel=True, cache=True, nogil=True)
def q4_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y):  # pragma: no cover - compiled
    """y [M, >= N] = the module docstring's sum: xq [M, K] int8, dx, xs [M, K/32] float32, xi
    [M, K/32] int32 (quantize_int8's), qs and scales a q4 BlockLinear's, layout F16 / F16_MIN / SUB_MIN. The tiles
    cut in runs of consecutive tiles, one a thread, as vector_matmul.q4_matmul."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, _PAIRS, 1, scales, layout, y)
    _check_sums(xs, dx, 1)
    _check_sums(xi, dx, 1)
    if layout != F16 and layout != F16_MIN and layout != SUB_MIN:
        _bad_layout()
    codes, xf, dxf, xsf, xif, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), \
        xi.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            r0 = 0
            while r0 < rows:
                n, yat = rows - r0, r0 * y.shape[1] + t * TILE
                if layout == F16:
                    n = _f16(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                             t * per_scales, yf, yat, y.shape[1])
                elif layout == F16_MIN:
                    n = _f16_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                 t * per_scales, yf, yat, y.shape[1])
                else:
                    n = _sub_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, xif, r0 * groups, sf,
                                 t * per_scales, yf, yat, y.shape[1])
                r0 += n


_F16 = ir.VectorType(ir.FloatType(), 16)
_I32X16 = ir.VectorType(I32, 16)
# dword p of a block's 32 bytes: [q(2p), q(2p+1), q(2p+16), q(2p+17)] from (q(0..15), q(16..31))
_ORDER = [2 * p + e if e < 2 else 16 + 2 * p + e - 2 for p in range(_PAIRS) for e in range(4)]


@intrinsic
def _round_blocks_int8(typingctx, x, xq, dx, xs, xi, groups):
    """Per block g of 32 inputs of one row (contiguous): dx[g] = top / 127, xq's 32 bytes the
    codes rint(x 127 / top) in the kernel's order, xi[g] their integer sum, xs[g] = dx[g] xi[g];
    top the block's largest |x| (a zero block: codes 0, dx 0)."""
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
            total = builder.call(reduce_add, [builder.add(ql, qh)])
            builder.store(step, builder.gep(a["dx"], [g]))
            builder.store(builder.fmul(step, builder.sitofp(total, f32)), builder.gep(a["xs"], [g]))
            builder.store(total, builder.gep(a["xi"], [g]))
            small = ir.VectorType(I8, 16)
            codes = builder.shuffle_vector(builder.trunc(ql, small), builder.trunc(qh, small), vector(I32, _ORDER))
            out = builder.gep(a["xq"], [builder.mul(g, i64(32))])
            builder.store(codes, builder.bitcast(out, ir.VectorType(I8, 32).as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def _quantize_parallel(x, xq, dx, xs, xi):  # pragma: no cover - compiled
    rows, groups = x.shape[0], x.shape[1] // 32
    parts = min(rows, PARTS)
    for part in prange(parts):
        for r in range(part * rows // parts, (part + 1) * rows // parts):
            _round_blocks_int8(x[r], xq[r], dx[r], xs[r], xi[r], groups)


@njit(cache=True, nogil=True)
def quantize_int8(x):  # pragma: no cover - compiled
    """x [M, K] float32 (K a multiple of 32) -> (xq [M, K] int8 in the kernel's order, dx, xs
    [M, K/32] float32, xi [M, K/32] int32): the module docstring's rounding. Rows are cut among the threads from
    ROUND_IN_PARALLEL rows; a row's numbers are the same either way."""
    if x.shape[1] % 32:
        raise ValueError("quantize_int8: the inputs are not whole blocks of 32")
    rows, groups = x.shape[0], x.shape[1] // 32
    x = np.ascontiguousarray(x)
    xq = np.empty(x.shape, np.int8)
    dx, xs = np.empty((rows, groups), np.float32), np.empty((rows, groups), np.float32)
    xi = np.empty((rows, groups), np.int32)
    if rows >= ROUND_IN_PARALLEL:
        _quantize_parallel(x, xq, dx, xs, xi)
    else:
        for r in range(rows):
            _round_blocks_int8(x[r], xq[r], dx[r], xs[r], xi[r], groups)
    return xq, dx, xs, xi


@njit(cache=True, nogil=True)
def q4_linear_int8(x, qs, scales, layout, y):  # pragma: no cover - compiled
    """y = x W^T for a q4 weight (a BlockLinear's qs, scales, layout), x [M, K] float32 rounded to
    int8 per block of 32 (quantize_int8), y [M, >= N] float32."""
    xq, dx, xs, xi = quantize_int8(x)
    q4_matmul_int8(xq, dx, xs, xi, qs, scales, layout, y)


def unorder(xq: np.ndarray) -> np.ndarray:
    """quantize_int8's xq back in input order (for tests and checks): [M, K] int8."""
    rows, k = xq.shape
    out = np.empty_like(xq).reshape(rows, k // 32, 32)
    out[..., _ORDER] = xq.reshape(rows, k // 32, 32)
    return out.reshape(rows, k)


def compile_int8_kernels() -> None:
    """Compile (or load from the cache) this module's kernels, the parallel callees first
    (numba/numba#8578): call before q4_linear_int8 or quantize_int8 in a process."""
    if not VNNI:
        return
    x = np.zeros((ROUND_IN_PARALLEL, 256), np.float32)
    xq, dx, xs = np.zeros(x.shape, np.int8), np.zeros((len(x), 8), np.float32), np.zeros((len(x), 8), np.float32)
    xi = np.zeros((len(x), 8), np.int32)
    _quantize_parallel(x, xq, dx, xs, xi)
    y = np.zeros((len(x), TILE), np.float32)
    qs = np.zeros((1, 8, _PAIRS, TILE, 2), np.uint8)
    scales = np.zeros((1, *scale_shape.py_func(SUB_MIN, 1, 8)), np.uint8)  # one super-block
    q4_matmul_int8(xq, dx, xs, xi, qs, scales, SUB_MIN, y)
    quantize_int8(x)
    q4_linear_int8(x, qs, scales, SUB_MIN, y)
