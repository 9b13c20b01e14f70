"""Activations rounded to int16, a scale per block of 32 inputs: what the int16 block kernels
(vector_matmul.py, amx_matmul.py) multiply a weight's integer codes by, exactly.

`quantize` rounds each row's block of 32 inputs to int16 with a scale of its own (the block's
largest |x| / 32767): a relative error of 2^-16 of the block's largest value, where llama.cpp's Q8
activations have 2^-8 (vector_matmul.py says why the activations are integers at all). It also
gives each block's sum of x, which the kinds with a minimum term multiply by the block's m;
`half_sums` the sums per 16 inputs, for the kinds with a minimum per 16 (q2hm, q8hm).
block_matmul.py rounds a call's rows into a `scratch` (`round_rows`) that a decode step reuses across
its matmuls. int8_matmul.py has the int8 rounding of its own kernels.

No fastmath here: with it LLVM may fuse a multiply-add either way and reorder sums, differently in
two compilations, and a row's numbers would then depend on which build ran it (none of these loops
needs reordering to vectorize). A row is rounded by the same code whether a call's rows are cut
among the threads or not, so its numbers do not depend on the other rows either.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.llvm_ir import I16, I32, arguments, broadcast, i64, largest_magnitude, load_block, vector
from kvgen.cpu.threads import PARTS


@njit(cache=True, nogil=True)
def quantize(x):  # pragma: no cover - compiled
    """x [M, K] float32 -> (xq [M, K] int16, dx [M, K/32] scales, xs [M, K/32] fp32 block sums)."""
    xq, dx, xs = scratch(x.shape[0], x.shape[1])
    return round_rows(x, xq, dx, xs)


@njit(cache=True, nogil=True)
def scratch(rows, k):  # pragma: no cover - compiled
    """Room for `rows` rounded activations of up to k inputs: what block_matmul's linears write x into
    (flat, so one scratch serves every width; a decode step reuses it across its matmuls)."""
    return np.empty(rows * k, np.int16), np.empty(rows * (k // 32), np.float32), np.empty(rows * (k // 32), np.float32)


# Rows from which rounding is worth a parallel region (a few microseconds to start: too much for
# the 120 roundings of a one-row decode step).
ROUND_IN_PARALLEL = 16


@njit(cache=True, nogil=True)
def round_rows(x, xq, dx, xs):  # pragma: no cover - compiled
    """quantize(x) into the front of the flat scratch arrays; returns them as [M, K], [M, K/32] x2.
    A call of many rows (a prompt chunk) cuts them among the threads: the same per-row code, so
    a row's numbers do not depend on which did it."""
    rows, groups = x.shape[0], x.shape[1] // 32
    x = np.ascontiguousarray(x)  # the rows are read through pointers (a view's own if it is one)
    xq, dx, xs = xq[:x.size].reshape(x.shape), dx[:rows * groups].reshape((rows, groups)), \
        xs[:rows * groups].reshape((rows, groups))
    if rows >= ROUND_IN_PARALLEL:
        round_rows_parallel(x, xq, dx, xs)
    else:
        for r in range(rows):
            _round_row(x[r], xq[r], dx[r], xs[r])
    return xq, dx, xs


@njit(parallel=True, cache=True, nogil=True)
def round_rows_parallel(x, xq, dx, xs):  # pragma: no cover - compiled
    rows = x.shape[0]
    parts = min(rows, PARTS)
    for part in prange(parts):
        for r in range(part * rows // parts, (part + 1) * rows // parts):
            _round_row(x[r], xq[r], dx[r], xs[r])


@njit(nogil=True, inline="always")
def _round_row(x, xq, dx, xs):  # pragma: no cover - compiled
    """One row (contiguous): _round_blocks over its blocks of 32."""
    _round_blocks(x, xq, dx, xs, x.shape[0] // 32)


_F16 = ir.VectorType(ir.FloatType(), 16)


@intrinsic
def _round_blocks(typingctx, x, xq, dx, xs, groups):
    """Per block g of 32 inputs: dx[g] = top / 32767, xs[g] = the block's sum, xq = x rounded half to
    even in steps of dx (x times 32767 / top), where top is the block's largest |x|. The sum is
    (b[l] + b[l+8]) + (b[l+16] + b[l+24]) for the lanes l < 8, then those added pairwise (l with
    l + 1 first): the same additions on every CPU, a block in a few vector instructions (a Numba
    loop of 8 lanes took 0.74 ns an input; a 512-token chunk rounds 50 M of them)."""
    sig = types.void(x, xq, dx, xs, groups)

    def codegen(context, builder, signature, args):
        a = arguments(context, builder, signature, args, ("x", "xq", "dx", "xs", "groups"))
        f32 = ir.FloatType()
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F16, [_F16]), "llvm.rint.v16f32")

        def half(v, lanes, start):  # lanes start .. start + lanes - 1 of v
            return builder.shuffle_vector(v, v, vector(I32, range(start, start + lanes)))

        def pick(v, idx):
            return builder.shuffle_vector(v, v, vector(I32, idx))

        with cgutils.for_range(builder, a["groups"]) as loop:
            g = loop.index
            lo, hi = load_block(builder, a["x"], g)
            s8 = builder.fadd(builder.fadd(half(lo, 8, 0), half(lo, 8, 8)),
                              builder.fadd(half(hi, 8, 0), half(hi, 8, 8)))
            s4 = builder.fadd(pick(s8, [0, 2, 4, 6]), pick(s8, [1, 3, 5, 7]))
            s2 = builder.fadd(pick(s4, [0, 2]), pick(s4, [1, 3]))
            total = builder.fadd(builder.extract_element(s2, i64(0)), builder.extract_element(s2, i64(1)))
            top = largest_magnitude(builder, lo, hi)
            builder.store(total, builder.gep(a["xs"], [g]))
            builder.store(builder.fdiv(top, ir.Constant(f32, 32767.0)), builder.gep(a["dx"], [g]))
            positive = builder.fcmp_ordered(">", top, ir.Constant(f32, 0.0))
            inv = builder.select(positive, builder.fdiv(ir.Constant(f32, 32767.0), top), ir.Constant(f32, 0.0))
            inv = broadcast(builder, inv, _F16)
            words = ir.VectorType(I16, 16)
            out = builder.bitcast(builder.gep(a["xq"], [builder.mul(g, i64(32))]), words.as_pointer())
            for i, v in enumerate((lo, hi)):
                q = builder.fptosi(builder.call(rint, [builder.fmul(v, inv)]), words)
                builder.store(q, builder.gep(out, [i64(i)]), align=2)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def half_sums(x, xs):  # pragma: no cover - compiled
    """xs [M, 2G] (a flat scratch's front, returned shaped): x's sums per 16 inputs, each added
    left to right (no fastmath: the same additions in every build), for q8hm's minimum terms."""
    rows, halves = x.shape[0], x.shape[1] // 16
    x = np.ascontiguousarray(x)
    xs = xs[:rows * halves].reshape((rows, halves))
    for r in range(rows):
        for h in range(halves):
            s = np.float32(0.0)
            for i in range(16 * h, 16 * h + 16):
                s += x[r, i]
            xs[r, h] = s
    return xs
