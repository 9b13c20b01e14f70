"""Numba CPU kernels: y = x W^T with W in GGUF's own blocks (Q4_0 / Q4_1 / Q8_0, and the other types
weight_blocks.BLOCK_TYPES lists, as integer codes and the file's own fp16 and int8 scales, which
reproduce them exactly).

At batch 1 a decode step reads every weight once, so its speed is the weights' bytes over the
memory bandwidth, if the multiply keeps up: Q4_1 is 5 bits a weight against fp32's 32. Converting
each 4-bit code to a float and multiplying it by an fp32 activation does not keep up on a 2-core
AVX2 CPU (6 instructions per 8 weights: the kernels ran at 11 GB/s where the machine reads 27).

So the activations are integers too: int16_rounding.py rounds each row's block of 32 inputs to int16
with a scale of its own (the block's largest |x| / 32767): a relative error of 2^-16 of the block's
largest value, where llama.cpp's Q8 activations have 2^-8. Then a block's dot product with a row
of weight codes is exact integer arithmetic, done by pmaddwd (int16 pairs multiplied and summed
into int32), LANES weight rows at a time. What is left in floats is each block's integer sum times
the weight row's and the activation block's scales, added over the blocks in order, in registers:
a row's output does not depend on the other rows or on how many there are, and the integer sums
are exact whichever instructions compute them.

Layout (weight_blocks.py makes it): the output rows are cut in tiles of TILE rows; for one tile and
block, the bytes are ordered [pair p, row c, e], so one load of 2 LANES bytes holds LANES rows'
weights for two neighbouring inputs (the pair pmaddwd sums), and the activation pair is one int32
broadcast:

    q4: qs [N/TILE, G, 8, TILE, 2] uint8: byte (p, c, e) holds input 2p+e of row c (low nibble)
        and input 2p+e+16 (high); value = d * q + m (Q4_0: m = -8 d)
    q4i: q4's nibbles, each an index into IQ4's table of 16 values (IQ4_NL, IQ4_XS); value = d * table[q]
    q8: qs [N/TILE, G, 16, TILE, 2] int8: byte (p, c, e) holds input 2p+e; value = d * q
    q8h: q8's codes, a scale per 16 inputs: value = d[h] * q for input 16h + i (no file type: Q3_K's reference)
    q8hm: q8h with a minimum per 16 inputs too: value = d[h] * q + m[h] (no file type: Q2_K's reference)
    q5, q5m, q6h, q3h, q2hm: packed codes u - offset, qs [N/TILE, G, 2 L + 2 b, TILE, 2] uint8: a
        plane of u's low L bits (L = 4: pairs 0-7 are q4's nibbles; L = 2), then a plane of the high
        b bits (b = 0, 1, 2) of u ^ offset (offset 0 or u's top bit); in a plane of B bits, byte j
        < 4 B of a row holds inputs j + 4 B i at bit B i; and
        q5: value = d * (u - 16) (Q5_0); q5m: value = d * u + m (Q5_1, Q5_K);
        q6h: value = d[h] * (u - 32), a scale per 16 inputs as q8h's (Q6_K);
        q3h: L = 2, b = 1, value = d[h] * (u - 4) (Q3_K); q2hm: L = 2, value = d[h] * u + m[h] (Q2_K);
        a half h is inputs 16h .. 16h + 15
    xq [M, K] int16;  dx, xs [M, G] float32 (xs [M, 2G] for q8hm: per 16 inputs);  y [M, N] float32

The scales d, m are held as the file holds them, one flat byte array a weight, scales
[N/TILE, S, bytes] uint8, in one of five layouts (`layout`, LAYOUTS says which a kind takes). Per
tile and per super-block s (S of them: a block of 32 for F16 / F16_MIN, SUPER blocks, 256 inputs,
for SUB / SUB_MIN / SUB_MIN4), the TILE rows':

    F16      fp16 d [TILE]                        Q8_0, Q5_0, IQ4_NL; Q4_0 (m = -8 d, not held)
    F16_MIN  fp16 d [TILE], fp16 m [TILE]         Q4_1, Q5_1
    SUB      fp16 D [TILE], int8 a [SUPER, H, TILE]                              IQ4_XS, Q6_K, Q3_K
    SUB_MIN  fp16 D [TILE], fp16 M [TILE], int8 a [SUPER, H, TILE], int8 b [SUPER, H, TILE]   Q4_K, Q5_K
    SUB_MIN4 fp16 D [TILE], fp16 M [TILE], uint8 a | b << 4 [SUPER, H, TILE]                   Q2_K

(H: 1 scale a block, 2 for q8h, q8hm, q6h, q3h, q2hm; SUB_MIN4's a and b are 4 bits, a byte holding both as
Q2_K's own scale bytes do.) For SUB, SUB_MIN and SUB_MIN4, block j of the super-block has
d = D a[j] and m = M b[j] (M: the file's -dmin): fp16 times int8 is at most 11 + 8 significant
bits, exact in float32, so the kernels compute (`block_scales`: vcvtph2ps, vpmovsxbd, vcvtdq2ps, a
multiply) the very float gguf-py's dequantize uses and weight_blocks held as a float32 per block
before: the same outputs, bit for bit, from 4.625 bits a Q4_K weight instead of 6 (4.5 in the
file; Q4_0 4.5 and Q4_1 5, the file's own). Where the CPU has no F16C the fp16s widen by integer
arithmetic (llvm_ir.halves_to_floats), the same floats.

Every kind's epilogue is one expression per block, in this order: d[0] (dx dot[0]) (+ m[0] xs[0])
(+ d[1] (dx dot[1]) (+ m[1] xs[1])), added to the row's sum; dot[h] is the exact integer dot of
half h's codes (q8h, q8hm: the pairs p < 8 and p >= 8 apart), or of the whole block.

A tile's loop over the blocks is written in LLVM IR (`_tile_linear`), since Numba has no vector
types: pmaddwd as the AVX-512 (16 rows a vector) or AVX2 (8) intrinsic where the CPU has it, else
the portable multiply-and-add pattern that LLVM lowers to whatever the CPU has (the sums are the
same integers either way, and the float arithmetic the same operations in the same order). On an
AVX-512 Zen 4, a 3072 x 576 Q4_1 matmul took 31 us at 1 row and 14.6 us a row at 4 to 32 rows when
the integer dots were stored and added up in a Numba loop, 256 bits at a time; keeping the sums in
registers took the second to 13.0, and 512-bit vectors then both to 20 and 10.7. With AVX512-VNNI
the multiply and its add are one vpdpwssd, four sums a row so that each waits less on the one
before (172 -> 184 GMAC/s at 16 to 256 rows, same integers). That is about 25 of the 32 int16
multiply-adds a Zen 4 core issues a cycle: more would take 8-bit activations (vpdpbusd, 64 a
cycle), that is llama.cpp's precision, not this one's. Where the CPU has AMX-INT8, a call of 12
rows or more (a prompt chunk, a large batch) multiplies on tiles instead (amx_matmul.py): the
same integers, split in bytes, and the same float epilogue, so the same bits, 1.5-1.9x faster on
a Sapphire Rapids. On AVX2 (8 rows a vector: a tile is two vectors of sums) the kernels compute both
vectors in one pass over the blocks, each activation pair broadcast once for both, where a pass a vector
broadcast it twice (a broadcast a multiply-add: a third of the loop's instructions); the nibble kinds with a
scale per 16 inputs (q6h, q3h, q2hm) a half at a time, so that the sums fit AVX2's 16 registers. On a 2-core
Zen 3 at 512 rows, a 16384 x 2048 matmul went from 71 to 91 GMAC/s (Q4_0), 74 to 87 (Q4_K) and 58 to 69
(Q6_K), the same bits. Numba caches the compiled kernels per CPU, so a cache made on one CPU is not used on
another.

The kernels release the GIL (nogil): the engine thread runs them while the server's event loop
goes on serving other calls, as it does during torch's ops.

Numba's disk cache for these kernels lives in a folder named by a hash of kvgen/cpu's sources
and of the CPU's features (kernel_cache.py says why).

Threads: the kernels run on Numba's OpenMP layer. It links the system's libgomp by a file name
torch's bundled copy does not answer to, so the engine thread holds two worker pools, torch's and
this one (threads.py says why extra pools cost). The measured speeds include that cost. A fused
step runs almost nothing in torch, so there the two pools do not compete.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.features import LANES, PMADDWD, VNNI, WIDE
from kvgen.cpu.llvm_ir import (
    BYTES,
    FLOATS,
    HALF_BITS,
    I8,
    I16,
    I32,
    I64,
    INTS,
    SMALL,
    WORDS,
    add_all,
    arguments,
    halves_to_floats,
    i64,
    splat,
    vector,
)
from kvgen.cpu.threads import PARTS

# Output rows per tile: one or two vectors of sums (LANES rows each); a tile's codes, read once from
# memory, serve its activation rows ROWS_AT_ONCE at a time (8 at a time were no faster).
TILE = 16
ROWS_AT_ONCE = 4


def _madd(builder, a, b):
    """<2 LANES x i16> a, b -> <LANES x i32>: a[2i] b[2i] + a[2i+1] b[2i+1] (one pmaddwd)."""
    if PMADDWD:
        name = "llvm.x86.avx512.pmaddw.d.512" if WIDE else "llvm.x86.avx2.pmadd.wd"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(INTS, [WORDS, WORDS]), name)
        return builder.call(fn, [a, b])
    even, odd = vector(I32, range(0, 2 * LANES, 2)), vector(I32, range(1, 2 * LANES, 2))
    half = [builder.sext(builder.shuffle_vector(v, v, idx), INTS) for v in (a, b) for idx in (even, odd)]
    return builder.add(builder.mul(half[0], half[2]), builder.mul(half[1], half[3]))


def _madd_add(builder, acc, a, b):
    """acc + _madd(a, b): one vpdpwssd where the CPU has AVX512-VNNI (the same integers)."""
    if not VNNI:
        return builder.add(acc, _madd(builder, a, b))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(INTS, [INTS, INTS, INTS]),
                                        "llvm.x86.avx512.vpdpwssd.512")
    return builder.call(fn, [acc, builder.bitcast(a, INTS), builder.bitcast(b, INTS)])


def _pair(builder, x, index):
    """The int16 pair x[2 index], x[2 index + 1] broadcast to every lane (x: an i32 pointer)."""
    v = builder.load(builder.gep(x, [ir.Constant(I64, index)]), align=4)
    v = builder.insert_element(ir.Constant(INTS, ir.Undefined), v, ir.Constant(I32, 0))
    return builder.bitcast(builder.shuffle_vector(v, v, vector(I32, [0] * LANES)), WORDS)


# kind: (code pairs a block (a pair of bytes a row: q4 nibbles hold 4 inputs, q8 bytes 2; the packed
# kinds' low plane's pairs, then their high plane's), scales a block (1, or 2: one per 16 inputs), a
# minimum term m xs)
KINDS = {"q4": (8, 1, True), "q4i": (8, 1, False), "q3h": (6, 2, False), "q2hm": (4, 2, True),
         "q8": (16, 1, False), "q8h": (16, 2, False), "q8hm": (16, 2, True),
         "q5": (10, 1, False), "q5m": (10, 1, True), "q6h": (12, 2, False)}
# The packed kinds: a code u - offset held in planes of bits (_packed_codes), u's low bits (4: q4's
# nibbles; 2 where LOW_BITS says) then the high bits of u ^ offset: the file's 2-, 3-, 5- and 6-bit codes at
# the file's bits, where int8 codes took 8 (a Q4_K_M's Q6_K matrices were most of its RSS over the file's
# size) and a nibble took 4 (a 1.7B Q3_K_M's Q3_K ones 1 bit a weight over the file's, 118 MiB).
# kind: (high bits an input, offset)
PACKED = {"q5": (1, 16), "q5m": (1, 0), "q6h": (2, 32), "q3h": (1, 4), "q2hm": (0, 0)}
LOW_BITS = {"q3h": 2, "q2hm": 2}  # a packed kind's low plane's bits an input, where not 4

# How a weight's scales are held (the module docstring's layout): an fp16 d per block (F16), and an
# fp16 m (F16_MIN); or an fp16 d per super-block of SUPER blocks times an int8 per block or half
# (SUB), and the same for m (SUB_MIN), or both as the nibbles of one byte (SUB_MIN4: Q2_K's 4-bit
# scales and minimums, as the file holds them). A kind with a minimum term and no m held is q4's Q4_0: m = -8 d.
F16, F16_MIN, SUB, SUB_MIN, SUB_MIN4 = 0, 1, 2, 3, 4
SUPER = 8  # blocks of 32 in a K-quant's (and IQ4_XS's) super-block of 256 inputs
# The layouts each kind has kernels for (weight_blocks.BLOCK_TYPES' types)
LAYOUTS = {"q4": (F16, F16_MIN, SUB_MIN), "q4i": (F16, SUB), "q3h": (SUB,), "q2hm": (SUB_MIN4,), "q8": (F16, SUB),
           "q8h": (SUB,), "q8hm": (SUB_MIN,), "q5": (F16,), "q5m": (F16_MIN, SUB_MIN), "q6h": (SUB,)}
# The kinds whose codes are one nibble an input, 8 pairs of nibble bytes a block (as the first 8 pairs of
# the packed kinds with a low plane of 4 bits)
NIBBLE_KINDS = ("q4", "q4i")


def _scale_shape(layout, halves, groups):
    """(super-blocks, bytes a super-block holds for one tile) of a weight's scales: per tile and
    super-block (one block for F16 / F16_MIN), TILE fp16 d, TILE fp16 m where held, then for SUB /
    SUB_MIN the int8 scales [block, half, TILE] and, where m is held, its int8s the same way; for SUB_MIN4
    one byte [block, half, TILE] holding both."""
    mins = 2 if layout == F16_MIN or layout == SUB_MIN else 1
    if layout == SUB or layout == SUB_MIN:
        return groups // SUPER, mins * (2 * TILE + SUPER * halves * TILE)
    if layout == SUB_MIN4:
        return groups // SUPER, 4 * TILE + SUPER * halves * TILE
    return groups, mins * 2 * TILE


scale_shape = njit(nogil=True, inline="always")(_scale_shape)


def block_scales(builder, kind: str, layout: int, scales, at, g, lane: int) -> list:
    """IR: block g's float32 scale and minimum vectors for LANES weight rows of a tile from its row
    `lane`, [(d, m)] a scale of the block (two for q8h, q8hm: its halves; m None where the kind has
    no minimum term). scales: the flat byte array's pointer; at: the tile's first byte (i64). A
    sub-block's d = float(fp16) * float(int8): at most 11 + 8 significant bits, exact in float32, so
    the same float gguf-py's dequantize multiplies by (weight_blocks.py)."""
    _, halves, has_min = KINDS[kind]
    held = layout in (F16_MIN, SUB_MIN, SUB_MIN4)
    sub = layout in (SUB, SUB_MIN, SUB_MIN4)
    _, per = _scale_shape(layout, halves, SUPER)
    first = builder.add(at, builder.mul(builder.udiv(g, i64(SUPER)) if sub else g, i64(per)))

    def load(ty, *offsets):
        ptr = builder.gep(scales, [add_all(builder, [first, *offsets])])
        return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)

    d = halves_to_floats(builder, load(HALF_BITS, i64(2 * lane)))
    m = halves_to_floats(builder, load(HALF_BITS, i64(2 * (TILE + lane)))) if held else None
    out = []
    for h in range(halves):
        dh, mh = d, m
        if sub:  # the block's (or half's) int8s after the fp16s: [block j, half, TILE]
            row = builder.mul(builder.urem(g, i64(SUPER)), i64(halves * TILE))
            ints = 2 * TILE * (2 if held else 1) + h * TILE + lane
            if layout == SUB_MIN4:  # a in the byte's low nibble, b in its high one
                both = builder.zext(load(SMALL, row, i64(ints)), INTS)  # split as int32s: AVX2 has no byte shifts
                a = builder.and_(both, vector(I32, [15] * LANES))
                b = builder.lshr(both, vector(I32, [4] * LANES))
                dh = builder.fmul(d, builder.sitofp(a, FLOATS))
                mh = builder.fmul(m, builder.sitofp(b, FLOATS))
                out.append((dh, mh))
                continue
            dh = builder.fmul(d, builder.sitofp(load(SMALL, row, i64(ints)), FLOATS))
            if held:
                mh = builder.fmul(m, builder.sitofp(load(SMALL, row, i64(ints + SUPER * halves * TILE)), FLOATS))
        if has_min and not held:  # Q4_0
            mh = builder.fmul(dh, vector(ir.FloatType(), [-8.0] * LANES))
        out.append((dh, mh if has_min else None))
    return out


def _packed_codes(builder, kind: str, load, p: int, width: int) -> tuple:
    """A packed kind's codes of pair p as bytes, (inputs 2p, 2p+1; inputs 2p+16, 2p+17) of the
    width / 2 rows `load` reads, and the power of two 2^s they are scaled by: put together as bytes
    (half a vector's work where int16 words take a whole one; _widen makes them words). A code
    u - offset of L + b bits (L the low plane's, b the high one's; offset 2^(L+b-1), its top bit) is
    the byte (u ^ offset) << s read as int8, s = 8 - L - b: each plane's field moved to its place in
    the byte (the high bits held xor the offset's bit: weight_blocks._pack), so no subtraction; a
    kind with no offset (q5m, q2hm) the byte u as is, s = 0. The dots come out 2^s times the int8
    codes' (exact: no int32 sum overflows), shifted back at the block's end: the same integers. A
    plane of B bits an input is 4 B bytes a row, byte j holding input j + 4 B i at bit B i (B = 4:
    q4's nibble bytes), in pairs of bytes as the nibbles are: input 2p + e is field p // (2 B) of
    plane pair p mod 2 B, input 2p + 16 + e the field 4 // B further, in the same lanes."""
    high, offset = PACKED[kind]
    low = LOW_BITS.get(kind, 4)
    shift = 8 - low - high if offset else 0
    planes = [(0, low, 0)] + ([(2 * low, high, low)] if high else [])  # (first pair, bits, the code's bit)
    loaded = {}

    def moved(v, by, mask):  # (v << by) & mask, a right shift for by < 0
        v = builder.shl(v, vector(I8, [by] * width)) if by > 0 else \
            builder.lshr(v, vector(I8, [-by] * width)) if by < 0 else v
        return builder.and_(v, vector(I8, [mask] * width))

    out = []
    for half in (0, 1):  # inputs 2p, 2p+1; inputs 2p+16, 2p+17
        byte = None
        for first, bits, at in planes:
            pair = first + p % (2 * bits)
            if pair not in loaded:
                loaded[pair] = load(pair)
            field = p // (2 * bits) + half * (4 // bits)
            part = moved(loaded[pair], shift + at - bits * field, ((1 << bits) - 1) << (shift + at))
            byte = part if byte is None else builder.or_(byte, part)
        out.append(byte)
    return (*out, shift)


def _widen(builder, kind: str, v, index: int):
    """Bytes index * 2 LANES .. of a packed kind's codes (_packed_codes) as int16 words: its int8 codes
    (u - offset) 2^s sign-extended, a kind without an offset's u zero-extended."""
    if v.type.count != 2 * LANES:
        v = builder.shuffle_vector(v, v, vector(I32, range(index * 2 * LANES, (index + 1) * 2 * LANES)))
    return builder.sext(v, WORDS) if PACKED[kind][1] else builder.zext(v, WORDS)


# IQ4_NL's and IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl), which q4i's nibbles index
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _table_codes(builder, n) -> tuple:
    """q4i: a load of nibble bytes -> (low nibbles' values, high nibbles' values) as int16 words: each
    nibble looked up in IQ4_VALUES by one pshufb (16 byte lookups in each 128-bit lane, every lane holding
    the table), so the codes stay 4 bits in memory where the table's int8 values took 8."""
    table = vector(I8, [IQ4_VALUES[i % 16] for i in range(2 * LANES)])
    out = []
    for idx in (builder.and_(n, vector(I8, [15] * 2 * LANES)), builder.lshr(n, vector(I8, [4] * 2 * LANES))):
        if PMADDWD:  # AVX2 (and SSSE3 within it)
            name = "llvm.x86.avx2.pshuf.b" if 2 * LANES == 32 else "llvm.x86.ssse3.pshuf.b.128"
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(BYTES, [BYTES, BYTES]), name)
            v = builder.call(fn, [table, idx])
        else:  # portable IR: a select per table entry (the same bytes)
            v = vector(I8, [IQ4_VALUES[0]] * 2 * LANES)
            for i in range(1, 16):
                v = builder.select(builder.icmp_unsigned("==", idx, vector(I8, [i] * 2 * LANES)),
                                   vector(I8, [IQ4_VALUES[i]] * 2 * LANES), v)
        out.append(builder.sext(v, WORDS))
    return tuple(out)


def _tile_linear(kind: str, layout: int, rows: int):
    """An intrinsic: y[r, c] = sum over blocks g of d[c, g] (dx[r, g] dots[r, c, g]) + m[c, g] xs[r, g]
    for `rows` activation rows r and the TILE weight rows c of one tile, where dots is a block's
    exact int32 dot product of codes and rounded activations (for a kind with a scale per 16
    inputs, each half's own dot, scale and minimum, the halves added in order), and d, m the
    block's scales as block_scales expands them from `layout`. The sum runs over g in order, in
    registers, LANES weight rows at a time: each row's sum is the same whatever the other rows.
    Arguments (arrays flat): codes, the tile's first code; groups; xq, row 0's first input, the
    distance between activation rows; dx, xs, row 0's first block; scales, the tile's first byte
    of them; y, row 0's first output, the distance between output rows."""
    pairs, halves, has_min = KINDS[kind]
    nibbles = kind in NIBBLE_KINDS or kind in PACKED  # 8 pairs p, each inputs 2p, 2p+1 and 2p+16, 2p+17
    # Where a tile is two vectors of sums (AVX2: LANES 8), one pass over the blocks computes both: each
    # activation pair broadcast once for both (a broadcast a multiply-add took a third of the loop's
    # instructions). The kinds of nibbles or planes with a scale per 16 inputs (q6h, q3h, q2hm: inputs 2p, 2p+1
    # are half 0, 2p+16, 2p+17 half 1) do it a half at a time, the low inputs' products over the block, then the
    # high ones', so that a row and vector keeps one sum (AVX2's 16 registers); q8h, q8hm (the tests' references)
    # keep a pass a vector. The same integers and float operations either way.
    merged = not VNNI and (halves == 1 or nibbles)
    passes = [list(range(TILE // LANES))] if merged else [[cg] for cg in range(TILE // LANES)]
    phases = (0, 1) if merged and halves == 2 else (None,)  # the half a sweep over the pairs adds (None: both)
    names = ("codes", "base", "groups", "xq", "xbase", "k", "dx", "xs", "sbase", "scales", "at", "y", "ybase",
             "ystride")

    @intrinsic
    def tile_linear(typingctx, codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride):
        sig = types.void(codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            for cgs in passes:  # the vectors of sums (LANES weight rows each) a pass over the blocks computes
                total = {(cg, i): cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None))
                         for cg in cgs for i in range(rows)}
                with cgutils.for_range(builder, a["groups"]) as loop:
                    g = loop.index
                    q = at(a["codes"], a["base"], builder.mul(g, i64(pairs * TILE * 2)))
                    xs = [builder.bitcast(at(a["xq"], a["xbase"], builder.mul(a["k"], i64(i)),
                                             builder.mul(g, i64(32))), I32.as_pointer()) for i in range(rows)]
                    # four sums a row, added at the block's end: a multiply-add waits for the one
                    # before it in its chain (vpdpwssd's latency), so one chain a row stalled. Without VNNI
                    # the add is an instruction of its own, and a merged pass keeps one sum a row and vector
                    # (AVX2's 16 registers: 4 rows x 2 vectors of sums, the codes, a broadcast)
                    chains = {cg: [[ir.Constant(INTS, None)] * 4 for _ in range(rows)] for cg in cgs}
                    if len(cgs) == 1:
                        slot = lambda c: c  # noqa: E731
                    else:  # merged: one sum a row, vector and half
                        slot = (lambda c: 0) if halves == 1 else (lambda c: c & 2)  # noqa: E731
                    scaled = 0  # the packed kinds' dots: 2^scaled times the codes' (_packed_codes)
                    for phase, p in ((phase, p) for phase in phases for p in range(8 if nibbles else pairs)):
                        codes = {}  # cg -> (lo, hi) nibbles' or (w,) bytes' words: every vector's, then the rows
                        if kind in PACKED:
                            # the pass's vectors' bytes as one (their rows are neighbours): on AVX2 a pair's
                            # planes for both vectors in one 256-bit byte op each, where a vector's took as many
                            # 128-bit ones (the 1-row decode of a q6h or q3h matrix was a third unpacking)
                            def load_all(p, q=q, cgs=cgs):  # pair p's bytes for the pass's vectors' rows
                                at_p = at(q, i64((p * TILE + cgs[0] * LANES) * 2))
                                wide = ir.VectorType(I8, 2 * LANES * len(cgs))
                                return builder.load(builder.bitcast(at_p, wide.as_pointer()), align=1)

                            lo, hi, scaled = _packed_codes(builder, kind, load_all, p, 2 * LANES * len(cgs))
                            for i, cg in enumerate(cgs):
                                codes[cg] = (_widen(builder, kind, lo, i), _widen(builder, kind, hi, i))
                        else:
                            for cg in cgs:
                                def load(p, q=q, cg=cg):  # pair p's 2 LANES bytes: two a row, for LANES rows
                                    at_p = at(q, i64((p * TILE + cg * LANES) * 2))
                                    return builder.load(builder.bitcast(at_p, BYTES.as_pointer()), align=1)

                                if kind == "q4i":
                                    lo, hi = _table_codes(builder, load(p))
                                elif kind == "q4":
                                    w = builder.zext(load(p), WORDS)
                                    lo = builder.and_(w, vector(I16, [15] * 2 * LANES))
                                    hi = builder.lshr(w, vector(I16, [4] * 2 * LANES))
                                codes[cg] = (lo, hi) if nibbles else (builder.sext(load(p), WORDS),)
                        # a row at a time, its activation pairs broadcast once for every vector of sums
                        for i in range(rows):
                            if nibbles:
                                # inputs 2p, 2p+1 (low nibbles), 2p+16, 2p+17 (high): q6h's, q3h's, q2hm's halves 0, 1
                                c0, c1 = slot(p % 2), slot(2 + p % 2)
                                if phase != 1:
                                    x_lo = _pair(builder, xs[i], p)
                                    for cg in cgs:
                                        chains[cg][i][c0] = _madd_add(builder, chains[cg][i][c0], codes[cg][0], x_lo)
                                if phase != 0:
                                    x_hi = _pair(builder, xs[i], 8 + p)
                                    for cg in cgs:
                                        chains[cg][i][c1] = _madd_add(builder, chains[cg][i][c1], codes[cg][1], x_hi)
                            else:
                                # two halves: chains 0, 1 sum inputs 0-15 (p < 8), chains 2, 3 inputs 16-31
                                c = slot(p % 4 if halves == 1 else p % 2 + 2 * (p // 8))
                                x = _pair(builder, xs[i], p)
                                for cg in cgs:
                                    chains[cg][i][c] = _madd_add(builder, chains[cg][i][c], codes[cg][0], x)
                    for cg in cgs:
                        dots = [[add_all(builder, c)] if halves == 1 else
                                [add_all(builder, c[:2]), add_all(builder, c[2:])] for c in chains[cg]]
                        if scaled:  # exact: every term of the sums is a multiple of 2^scaled
                            dots = [[builder.ashr(d, vector(I32, [scaled] * LANES)) for d in ds] for ds in dots]
                        scales = block_scales(builder, kind, layout, a["scales"], a["at"], g, cg * LANES)
                        for i in range(rows):
                            block = (a["sbase"], builder.mul(a["groups"], i64(i)), g)
                            # d (dx dots) + m xs, in that order: plain fmul and fadd, which LLVM
                            # fuses into no multiply-add without fast-math flags (see below)
                            term = None
                            for h, (d, m) in enumerate(scales):
                                t = builder.fmul(d, builder.fmul(splat(builder, at(a["dx"], *block)),
                                                                 builder.sitofp(dots[i][h], FLOATS)))
                                if has_min:  # xs per block, or (q8hm) per half: [M, 2G]
                                    x_at = at(a["xs"], *block) if halves == 1 else \
                                        at(a["xs"], builder.mul(add_all(builder, block), i64(2)), i64(h))
                                    t = builder.fadd(t, builder.fmul(m, splat(builder, x_at)))
                                term = t if term is None else builder.fadd(term, t)
                            builder.store(builder.fadd(builder.load(total[cg, i]), term), total[cg, i])
                for cg in cgs:
                    for i in range(rows):
                        out = at(a["y"], a["ybase"], builder.mul(a["ystride"], i64(i)), i64(cg * LANES))
                        builder.store(builder.load(total[cg, i]), builder.bitcast(out, FLOATS.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_linear


def _rows_of(kind: str, layout: int):
    """A tile's pass over n <= ROWS_AT_ONCE activation rows for one kind and layout: Numba cannot
    pick an intrinsic from a tuple, so the choice of _tile_linear's row variants is spelled out."""
    one, two, three, four = (_tile_linear(kind, layout, n) for n in range(1, ROWS_AT_ONCE + 1))

    @njit(nogil=True, inline="always")
    def rows(n, codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride):  # pragma: no cover
        if n == 4:
            four(codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride)
        elif n == 3:
            three(codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride)
        elif n == 2:
            two(codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride)
        else:
            one(codes, base, groups, xq, xbase, k, dx, xs, sbase, scales, at, y, ybase, ystride)

    return rows


_q4_f16, _q4_f16_min, _q4_sub_min = (_rows_of("q4", layout) for layout in LAYOUTS["q4"])
_q4i_f16, _q4i_sub = (_rows_of("q4i", layout) for layout in LAYOUTS["q4i"])
_q8_f16, _q8_sub = (_rows_of("q8", layout) for layout in LAYOUTS["q8"])
_q8h_sub, _q8hm_sub_min = _rows_of("q8h", SUB), _rows_of("q8hm", SUB_MIN)
_q3h_sub, _q2hm_sub_min4 = _rows_of("q3h", SUB), _rows_of("q2hm", SUB_MIN4)
_q5_f16, _q6h_sub = _rows_of("q5", F16), _rows_of("q6h", SUB)
_q5m_f16_min, _q5m_sub_min = (_rows_of("q5m", layout) for layout in LAYOUTS["q5m"])


# No fastmath in what follows: with it LLVM may fuse a multiply-add either way and reorder sums,
# differently in two compilations, and a row's output would then depend on which build ran it
# (none of these loops needs reordering to vectorize).

@njit(nogil=True, inline="always")
def check_shapes(xq, dx, qs, pairs, halves, scales, layout, y):  # pragma: no cover - compiled
    """The intrinsics read and write through raw pointers: shapes and layouts are checked before,
    not trusted."""
    tiles, groups = qs.shape[0], qs.shape[1]
    supers, per = scale_shape(layout, halves, groups)
    if qs.shape[2] != pairs or qs.shape[3] != TILE or qs.shape[4] != 2 or xq.shape[1] != groups * 32 \
            or y.shape[1] < tiles * TILE or y.shape[0] != xq.shape[0] or dx.shape != (xq.shape[0], groups) \
            or scales.shape != (tiles, supers, per) \
            or supers * (SUPER if layout == SUB or layout == SUB_MIN or layout == SUB_MIN4 else 1) != groups \
            or not (xq.flags.c_contiguous and dx.flags.c_contiguous and qs.flags.c_contiguous
                    and scales.flags.c_contiguous and y.flags.c_contiguous):
        raise ValueError("block matmul: mismatched shapes")


@njit(inline="always")
def _check_sums(xs, dx, halves):  # pragma: no cover - compiled
    """x's sums for the minimum terms: one a block (as dx), or one a half (q8hm)."""
    if xs.shape != (dx.shape[0], halves * dx.shape[1]) or not xs.flags.c_contiguous:
        raise ValueError("block matmul: mismatched shapes")


@njit(inline="always")
def _bad_layout():  # pragma: no cover - compiled
    raise ValueError("block matmul: no kernel for this kind's scale layout")


# The matmuls: the weight's tiles cut in runs of consecutive tiles, one a thread; a tile's codes,
# read from memory once, serve the rows ROWS_AT_ONCE at a time (the later rows find them in cache).
# Arguments: xq [M, K] int16, dx (and xs) [M, K/32] float32 (quantize's), qs the codes, scales the
# bytes of _scale_shape's layout [N/TILE, super-blocks, bytes], layout its name, y [M, >= N].

@njit(parallel=True, cache=True, nogil=True)
def q4_matmul(xq, dx, xs, qs, scales, layout, y):  # pragma: no cover - compiled
    """Q4_0 (F16), Q4_1 (F16_MIN), Q4_K (SUB_MIN)."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 8, 1, scales, layout, y)
    _check_sums(xs, dx, 1)
    if layout != F16 and layout != F16_MIN and layout != SUB_MIN:
        _bad_layout()
    codes, xf, dxf, xsf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), \
        scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                n, yat = min(ROWS_AT_ONCE, rows - r0), r0 * y.shape[1] + t * TILE
                if layout == F16:
                    _q4_f16(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, r0 * groups, sf,
                            t * per_scales, yf, yat, y.shape[1])
                elif layout == F16_MIN:
                    _q4_f16_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, r0 * groups, sf,
                                t * per_scales, yf, yat, y.shape[1])
                else:
                    _q4_sub_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, r0 * groups, sf,
                                t * per_scales, yf, yat, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q4i_matmul(xq, dx, qs, scales, layout, y):  # pragma: no cover - compiled
    """IQ4_NL (F16), IQ4_XS (SUB): q4's nibbles, IQ4_VALUES' values."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 8, 1, scales, layout, y)
    if layout != F16 and layout != SUB:
        _bad_layout()
    codes, xf, dxf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                n, yat = min(ROWS_AT_ONCE, rows - r0), r0 * y.shape[1] + t * TILE
                if layout == F16:
                    _q4i_f16(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf, r0 * groups, sf,
                             t * per_scales, yf, yat, y.shape[1])
                else:
                    _q4i_sub(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf, r0 * groups, sf,
                             t * per_scales, yf, yat, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q8_matmul(xq, dx, qs, scales, layout, y):  # pragma: no cover - compiled
    """Q8_0 (F16); SUB for int8 codes under super-block scales (no file type's now: IQ4_XS runs as q4i)."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 16, 1, scales, layout, y)
    if layout != F16 and layout != SUB:
        _bad_layout()
    codes, xf, dxf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                n, yat = min(ROWS_AT_ONCE, rows - r0), r0 * y.shape[1] + t * TILE
                if layout == F16:
                    _q8_f16(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf, r0 * groups, sf,
                            t * per_scales, yf, yat, y.shape[1])
                else:
                    _q8_sub(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf, r0 * groups, sf,
                            t * per_scales, yf, yat, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q8h_matmul(xq, dx, qs, scales, y):  # pragma: no cover - compiled
    """q8 codes with a scale per 16 inputs (Q3_K): layout SUB, an int8 a half."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 16, 2, scales, SUB, y)
    codes, xf, dxf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                _q8h_sub(min(ROWS_AT_ONCE, rows - r0), codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf,
                         r0 * groups, sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q8hm_matmul(xq, dx, xs, qs, scales, y):  # pragma: no cover - compiled
    """q8h with a minimum per 16 inputs too (Q2_K's integers as int8 codes: q2hm's reference): layout SUB_MIN,
    xs [M, 2G] the sums of x per 16 inputs (half_sums)."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 16, 2, scales, SUB_MIN, y)
    _check_sums(xs, dx, 2)
    codes, xf, dxf, xsf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), \
        scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                _q8hm_sub_min(min(ROWS_AT_ONCE, rows - r0), codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf,
                              r0 * groups, sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q3h_matmul(xq, dx, qs, scales, y):  # pragma: no cover - compiled
    """Q3_K: 3-bit codes less 4, packed (a plane of 2 low bits, one of high bits), a scale per 16 inputs
    (layout SUB, an int8 a half): q8h's outputs."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 6, 2, scales, SUB, y)
    codes, xf, dxf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                _q3h_sub(min(ROWS_AT_ONCE, rows - r0), codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf,
                         r0 * groups, sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q2hm_matmul(xq, dx, xs, qs, scales, y):  # pragma: no cover - compiled
    """Q2_K: 2-bit codes packed (a plane of 2 bits), a 4-bit scale and minimum per 16 inputs (layout SUB_MIN4;
    xs [M, 2G] the sums of x per 16 inputs, half_sums): q8hm's outputs over the same integers."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 4, 2, scales, SUB_MIN4, y)
    _check_sums(xs, dx, 2)
    codes, xf, dxf, xsf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), \
        scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                _q2hm_sub_min4(min(ROWS_AT_ONCE, rows - r0), codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf,
                              r0 * groups, sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


# The packed kinds (PACKED): the q8 kinds' integer codes at the file's 5 or 6 bits, nibbles and a
# plane of high bits (qs [N/TILE, G, 10 or 12, TILE, 2] uint8), so the q8 kinds' very outputs.

@njit(parallel=True, cache=True, nogil=True)
def q5_matmul(xq, dx, qs, scales, y):  # pragma: no cover - compiled
    """5-bit codes less 16, a scale per 32 inputs (Q5_0): layout F16."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 10, 1, scales, F16, y)
    codes, xf, dxf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                _q5_f16(min(ROWS_AT_ONCE, rows - r0), codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf,
                        r0 * groups, sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q5m_matmul(xq, dx, xs, qs, scales, layout, y):  # pragma: no cover - compiled
    """5-bit codes with q4's minimum term: Q5_1 (F16_MIN), Q5_K (SUB_MIN)."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 10, 1, scales, layout, y)
    _check_sums(xs, dx, 1)
    if layout != F16_MIN and layout != SUB_MIN:
        _bad_layout()
    codes, xf, dxf, xsf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), \
        scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                n, yat = min(ROWS_AT_ONCE, rows - r0), r0 * y.shape[1] + t * TILE
                if layout == F16_MIN:
                    _q5m_f16_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, r0 * groups, sf,
                                 t * per_scales, yf, yat, y.shape[1])
                else:
                    _q5m_sub_min(n, codes, t * per_tile, groups, xf, r0 * k, k, dxf, xsf, r0 * groups, sf,
                                 t * per_scales, yf, yat, y.shape[1])


@njit(parallel=True, cache=True, nogil=True)
def q6h_matmul(xq, dx, qs, scales, y):  # pragma: no cover - compiled
    """6-bit codes less 32, a scale per 16 inputs (Q6_K): layout SUB, an int8 a half."""
    rows, k = xq.shape
    tiles, groups = qs.shape[0], qs.shape[1]
    check_shapes(xq, dx, qs, 12, 2, scales, SUB, y)
    codes, xf, dxf, sf, yf = qs.reshape(-1), xq.reshape(-1), dx.reshape(-1), scales.reshape(-1), y.reshape(-1)
    per_tile, per_scales = codes.size // tiles, sf.size // tiles
    parts = min(tiles, PARTS)
    for part in prange(parts):
        for t in range(part * tiles // parts, (part + 1) * tiles // parts):
            for r0 in range(0, rows, ROWS_AT_ONCE):
                _q6h_sub(min(ROWS_AT_ONCE, rows - r0), codes, t * per_tile, groups, xf, r0 * k, k, dxf, dxf,
                         r0 * groups, sf, t * per_scales, yf, r0 * y.shape[1] + t * TILE, y.shape[1])
