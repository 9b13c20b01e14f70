"""Kernels built on exp, in LLVM IR for the CPU: softmax's numerators (exp_shifted, with the
scores' max from largest) for paged_attention, and the MLP's silu(gate) * up
for decode_step. Numba loops of the same polynomial did not vectorize (the softmax's wrote 2^k
through an int32 view of the scores themselves), and math.exp is a library call per element:
as vectors they took a 512-token prefill's softmax ~12 -> ~7 ms and its SiLU ~26 -> ~4 ms.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.llvm_ir import FLOATS, LANES, arguments, broadcast, fma, i64


def _const(ty, v):
    """v as a value of type ty: a number, or a vector of them all v."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)
    return ir.Constant(ty, v)


def _each(builder, n, body, between=None):
    """body(index, ty, load, store) for indices 0, LANES, 2 LANES ... as vectors of LANES floats
    (ty FLOATS), then, after between() where given, for the n % LANES left one float at a time
    (ty float): the same operations on either, so an element's result does not depend on where
    it stands."""
    def vload(ptr):
        return builder.load(builder.bitcast(ptr, FLOATS.as_pointer()), align=4)

    def vstore(v, ptr):
        builder.store(v, builder.bitcast(ptr, FLOATS.as_pointer()), align=4)

    vecs = builder.udiv(n, i64(LANES))
    with cgutils.for_range(builder, vecs) as loop:
        body(builder.mul(loop.index, i64(LANES)), FLOATS, vload, vstore)
    if between is not None:
        between()
    with cgutils.for_range(builder, builder.sub(n, builder.mul(vecs, i64(LANES)))) as loop:
        body(builder.add(builder.mul(vecs, i64(LANES)), loop.index), ir.FloatType(), builder.load,
             lambda v, ptr: builder.store(v, ptr))


def exp_ir(builder, x, ty):
    """exp(x) for -87 <= x <= 88 as LLVM IR on x of type ty (a float or a vector of them): Cephes'
    expf, x = k ln 2 + r (ln 2 in two parts), a degree-7 polynomial in r (relative error under
    1e-7) times 2^k made from its bits. Each multiply-add is llvm_ir.fma (one fused
    multiply-add where the CPU has FMA): a lane's result is the same whichever lane or scalar
    computes it. math.exp is a library call per element, which no loop vectorizes."""
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty]),
                                           f"llvm.floor.v{ty.count}f32" if isinstance(ty, ir.VectorType)
                                           else "llvm.floor.f32")
    k = builder.call(floor, [fma(builder, x, _const(ty, 1.44269504), _const(ty, 0.5))])
    r = fma(builder, k, _const(ty, -0.693359375), x)
    r = fma(builder, k, _const(ty, 2.12194440e-4), r)
    y = _const(ty, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = fma(builder, y, r, _const(ty, c))
    p = builder.fadd(fma(builder, y, builder.fmul(r, r), r), _const(ty, 1.0))
    ints = ir.VectorType(ir.IntType(32), ty.count) if isinstance(ty, ir.VectorType) else ir.IntType(32)
    bits = builder.shl(builder.add(builder.fptosi(k, ints), _const(ints, 127)), _const(ints, 23))
    return builder.fmul(p, builder.bitcast(bits, ty))


def _clamp(builder, x, ty, lo, hi=None):
    """x limited to lo .. hi (hi None: no upper limit)."""
    x = builder.select(builder.fcmp_ordered("<", x, _const(ty, lo)), _const(ty, lo), x)
    return x if hi is None else builder.select(builder.fcmp_ordered(">", x, _const(ty, hi)), _const(ty, hi), x)


@intrinsic
def _exp_shifted(typingctx, s, n, top):
    """s[:n] = exp(max(s[:n] - top, -87)); returns their sum: LANES lanes' sums added pairwise
    (lanes l and l + LANES / 2 first), then the last n % LANES in order. (A Numba loop of the same
    polynomial did not vectorize, its 2^k going through an int32 view of s itself: 0.57 ns a score.)"""
    sig = types.float32(s, n, top)

    def codegen(context, builder, signature, args):
        a = arguments(context, builder, signature, args, ("s", "n", "top"))
        sums = {FLOATS: cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)),
                ir.FloatType(): cgutils.alloca_once_value(builder, _const(ir.FloatType(), 0.0))}

        def shifted(at, ty, load, store):
            ptr = builder.gep(a["s"], [at])
            top = a["top"] if ty == ir.FloatType() else broadcast(builder, a["top"])
            e = exp_ir(builder, _clamp(builder, builder.fsub(load(ptr), top), ty, -87.0), ty)
            store(e, ptr)
            builder.store(builder.fadd(builder.load(sums[ty]), e), sums[ty])

        def reduce():  # the vectors' lanes added pairwise, where the rest's sum starts
            parts = [builder.extract_element(builder.load(sums[FLOATS]), i64(i)) for i in range(LANES)]
            while len(parts) > 1:
                half = len(parts) // 2
                parts = [builder.fadd(parts[i], parts[i + half]) for i in range(half)]
            builder.store(parts[0], sums[ir.FloatType()])

        _each(builder, a["n"], shifted, between=reduce)
        return builder.load(sums[ir.FloatType()])

    return sig, codegen


@njit(cache=True, nogil=True)
def exp_shifted(s, n, top):  # pragma: no cover - compiled
    """s[:n] = exp(s[:n] - top) for scores s <= top (below exp(-87): exp(-87)); returns their sum."""
    if n > s.shape[0] or not s.flags.c_contiguous:
        raise ValueError("exp_shifted: n past the scores")
    return _exp_shifted(s, n, top)


@njit(fastmath=True, cache=True, nogil=True)
def largest(s, n):  # pragma: no cover - compiled
    """max(s[:n]), for callers compiled without fastmath (with it this loop vectorizes; a max is
    exact in any order)."""
    top = np.float32(-np.inf)
    for p in range(n):
        top = max(top, s[p])
    return top


@intrinsic
def _silu_mul_ir(typingctx, gu, out, n):
    """out[i] = gate / (1 + exp(-gate)) * up for i < n, gate = gu[i], up = gu[n + i], exp's argument
    clamped to -87 .. 88 (past it silu is 0 or the gate to float32's precision), through _each. A
    Numba loop of the same polynomial took 2.2 ns an element, a sixteenth of a 512-token prefill."""
    sig = types.void(gu, out, n)

    def codegen(context, builder, signature, args):
        a = arguments(context, builder, signature, args, ("gu", "out", "n"))

        def silu(at, ty, load, store):
            g, u = load(builder.gep(a["gu"], [at])), load(builder.gep(a["gu"], [builder.add(a["n"], at)]))
            e = exp_ir(builder, _clamp(builder, builder.fmul(g, _const(ty, -1.0)), ty, -87.0, 88.0), ty)
            store(builder.fmul(builder.fdiv(g, builder.fadd(_const(ty, 1.0), e)), u), builder.gep(a["out"], [at]))

        _each(builder, a["n"], silu)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def silu_mul(gu, out):  # pragma: no cover - compiled
    """out = silu(gate) * up for one row's gate_up output [gate | up] (rows of C-contiguous arrays)."""
    if gu.shape[0] < 2 * out.shape[0]:
        raise ValueError("silu_mul: gate_up narrower than twice the output")
    _silu_mul_ir(gu, out, out.shape[0])
