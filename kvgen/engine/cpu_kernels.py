"""Numba CPU kernels: y = x W^T with W in GGUF's own blocks (Q4_0 / Q4_1 / Q8_0).

At batch 1 a decode step reads every weight once, so its speed is the weights' bytes over the
memory bandwidth, if the multiply keeps up: Q4_1 is 5 bits a weight against fp32's 32. Converting
each 4-bit code to a float and multiplying it by an fp32 activation does not keep up on a 2-core
AVX2 CPU (6 instructions per 8 weights: the kernels ran at 11 GB/s where the machine reads 27).

So the activations are integers too. `quantize` rounds each row's block of 32 inputs to int16 with
a scale of its own (the block's largest |x| / 32767): a relative error of 2^-16 of the block's
largest value, where llama.cpp's Q8 activations have 2^-8. Then a block's dot product with a row
of weight codes is exact integer arithmetic, done 16 products at a time by pmaddwd (int16 pairs
multiplied and summed into int32): 32 Q4 weights cost 7 instructions. What is left in floats is
each block's integer sum times the weight row's and the activation block's scales, added in the
same order whatever the batch: a row's output does not depend on the other rows, and the integer
sums are exact whichever instructions compute them.

Layout (blocks.py makes it): the output rows are cut in tiles of TILE rows; for one tile and
block, the bytes are ordered [pair p, row c, e], so one 16-byte load holds 8 rows' weights for
two neighbouring inputs (the pair pmaddwd sums), and the activation pair is one int32 broadcast:

    q4: qs [N/TILE, G, 8, TILE, 2] uint8: byte (p, c, e) holds input 2p+e of row c (low nibble)
        and input 2p+e+16 (high); value = d * q + m (Q4_0: m = -8 d)
    q8: qs [N/TILE, G, 16, TILE, 2] int8: byte (p, c, e) holds input 2p+e; value = d * q
    d, m: [N/TILE, G, TILE] float32;  xq [M, K] int16;  dx, xs [M, G] float32;  y [M, N] float32

The inner dot product is written in LLVM IR (`_tile_dots`), since Numba has no vector types:
pmaddwd as the AVX2 intrinsic where the CPU has it, else the portable multiply-and-add pattern
that LLVM lowers to whatever the CPU has (the sums are the same integers either way). Numba
caches the compiled kernels per CPU, so a cache made on one CPU is not used on another.

The kernels release the GIL (nogil): the engine thread runs them while the server's event loop
goes on serving other calls, as it does during torch's ops.

Numba's disk cache for these kernels lives in a folder named by a hash of the engine's sources
and of the code path (numba_cache.py says why).

Threads: the kernels run on Numba's OpenMP layer. It links the system's libgomp by a file name
torch's bundled copy does not answer to, so the engine thread holds two worker pools, torch's and
this one (threads.py says why extra pools cost). The measured speeds include that cost. A fused
step runs almost nothing in torch, so there the two pools do not compete.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.engine import numba_cache

# Output rows per tile: 8 rows of int32 sums per vector, 8 vectors (the tile's rows) per block
# live in registers across the block's 16 pairs of inputs.
TILE = 64
ROWS_AT_ONCE = 4  # activation rows that share one conversion of the weight codes
# A call splits its tiles in at most this many runs of consecutive tiles, one per thread, so a
# thread allocates its scratch once per call: allocating it per tile cost ~20% of a batch-1 step.
PARTS = numba.config.NUMBA_NUM_THREADS
numba.config.THREADING_LAYER = "omp"  # the same runtime kind as torch's (see Threads above)

# The features Numba compiles for: the host's, or NUMBA_CPU_FEATURES where set (the tests build
# the portable pattern on an AVX2 CPU that way, with "-avx2").
binding.initialize_native_target()
FEATURES = numba.config.CPU_FEATURES or binding.get_host_cpu_features().flatten()
PMADDWD = "+avx2" in FEATURES.split(",")

# Before any cached function is defined (numba_cache.py says why); the salt keeps builds for
# different features apart.
numba_cache.use_cache_dir(f"{FEATURES} parts={PARTS}")

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_BYTES16, _WORDS16, _INTS8 = ir.VectorType(_I8, 16), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)


def _lanes(ty, values):
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


def _madd(builder, a, b):
    """<16 x i16> a, b -> <8 x i32>: a[2i] b[2i] + a[2i+1] b[2i+1] (one pmaddwd)."""
    if PMADDWD:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_INTS8, [_WORDS16, _WORDS16]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [a, b])
    even, odd = _lanes(_I32, range(0, 16, 2)), _lanes(_I32, range(1, 16, 2))
    half = [builder.sext(builder.shuffle_vector(v, v, idx), _INTS8) for v in (a, b) for idx in (even, odd)]
    return builder.add(builder.mul(half[0], half[2]), builder.mul(half[1], half[3]))


def _pair(builder, x, index):
    """The int16 pair x[2 index], x[2 index + 1] broadcast to 16 lanes (x: an i32 pointer)."""
    v = builder.load(builder.gep(x, [ir.Constant(_I64, index)]), align=4)
    v = builder.insert_element(ir.Constant(_INTS8, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.bitcast(builder.shuffle_vector(v, v, _lanes(_I32, [0] * 8)), _WORDS16)


def _tile_dots(kind: str, rows: int):
    """An intrinsic: dots[i, c] = sum over the block's 32 inputs of code[c, j] * xq[row i, j], for
    the tile's TILE weight rows c and `rows` activation rows (exact int32).
    Arguments: codes (the flat qs), the block's first byte, xq (flat int16), row 0's first input of
    the block, the distance between activation rows, dots [ROWS_AT_ONCE, TILE] int32."""
    pairs = 8 if kind == "q4" else 16

    @intrinsic
    def tile_dots(typingctx, codes, base, xq, xbase, xstride, dots):
        sig = types.void(codes, base, xq, xbase, xstride, dots)

        def codegen(context, builder, signature, args):
            codes_v, base_v, xq_v, xbase_v, xstride_v, dots_v = args
            data = [context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 2, 5)]
            q = builder.gep(data[0], [base_v])
            starts = [builder.add(xbase_v, builder.mul(xstride_v, ir.Constant(_I64, i))) for i in range(rows)]
            xs = [builder.bitcast(builder.gep(data[1], [at]), _I32.as_pointer()) for at in starts]
            out = builder.bitcast(data[2], _INTS8.as_pointer())
            for cg in range(TILE // 8):  # 8 weight rows at a time
                acc = [ir.Constant(_INTS8, None)] * rows
                for p in range(pairs):
                    at = builder.gep(q, [ir.Constant(_I64, (p * TILE + cg * 8) * 2)])
                    w = builder.load(builder.bitcast(at, _BYTES16.as_pointer()), align=1)
                    if kind == "q4":
                        w = builder.zext(w, _WORDS16)
                        lo, hi = builder.and_(w, _lanes(_I16, [15] * 16)), builder.lshr(w, _lanes(_I16, [4] * 16))
                        for i in range(rows):
                            s = builder.add(_madd(builder, lo, _pair(builder, xs[i], p)),
                                            _madd(builder, hi, _pair(builder, xs[i], 8 + p)))
                            acc[i] = builder.add(acc[i], s)
                    else:
                        w = builder.sext(w, _WORDS16)
                        for i in range(rows):
                            acc[i] = builder.add(acc[i], _madd(builder, w, _pair(builder, xs[i], p)))
                for i in range(rows):
                    builder.store(acc[i], builder.gep(out, [ir.Constant(_I64, i * TILE // 8 + cg)]), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dots


_q4_1, _q4_2, _q4_3, _q4_4 = (_tile_dots("q4", n) for n in range(1, ROWS_AT_ONCE + 1))
_q8_1, _q8_2, _q8_3, _q8_4 = (_tile_dots("q8", n) for n in range(1, ROWS_AT_ONCE + 1))


# No fastmath in what follows: with it LLVM may fuse a multiply-add either way and reorder sums,
# differently in two compilations, and a row's output would then depend on which build ran it
# (none of these loops needs reordering to vectorize).

@njit(cache=True, nogil=True)
def quantize(x):  # pragma: no cover - compiled
    """x [M, K] float32 -> (xq [M, K] int16, dx [M, K/32] scales, xs [M, K/32] fp32 block sums)."""
    xq, dx, xs = scratch(x.shape[0], x.shape[1])
    return _round(x, xq, dx, xs)


@njit(cache=True, nogil=True)
def scratch(rows, k):  # pragma: no cover - compiled
    """Room for `rows` rounded activations of up to k inputs: what the linears below write x into
    (flat, so one scratch serves every width; a decode step reuses it across its matmuls)."""
    return np.empty(rows * k, np.int16), np.empty(rows * (k // 32), np.float32), np.empty(rows * (k // 32), np.float32)


@njit(cache=True, nogil=True)
def _round(x, xq, dx, xs):  # pragma: no cover - compiled
    """quantize(x) into the front of the flat scratch arrays; returns them as [M, K], [M, K/32] x2."""
    rows, groups = x.shape[0], x.shape[1] // 32
    xq, dx, xs = xq[:x.size].reshape(x.shape), dx[:rows * groups].reshape((rows, groups)), \
        xs[:rows * groups].reshape((rows, groups))
    for r in range(rows):
        for g in range(groups):
            top, total = np.float32(0), np.float32(0)
            for j in range(g * 32, g * 32 + 32):
                top = max(top, abs(x[r, j]))
                total += x[r, j]
            xs[r, g] = total
            dx[r, g] = top / np.float32(32767)
            inv = np.float32(32767) / top if top > 0 else np.float32(0)
            for j in range(g * 32, g * 32 + 32):
                xq[r, j] = np.int16(round(x[r, j] * inv))
    return xq, dx, xs


@njit(cache=True, nogil=True)
def q4_linear(x, qs, d, m, y, room):  # pragma: no cover - compiled
    """y = x W^T for a Q4_0 / Q4_1 weight in blocks: x rounded to int16 into room (a scratch),
    then the block kernel."""
    xq, dx, xs = _round(x, room[0], room[1], room[2])
    q4_matmul(xq, dx, xs, qs, d, m, y)


@njit(cache=True, nogil=True)
def q8_linear(x, qs, d, y, room):  # pragma: no cover - compiled
    """y = x W^T for a Q8_0 weight in blocks (as q4_linear)."""
    xq, dx, _ = _round(x, room[0], room[1], room[2])
    q8_matmul(xq, dx, qs, d, y)


@njit(nogil=True, inline="always")
def _q4_dots(n, codes, base, xq, xbase, k, dots):  # pragma: no cover - compiled
    if n == 4:
        _q4_4(codes, base, xq, xbase, k, dots)
    elif n == 3:
        _q4_3(codes, base, xq, xbase, k, dots)
    elif n == 2:
        _q4_2(codes, base, xq, xbase, k, dots)
    else:
        _q4_1(codes, base, xq, xbase, k, dots)


@njit(nogil=True, inline="always")
def _q8_dots(n, codes, base, xq, xbase, k, dots):  # pragma: no cover - compiled
    if n == 4:
        _q8_4(codes, base, xq, xbase, k, dots)
    elif n == 3:
        _q8_3(codes, base, xq, xbase, k, dots)
    elif n == 2:
        _q8_2(codes, base, xq, xbase, k, dots)
    else:
        _q8_1(codes, base, xq, xbase, k, dots)


@njit(nogil=True, inline="always")
def _check(xq, qs, y):  # pragma: no cover - compiled
    """The intrinsics read and write through raw pointers: shapes are checked before, not trusted."""
    if qs.shape[3] != TILE or xq.shape[1] != qs.shape[1] * 32 or y.shape[1] < qs.shape[0] * TILE \
            or y.shape[0] != xq.shape[0]:
        raise ValueError("block matmul: mismatched shapes")


@njit(parallel=True, cache=True, nogil=True)
def q4_matmul(xq, dx, xs, qs, d, m, y):  # pragma: no cover - compiled
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    _check(xq, qs, y)
    codes, flat = qs.reshape(-1), xq.reshape(-1)  # both C-contiguous
    per_block = codes.size // (tiles * groups)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        dots = np.empty((ROWS_AT_ONCE, TILE), np.int32)
        acc = np.empty((rows, TILE), np.float32)
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            acc[:] = 0
            for g in range(groups):
                base = (t * groups + g) * per_block  # the block's codes, read from memory once for all rows
                for r0 in range(0, rows, ROWS_AT_ONCE):
                    n = min(ROWS_AT_ONCE, rows - r0)
                    _q4_dots(n, codes, base, flat, r0 * k + g * 32, k, dots)
                    for i in range(n):
                        sc, sx = dx[r0 + i, g], xs[r0 + i, g]
                        for c in range(TILE):
                            acc[r0 + i, c] += d[t, g, c] * (sc * np.float32(dots[i, c])) + m[t, g, c] * sx
            for r in range(rows):
                y[r, t * TILE:(t + 1) * TILE] = acc[r]


@njit(parallel=True, cache=True, nogil=True)
def q8_matmul(xq, dx, qs, d, y):  # pragma: no cover - compiled
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    _check(xq, qs, y)
    codes, flat = qs.reshape(-1), xq.reshape(-1)
    per_block = codes.size // (tiles * groups)
    parts = min(tiles, PARTS)
    for part in prange(parts):
        dots = np.empty((ROWS_AT_ONCE, TILE), np.int32)
        acc = np.empty((rows, TILE), np.float32)
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            acc[:] = 0
            for g in range(groups):
                base = (t * groups + g) * per_block
                for r0 in range(0, rows, ROWS_AT_ONCE):
                    n = min(ROWS_AT_ONCE, rows - r0)
                    _q8_dots(n, codes, base, flat, r0 * k + g * 32, k, dots)
                    for i in range(n):
                        sc = dx[r0 + i, g]
                        for c in range(TILE):
                            acc[r0 + i, c] += d[t, g, c] * (sc * np.float32(dots[i, c]))
            for r in range(rows):
                y[r, t * TILE:(t + 1) * TILE] = acc[r]
