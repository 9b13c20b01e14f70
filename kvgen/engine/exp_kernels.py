"""Kernels built on exp, in LLVM IR for the CPU: softmax's numerators (exp_shifted, with the
scores' max from largest) for plain_attention and fused_attention, and the MLP's silu(gate) * up
for fused_decode. Numba loops of the same polynomial did not vectorize (the softmax's wrote 2^k
through an int32 view of the scores themselves), and math.exp is a library call per element:
as vectors they took a 512-token prefill's softmax ~12 -> ~7 ms and its SiLU ~26 -> ~4 ms.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.engine import key_lanes
from kvgen.engine.cpu_kernels import _FLOATS, LANES, _arguments, _broadcast, _int


def exp_ir(builder, x, ty):
    """exp(x) for -87 <= x <= 88 as LLVM IR on x of type ty (a float or a vector of them): Cephes'
    expf, x = k ln 2 + r (ln 2 in two parts), a degree-7 polynomial in r (relative error under
    1e-7) times 2^k made from its bits. Each multiply-add is one fused multiply-add where the CPU
    has FMA (key_lanes._madd's rule), else a multiply and an add: a lane's result is the same
    whichever lane or scalar computes it. math.exp is a library call per element, which no
    loop vectorizes."""
    vec = isinstance(ty, ir.VectorType)
    f32 = ir.FloatType()
    suffix = f"v{ty.count}f32" if vec else "f32"

    def const(v, t=f32):
        return ir.Constant(ty if t is f32 else ir.VectorType(t, ty.count) if vec else t,
                           [ir.Constant(t, v)] * ty.count if vec else v)

    def madd(a, b, c):
        if not key_lanes.FMA:
            return builder.fadd(builder.fmul(a, b), c)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), f"llvm.fma.{suffix}")
        return builder.call(fn, [a, b, c])

    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty]), f"llvm.floor.{suffix}")
    k = builder.call(floor, [madd(x, const(1.44269504), const(0.5))])
    r = madd(k, const(-0.693359375), x)
    r = madd(k, const(2.12194440e-4), r)
    y = const(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = madd(y, r, const(c))
    p = builder.fadd(madd(y, builder.fmul(r, r), r), const(1.0))
    i32 = ir.IntType(32)
    bits = builder.shl(builder.add(builder.fptosi(k, ir.VectorType(i32, ty.count) if vec else i32), const(127, i32)),
                       const(23, i32))
    return builder.fmul(p, builder.bitcast(bits, ty))


@intrinsic
def _exp_shifted(typingctx, s, n, top):
    """s[:n] = exp(max(s[:n] - top, -87)); returns their sum: LANES lanes' sums added pairwise
    (lanes l and l + LANES / 2 first), then the last n % LANES in order. (A Numba loop of the same
    polynomial did not vectorize, its 2^k going through an int32 view of s itself: 0.57 ns a score.)"""
    sig = types.float32(s, n, top)

    def codegen(context, builder, signature, args):
        a = _arguments(context, builder, signature, args, ("s", "n", "top"))
        f32 = ir.FloatType()
        vecs = builder.udiv(a["n"], _int(LANES))
        total = cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, None))
        floor87 = _broadcast(builder, ir.Constant(f32, -87.0))
        top = _broadcast(builder, a["top"])
        with cgutils.for_range(builder, vecs) as loop:
            at = builder.bitcast(builder.gep(a["s"], [builder.mul(loop.index, _int(LANES))]), _FLOATS.as_pointer())
            x = builder.fsub(builder.load(at, align=4), top)
            x = builder.select(builder.fcmp_ordered("<", x, floor87), floor87, x)
            e = exp_ir(builder, x, _FLOATS)
            builder.store(e, at, align=4)
            builder.store(builder.fadd(builder.load(total), e), total)
        parts = [builder.extract_element(builder.load(total), _int(i)) for i in range(LANES)]
        while len(parts) > 1:
            half = len(parts) // 2
            parts = [builder.fadd(parts[i], parts[i + half]) for i in range(half)]
        out = cgutils.alloca_once_value(builder, parts[0])
        with cgutils.for_range(builder, builder.sub(a["n"], builder.mul(vecs, _int(LANES)))) as loop:
            at = builder.gep(a["s"], [builder.add(builder.mul(vecs, _int(LANES)), loop.index)])
            x = builder.fsub(builder.load(at), a["top"])
            x = builder.select(builder.fcmp_ordered("<", x, ir.Constant(f32, -87.0)), ir.Constant(f32, -87.0), x)
            e = exp_ir(builder, x, f32)
            builder.store(e, at)
            builder.store(builder.fadd(builder.load(out), e), out)
        return builder.load(out)

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
    clamped to -87 .. 88 (past it silu is 0 or the gate to float32's precision): LANES at a time,
    then the rest one at a time with the same operations (exp_ir). A Numba loop
    of the same polynomial took 2.2 ns an element, a sixteenth of a 512-token prefill."""
    sig = types.void(gu, out, n)

    def codegen(context, builder, signature, args):
        a = _arguments(context, builder, signature, args, ("gu", "out", "n"))

        def silu(at, ty, load, store):
            g, u = load(builder.gep(a["gu"], [at])), load(builder.gep(a["gu"], [builder.add(a["n"], at)]))
            const = (lambda v: _broadcast(builder, ir.Constant(ir.FloatType(), v))) if ty is _FLOATS else \
                (lambda v: ir.Constant(ir.FloatType(), v))
            x = builder.fmul(g, const(-1.0))
            x = builder.select(builder.fcmp_ordered("<", x, const(-87.0)), const(-87.0), x)
            x = builder.select(builder.fcmp_ordered(">", x, const(88.0)), const(88.0), x)
            e = exp_ir(builder, x, ty)
            store(builder.fmul(builder.fdiv(g, builder.fadd(const(1.0), e)), u), builder.gep(a["out"], [at]))

        def vload(ptr):
            return builder.load(builder.bitcast(ptr, _FLOATS.as_pointer()), align=4)

        def vstore(v, ptr):
            builder.store(v, builder.bitcast(ptr, _FLOATS.as_pointer()), align=4)

        vecs = builder.udiv(a["n"], _int(LANES))
        with cgutils.for_range(builder, vecs) as loop:
            silu(builder.mul(loop.index, _int(LANES)), _FLOATS, vload, vstore)
        with cgutils.for_range(builder, builder.sub(a["n"], builder.mul(vecs, _int(LANES)))) as loop:
            silu(builder.add(builder.mul(vecs, _int(LANES)), loop.index), ir.FloatType(), builder.load,
                 lambda v, ptr: builder.store(v, ptr))
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def silu_mul(gu, out):  # pragma: no cover - compiled
    """out = silu(gate) * up for one row's gate_up output [gate | up] (rows of C-contiguous arrays)."""
    if gu.shape[0] < 2 * out.shape[0]:
        raise ValueError("silu_mul: gate_up narrower than twice the output")
    _silu_mul_ir(gu, out, out.shape[0])
