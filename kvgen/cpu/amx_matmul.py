"""The block matmuls of vector_matmul.py on AMX tiles, for steps of many rows (prompt chunks).

vector_matmul's pmaddwd / vpdpwssd kernels multiply int16 activations by the weights' codes 32
pairs an instruction. A CPU with AMX-INT8 (Sapphire Rapids and later) multiplies a 16 x 64 tile of
bytes by a 64 x 16 one, 16 K multiply-adds, in one TDPBUSD / TDPBSSD. The activations are int16,
so each is split in its bytes, x = 256 hi + lo (lo unsigned, hi signed), and a block's dot
product is 256 (hi . w) + (lo . w): two tile products, the same exact integer as vector_matmul's.
The rest is vector_matmul's float epilogue, the same operations in the same order, so every row's
output is bit-identical to what the vector kernels give it (a test holds both to that): a prompt
row's K/V and logits stay those of the same token decoded alone.

A tile of output rows (TILE = 16 weight rows) runs over all the call's activation rows, 16 at a
time. For each 32-input block g: its weight codes are unpacked once a call from vector_matmul's
layout into a B tile (8 rows of [row c, 4 inputs] bytes: TDP's layout) in a per-thread buffer;
the activation bytes are A tiles read straight from the split arrays (16 rows x 32 bytes); the
two int32 products go to memory, and the epilogue adds d (dx dot) + m xs into 16 float vectors,
one per activation row, kept in registers over the blocks.

Linux hands a process the AMX state only when asked (features.py asks); where that fails, or
the CPU (or NUMBA_CPU_FEATURES) has no AMX-INT8, features.AMX is False and the vector kernels
run every step (block_matmul.py chooses).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu import vector_matmul
from kvgen.cpu.llvm_ir import FLOATS, I8, I32, INTS, add_all, arguments, i64, splat, vector
from kvgen.cpu.threads import PARTS
from kvgen.cpu.vector_matmul import F16, F16_MIN, LAYOUTS, SUB, SUB_MIN, TILE

# Rows from which a call takes the tiles: below that the vector kernels' 4-row passes cost less
# than a 16-row tile pass padded with unused rows. Measured over a SmolLM2 layer's Q4_1 matmuls,
# both kernels alternating call by call (2-core Sapphire Rapids): the tiles took 0.66-0.95x the
# vector kernels' time at 12-15 rows, 0.88-1.14x at 10-11, 1.1-1.3x at 8 (16 here once left
# 15-row decode steps slower than 16-row ones).
AMX_FROM = 12
_ROWS = 16  # activation rows a tile holds
# Weight tiles unpacked at a time, each then run over all the rows: their B tiles stay in L2
# (74 KB at 576 inputs, 196 KB at 1536) while a row block's A tiles are read for 8 of them (one
# at a time, the A tiles of a 512-row chunk came from L2 again for every weight tile: 1.6x
# slower a row than at 64 rows).
TILES_AT_ONCE = 8

_VOID, _PTR = ir.VoidType(), ir.IntType(8).as_pointer()


def _amx(builder, name, *args):
    """One AMX instruction (the tile-number forms: tiles are numbered immediates)."""
    kinds = [a.type for a in args]
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, kinds), f"llvm.x86.{name}")
    return builder.call(fn, list(args))


def _tile(n):
    return ir.Constant(I8, n)


# Tiles: 2, 3 the lo and hi activation bytes (16 rows x 32); per weight tile of a pass (two at
# most), its lo and hi products (16 x 16 int32) and its weight block (8 rows of 16 x 4 bytes).
A_LO, A_HI = 2, 3
PRODUCTS = ((0, 1, 4), (5, 6, 7))


def tile_config() -> np.ndarray:
    """The 64-byte LDTILECFG operand for the tiles above (palette 1)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    shapes = {A_LO: (_ROWS, 32), A_HI: (_ROWS, 32)}
    for lo, hi, b in PRODUCTS:
        shapes.update({lo: (_ROWS, 64), hi: (_ROWS, 64), b: (8, 64)})
    for t, (r, c) in shapes.items():
        rows[t], colsb[t] = r, c
    return cfg


@intrinsic
def _configure(typingctx, cfg):
    """LDTILECFG cfg: each thread that runs tiles loads the configuration itself."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        _amx(builder, "ldtilecfg", builder.bitcast(data, _PTR))
        return context.get_dummy_value()

    return types.void(cfg), codegen


@intrinsic
def _release(typingctx):
    """TILERELEASE: the thread's tiles go back to their initial state (no 8 KB to save on a switch)."""
    def codegen(context, builder, signature, args):
        _amx(builder, "tilerelease")
        return context.get_dummy_value()

    return types.void(), codegen


def _unpack(kind: str):
    """An intrinsic: the weight blocks of one tile (vector_matmul's layout) as B tiles, 512 bytes a block."""
    pairs = 8 if kind == "q4" else 16
    half = ir.VectorType(I8, 32)
    words = ir.VectorType(ir.IntType(16), 16)
    row = ir.VectorType(I8, 64)

    @intrinsic
    def unpack(typingctx, codes, base, groups, out):
        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, ("codes", "base", "groups", "out"))
            with cgutils.for_range(builder, a["groups"]) as loop:
                g = loop.index
                q = builder.gep(a["codes"], [builder.add(a["base"], builder.mul(g, i64(pairs * TILE * 2)))])
                dst = builder.gep(a["out"], [builder.mul(g, i64(512))])
                for j in range(pairs // 2):  # B row j: inputs 4j .. 4j + 3 of each weight row
                    w0, w1 = (builder.bitcast(builder.load(builder.bitcast(builder.gep(q, [i64(32 * p)]),
                                                                           half.as_pointer()), align=1), words)
                              for p in (2 * j, 2 * j + 1))
                    # pair 2j's two bytes of row c, then pair 2j + 1's: row c's 4 inputs in a row
                    b = builder.bitcast(builder.shuffle_vector(w0, w1, vector(I32, [v for c in range(16)
                                                                                    for v in (c, 16 + c)])), row)
                    if kind == "q4":  # low nibbles: inputs 4j ..; high nibbles: 16 + 4j ..
                        put = [(j, builder.and_(b, vector(I8, [15] * 64))),
                               (j + 4, builder.lshr(b, vector(I8, [4] * 64)))]
                    else:
                        put = [(j, b)]
                    for at, v in put:
                        builder.store(v, builder.bitcast(builder.gep(dst, [i64(64 * at)]), row.as_pointer()),
                                      align=64)
            return context.get_dummy_value()

        return types.void(codes, base, groups, out), codegen

    return unpack


def _tile_pass(kind: str, layout: int, width: int):
    """An intrinsic: the output columns of `width` consecutive weight tiles (their B tiles one after
    the other in b) for activation rows r0 .. r0 + 15 (those below `rows`): y[r, c] = sum over
    blocks g of d[c, g] (dx[r, g] dot[r, c, g]) + m[c, g] xs[r, g], as vector_matmul._tile_linear
    computes it (d and m from the scales' bytes by the same vector_matmul.block_scales), the dots
    from the tiles. Two tiles a pass share the A tiles, and their four products are independent:
    one pass's tile instructions wait less on each other's results. at: the first tile's first
    scale byte; stride: a tile's scale bytes."""
    names = ("b", "groups", "a", "r0", "rows", "dx", "xs", "scales", "at", "stride", "y", "ybase", "ystride", "c")

    @intrinsic
    def tile_pass(typingctx, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c):
        sig = types.void(b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            # padding rows (past `rows`) read row r0's scales and are not stored
            mine = [builder.select(builder.icmp_signed("<", builder.add(a["r0"], i64(i)), a["rows"]),
                                   builder.add(a["r0"], i64(i)), a["r0"]) for i in range(_ROWS)]
            total = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(_ROWS)]
                     for _ in range(width)]
            ints = builder.bitcast(a["c"], INTS.as_pointer())
            c = builder.bitcast(a["c"], _PTR)
            with cgutils.for_range(builder, a["groups"]) as loop:
                g = loop.index
                # split()'s run for rows r0.. and block g: 16 x 32 lo bytes, then the hi bytes
                first = builder.mul(builder.add(builder.mul(a["r0"], a["groups"]), builder.mul(g, i64(_ROWS))),
                                    i64(64))
                _amx(builder, "tileloadd64", _tile(A_LO), builder.bitcast(at(a["a"], first), _PTR), i64(32))
                _amx(builder, "tileloadd64", _tile(A_HI), builder.bitcast(at(a["a"], first, i64(512)), _PTR),
                     i64(32))
                for w in range(width):
                    lo, hi, bt = PRODUCTS[w]
                    at_b = at(a["b"], builder.mul(builder.add(g, builder.mul(a["groups"], i64(w))), i64(512)))
                    _amx(builder, "tileloadd64", _tile(bt), builder.bitcast(at_b, _PTR), i64(64))
                    _amx(builder, "tilezero", _tile(lo))
                    _amx(builder, "tilezero", _tile(hi))
                    _amx(builder, "tdpbusd", _tile(lo), _tile(A_LO), _tile(bt))
                    _amx(builder, "tdpbssd", _tile(hi), _tile(A_HI), _tile(bt))
                for w in range(width):
                    lo, hi, _ = PRODUCTS[w]
                    _amx(builder, "tilestored64", _tile(lo), builder.gep(c, [i64(2048 * w)]), i64(64))
                    _amx(builder, "tilestored64", _tile(hi), builder.gep(c, [i64(2048 * w + 1024)]), i64(64))
                for w in range(width):
                    tile_at = builder.add(a["at"], builder.mul(a["stride"], i64(w)))
                    ((dv, mv),) = vector_matmul.block_scales(builder, kind, layout, a["scales"], tile_at, g, 0)
                    for i in range(_ROWS):
                        lo_dot = builder.load(builder.gep(ints, [i64(2 * _ROWS * w + i)]), align=64)
                        hi_dot = builder.load(builder.gep(ints, [i64(2 * _ROWS * w + _ROWS + i)]), align=64)
                        dot = builder.add(builder.shl(hi_dot, vector(I32, [8] * TILE)), lo_dot)
                        block = (builder.mul(mine[i], a["groups"]), g)
                        # vector_matmul._tile_linear's epilogue, operation for operation
                        term = builder.fmul(dv, builder.fmul(splat(builder, at(a["dx"], *block)),
                                                             builder.sitofp(dot, FLOATS)))
                        if kind == "q4":
                            term = builder.fadd(term, builder.fmul(mv, splat(builder,
                                                                                        at(a["xs"], *block))))
                        builder.store(builder.fadd(builder.load(total[w][i]), term), total[w][i])
            for i in range(_ROWS):
                r = builder.add(a["r0"], i64(i))
                with builder.if_then(builder.icmp_signed("<", r, a["rows"])):
                    for w in range(width):
                        out = at(a["y"], a["ybase"], builder.mul(a["ystride"], r), i64(TILE * w))
                        builder.store(builder.load(total[w][i]), builder.bitcast(out, FLOATS.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_pass


def _passes_of(kind: str, layout: int):
    """A pass of one or two weight tiles for one kind and scale layout (Numba cannot pick an
    intrinsic from a tuple: the choice is spelled out)."""
    one, two = _tile_pass(kind, layout, 1), _tile_pass(kind, layout, 2)

    @njit(nogil=True, inline="always")
    def passes(both, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c):  # pragma: no cover
        if both:
            two(b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)
        else:
            one(b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)

    return passes


_unpack_q4, _unpack_q8 = _unpack("q4"), _unpack("q8")
# the layouts of the kinds with tiles (vector_matmul.LAYOUTS)
_pass_q4_f16, _pass_q4_f16_min, _pass_q4_sub_min = (_passes_of("q4", layout) for layout in LAYOUTS["q4"])
_pass_q8_f16, _pass_q8_sub = (_passes_of("q8", layout) for layout in LAYOUTS["q8"])
_CONFIG = tile_config()


@intrinsic
def _block_bytes(typingctx, src, at, out, base):
    """32 int16 from src[at] -> their low bytes at out[base], their high bytes 512 further on."""
    words, half = ir.VectorType(ir.IntType(16), 32), ir.VectorType(I8, 32)

    def codegen(context, builder, signature, args):
        a = arguments(context, builder, signature, args, ("src", "at", "out", "base"))
        v = builder.load(builder.bitcast(builder.gep(a["src"], [a["at"]]), words.as_pointer()), align=2)
        to = builder.gep(a["out"], [a["base"]])
        builder.store(builder.trunc(v, half), builder.bitcast(to, half.as_pointer()), align=1)
        high = builder.trunc(builder.lshr(v, vector(ir.IntType(16), [8] * 32)), half)
        builder.store(high, builder.bitcast(builder.gep(to, [i64(_ROWS * 32)]), half.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(src, at, out, base), codegen


@njit(parallel=True, cache=True, nogil=True)
def split(xq):  # pragma: no cover - compiled
    """xq [M, K] int16 -> its bytes as A tiles: [row block, block g, lo | hi, 16 rows, 32] uint8,
    xq = 256 hi + lo (lo unsigned, hi signed), one 1 KB run a tile pass reads whole. The row
    blocks of the last tile are padded (those rows' outputs are never stored)."""
    rows, k = xq.shape
    groups = k // 32
    out = np.empty(-(-rows // _ROWS) * groups * 2 * _ROWS * 32, np.uint8)
    src = xq.reshape(-1)
    parts = min(rows, PARTS)
    for part in prange(parts):
        for r in range(part * rows // parts, (part + 1) * rows // parts):
            for g in range(groups):
                _block_bytes(src, r * k + g * 32, out, (((r // _ROWS) * groups + g) * 2 * _ROWS + r % _ROWS) * 32)
    return out


@njit(cache=True, nogil=True)
def q4_matmul(xq, dx, xs, qs, scales, layout, y):  # pragma: no cover - compiled
    """vector_matmul.q4_matmul on tiles (same arguments, same bits)."""
    vector_matmul.check_shapes(xq, dx, qs, 8, 1, scales, layout, y)
    vector_matmul._check_sums(xs, dx, 1)
    if layout != F16 and layout != F16_MIN and layout != SUB_MIN:
        vector_matmul._bad_layout()
    tile_matmul(True, layout, xq, dx, xs, qs, scales, y)


@njit(cache=True, nogil=True)
def q8_matmul(xq, dx, qs, scales, layout, y):  # pragma: no cover - compiled
    """vector_matmul.q8_matmul on tiles (same arguments, same bits)."""
    vector_matmul.check_shapes(xq, dx, qs, 16, 1, scales, layout, y)
    if layout != F16 and layout != SUB:
        vector_matmul._bad_layout()
    tile_matmul(False, layout, xq, dx, dx, qs, scales, y)  # q8 has no m: its xs are never read


@njit(parallel=True, cache=True, nogil=True)
def tile_matmul(q4, layout, xq, dx, xs, qs, scales, y):  # pragma: no cover - compiled
    """The weight tiles cut in runs, one a thread; each run TILES_AT_ONCE tiles at a time, unpacked,
    then every row block through them, two tiles a pass."""
    rows = xq.shape[0]
    tiles, groups = qs.shape[0], qs.shape[1]
    tiles_a = split(xq)
    codes, dxf, xsf, sf, yf = qs.reshape(-1), dx.reshape(-1), xs.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_b, per_scales = codes.size // tiles, groups * 512, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        b, c = np.empty(TILES_AT_ONCE * per_b + 64, np.int8), np.empty(4 * _ROWS * TILE + 16, np.int32)
        b, c = b[-b.ctypes.data % 64:], c[(-c.ctypes.data % 64) // 4:]  # 64-byte aligned
        _configure(_CONFIG)
        first, end = part * tiles // parts, (part + 1) * tiles // parts
        for t0 in range(first, end, TILES_AT_ONCE):
            n = min(TILES_AT_ONCE, end - t0)
            for j in range(n):
                if q4:
                    _unpack_q4(codes, (t0 + j) * per_tile, groups, b[j * per_b:])
                else:
                    _unpack_q8(codes, (t0 + j) * per_tile, groups, b[j * per_b:])
            for r0 in range(0, rows, _ROWS):
                for j in range(0, n, 2):
                    t = t0 + j
                    _pass(q4, layout, n - j >= 2, b[j * per_b:], groups, tiles_a, r0, rows, dxf, xsf, sf,
                          t * per_scales, per_scales, yf, t * TILE, y.shape[1], c)
        _release()


@njit(nogil=True, inline="always")
def _pass(q4, layout, two, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride,
          c):  # pragma: no cover
    """The pass of the kind and layout (Numba cannot pick an intrinsic from a tuple)."""
    if q4 and layout == F16:
        _pass_q4_f16(two, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)
    elif q4 and layout == F16_MIN:
        _pass_q4_f16_min(two, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)
    elif q4:
        _pass_q4_sub_min(two, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)
    elif layout == F16:
        _pass_q8_f16(two, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)
    else:
        _pass_q8_sub(two, b, groups, a, r0, rows, dx, xs, scales, at, stride, y, ybase, ystride, c)
