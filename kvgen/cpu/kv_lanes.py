"""The dequantizing kernels of kv_io.load: a block's fp8 or q4 rows of one KV head to float32,
a vector of LANES dimensions at a time.

Numba does arithmetic on small integers as int64 and checks the sign of computed indices, so the
same loops written in Python ran at about one element a cycle (a block of 16 fp8 rows of 64: ~0.5
us, ~1 us among the attention's other work; at 1k tokens of context a layer dequantizes 384 of
them). Here a row is LANES bytes (or nibbles) widened to int32 lanes, turned to floats and
scaled in a handful of vector operations. LLVM IR, as key_lanes.py's kernels are.

Every result is the format's own dequantization bit for bit: integer steps are exact, and each
value sees one float32 multiply by its scale (no fast-math flags), as quant.py's does.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.llvm_ir import FLOATS, I8, I16, I32, INTS, LANES, add_all, arguments, broadcast, i64, vector

_SMALL = 2.0 ** -6  # E4M3's smallest normal: what an exponent-0 code is placed above


def _splat_int(n):
    return vector(I32, [n] * LANES)


def _fp8(builder, x, s):
    """<LANES x i32> E4M3 codes -> their values times s. The code's bits moved into float32's
    places (exponent and mantissa up by 20, the exponent bias up by 120) make a float32 of its
    magnitude. A code of exponent 0 (zero, or a subnormal m 2^-9) is placed as exponent 1,
    2^-6 + m 2^-9, and 2^-6 taken off again (exact): placed as it is it would be a float32
    subnormal, which Intel cores multiply by microcode assist. The sign goes on with the scale,
    so -0 stays -0."""
    small = builder.icmp_unsigned("==", builder.and_(x, _splat_int(0x78)), _splat_int(0))
    mag = builder.or_(builder.and_(x, _splat_int(0x7F)), builder.select(small, _splat_int(0x08), _splat_int(0)))
    f = builder.bitcast(builder.add(builder.shl(mag, _splat_int(20)), _splat_int(120 << 23)), FLOATS)
    zero, lift = ir.Constant(FLOATS, [0.0] * LANES), ir.Constant(FLOATS, [_SMALL] * LANES)
    f = builder.fsub(f, builder.select(small, lift, zero))
    negative = builder.icmp_unsigned("!=", builder.and_(x, _splat_int(0x80)), _splat_int(0))
    return builder.fmul(f, builder.select(negative, builder.fneg(s), s))


def _f16(builder, x):
    """<LANES x i32> float16 bits (zero-extended) -> their float32 values, exactly: the bits moved
    into float32's places as _fp8 moves a code's (exponent bias up by 112; a subnormal placed as
    exponent 1 and 2^-14 taken off again; infinities and NaNs keep an exponent of all ones)."""
    mag = builder.and_(x, _splat_int(0x7FFF))
    exponent = builder.lshr(mag, _splat_int(10))
    small = builder.icmp_unsigned("==", exponent, _splat_int(0))
    top = builder.icmp_unsigned("==", exponent, _splat_int(31))
    moved = builder.shl(builder.or_(mag, builder.select(small, _splat_int(0x400), _splat_int(0))), _splat_int(13))
    bits = builder.select(top, builder.or_(moved, _splat_int(0x7F800000)), builder.add(moved, _splat_int(112 << 23)))
    f = builder.bitcast(bits, FLOATS)
    zero, lift = ir.Constant(FLOATS, [0.0] * LANES), ir.Constant(FLOATS, [2.0 ** -14] * LANES)
    f = builder.bitcast(builder.fsub(f, builder.select(small, lift, zero)), INTS)
    return builder.bitcast(builder.or_(f, builder.shl(builder.and_(x, _splat_int(0x8000)), _splat_int(16))), FLOATS)


def _nibbles(builder, ptr):
    """LANES / 2 bytes at ptr -> <LANES x float> of their codes less 8, low nibble first."""
    half = ir.VectorType(I8, LANES // 2)
    x = builder.zext(builder.load(builder.bitcast(ptr, half.as_pointer()), align=1), ir.VectorType(I32, LANES // 2))
    lo = builder.and_(x, vector(I32, [15] * (LANES // 2)))
    hi = builder.lshr(x, vector(I32, [4] * (LANES // 2)))
    both = builder.shuffle_vector(lo, hi, vector(I32, [j // 2 + (j % 2) * (LANES // 2) for j in range(LANES)]))
    return builder.sitofp(builder.sub(both, _splat_int(8)), FLOATS)


def _rows(kind: str):
    """An intrinsic: dst[t hd + d] = row t's dimension d (t < n, d < hd, hd a multiple of LANES),
    row t's codes at src[sbase + t sstride ...] (bytes: one a dimension for fp8, two nibbles for
    q4). Scales: fp8, the float32 sc[scbase] for every value; q4 keys ("q4k"), the float16 bits
    sc[scbase + d] a channel; q4 values ("q4v"), the float16 bits sc[scbase + t scstride +
    d / group] a row and group (group a multiple of LANES)."""
    names = ("src", "sbase", "sstride", "n", "hd", "sc", "scbase", "scstride", "group", "dst")

    @intrinsic
    def rows(typingctx, src, sbase, sstride, n, hd, sc, scbase, scstride, group, dst):
        sig = types.void(src, sbase, sstride, n, hd, sc, scbase, scstride, group, dst)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            vec = lambda ptr, ty=FLOATS: builder.bitcast(ptr, ty.as_pointer())  # noqa: E731
            s = broadcast(builder, builder.load(at(a["sc"], a["scbase"]))) if kind == "fp8" else None
            with cgutils.for_range(builder, a["n"]) as row:
                t = row.index
                with cgutils.for_range(builder, builder.udiv(a["hd"], i64(LANES))) as step:
                    d0 = builder.mul(step.index, i64(LANES))
                    if kind == "fp8":
                        ptr = at(a["src"], a["sbase"], builder.mul(t, a["sstride"]), d0)
                        codes = builder.load(vec(ptr, ir.VectorType(I8, LANES)), align=1)
                        value = _fp8(builder, builder.zext(codes, INTS), s)
                    else:
                        ptr = at(a["src"], a["sbase"], builder.mul(t, a["sstride"]), builder.udiv(d0, i64(2)))
                        if kind == "q4k":
                            bits = builder.load(vec(at(a["sc"], a["scbase"], d0), ir.VectorType(I16, LANES)), align=2)
                            bits = builder.zext(bits, INTS)
                        else:
                            g = at(a["sc"], a["scbase"], builder.mul(t, a["scstride"]), builder.udiv(d0, a["group"]))
                            bits = broadcast(builder, builder.zext(builder.load(g), I32), INTS)
                        value = builder.fmul(_nibbles(builder, ptr), _f16(builder, bits))
                    builder.store(value, vec(at(a["dst"], builder.mul(t, a["hd"]), d0)), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return rows


fp8_rows, q4_key_rows, q4_value_rows = _rows("fp8"), _rows("q4k"), _rows("q4v")
