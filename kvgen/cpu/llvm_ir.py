"""The LLVM IR vocabulary of kvgen's vector kernels (Numba has no vector types, so the inner loops
are written as IR in `numba.extending.intrinsic`s): vector types LANES wide, constants, and the
few builder patterns every kernel family shares. Nothing here compiles anything."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from kvgen.cpu.features import FEATURES, LANES

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
BYTES, WORDS = ir.VectorType(I8, 2 * LANES), ir.VectorType(I16, 2 * LANES)  # 2 LANES bytes / int16s
INTS, FLOATS = ir.VectorType(I32, LANES), ir.VectorType(ir.FloatType(), LANES)  # LANES int32s / floats
HALF_BITS, SMALL = ir.VectorType(I16, LANES), ir.VectorType(I8, LANES)  # LANES fp16s (their bits) / int8s
FMA = "+fma" in FEATURES.split(",")
F16C = "+f16c" in FEATURES.split(",")  # vcvtph2ps: fp16 -> fp32 (every AVX2 CPU has it)


def vector(ty, values):
    """A constant vector of type ty with these values."""
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


def i64(n):
    """n as an i64 constant (an index or a count)."""
    return ir.Constant(I64, n)


def broadcast(builder, x, ty=FLOATS):
    """x in every lane of a vector of type ty."""
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, vector(I32, [0] * ty.count))


def splat(builder, ptr):
    """The float at ptr in every lane."""
    return broadcast(builder, builder.load(ptr))


def halves_to_floats(builder, bits):
    """LANES fp16 values (their bits, a HALF_BITS vector) as floats, exactly: one vcvtph2ps where the
    CPU has F16C. Elsewhere integer arithmetic: LLVM lowers a half's fpext there to a library call
    (__extendhfsf2) that Numba's JIT does not link (the process segfaults). The magnitude's bits
    shifted to a float32's places read 2^-112 of the value (a subnormal half, a subnormal float32:
    exact either way), times 2^112, then the sign; a weight's scales hold no inf or NaN."""
    if F16C:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), FLOATS)
    w = builder.zext(bits, INTS)
    magnitude = builder.shl(builder.and_(w, vector(I32, [0x7FFF] * LANES)), vector(I32, [13] * LANES))
    f = builder.fmul(builder.bitcast(magnitude, FLOATS), vector(ir.FloatType(), [2.0 ** 112] * LANES))
    sign = builder.shl(builder.and_(w, vector(I32, [0x8000] * LANES)), vector(I32, [16] * LANES))
    return builder.bitcast(builder.or_(builder.bitcast(f, INTS), sign), FLOATS)


# Half of an activation block (32 float32 inputs): the unit the activations are rounded in, whatever LANES is
BLOCK_HALF = ir.VectorType(ir.FloatType(), 16)


def load_block(builder, x, g):
    """Block g's 32 float32 inputs from x (a float pointer), as two BLOCK_HALF vectors (inputs 0-15, 16-31)."""
    at = builder.gep(x, [builder.mul(g, i64(32))])
    lo = builder.load(builder.bitcast(at, BLOCK_HALF.as_pointer()), align=4)
    hi = builder.load(builder.bitcast(builder.gep(at, [i64(16)]), BLOCK_HALF.as_pointer()), align=4)
    return lo, hi


def largest_magnitude(builder, lo, hi):
    """The largest |x| of a block (load_block's two halves), a float: a tree of compares and selects, exact
    whichever way round (no NaN among activations), the same on every CPU."""
    fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(BLOCK_HALF, [BLOCK_HALF]),
                                          "llvm.fabs.v16f32")

    def fmax(u, w):
        return builder.select(builder.fcmp_ordered(">", u, w), u, w)

    m = fmax(builder.call(fabs, [lo]), builder.call(fabs, [hi]))
    for width in (8, 4, 2, 1):  # lanes 0 .. width - 1 against width .. 2 width - 1
        m = fmax(builder.shuffle_vector(m, m, vector(I32, range(width))),
                 builder.shuffle_vector(m, m, vector(I32, range(width, 2 * width))))
    return builder.extract_element(m, i64(0))


def add_all(builder, terms):
    """terms[0] + terms[1] + ... (integers), left to right."""
    out = terms[0]
    for t in terms[1:]:
        out = builder.add(out, t)
    return out


def fma(builder, a, b, c):
    """a b + c (floats, or vectors of them), rounded once where the CPU has FMA."""
    if not FMA:
        return builder.fadd(builder.fmul(a, b), c)
    ty = a.type
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), f"llvm.fma.{suffix}")
    return builder.call(fn, [a, b, c])


def arguments(context, builder, signature, args, names):
    """An intrinsic's arguments by name, arrays as their data pointers."""
    a = dict(zip(names, args, strict=True))
    for i, name in enumerate(names):
        if isinstance(signature.args[i], types.Array):
            a[name] = context.make_array(signature.args[i])(context, builder, args[i]).data
    return a
