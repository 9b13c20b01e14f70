"""The vector operations of a LoRA adapter's low-rank delta in the fused decode step (decode_step._lora):
t = x A^T, a dot product per rank, then y += t B^T, LANES output columns at a time.

Numba's loops of the same sums did not vectorize (scalar multiply-adds: 5 GB/s of adapter weights on one
core, where a plain read of them ran at 8), so they are LLVM IR, as key_lanes.py's attention is. Each
multiply-add is one `llvm.fma` where the CPU has it (llvm_ir.fma); the sums have a fixed order that does
not depend on how many rows share the adapter, so a row's delta is the same bits alone or in a batch.
Callers are compiled without fastmath (Numba would put its flags on these additions too).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.llvm_ir import FLOATS, I32, LANES, add_all, arguments, fma, i64, splat

CHAINS = 4  # a dot product's independent chains of vector multiply-adds (one would wait on its own latency)


def _vec(builder, ptr):
    return builder.bitcast(ptr, FLOATS.as_pointer())


@intrinsic
def dot(typingctx, a, abase, x, xbase, n):
    """sum over c < n of a[abase + c] x[xbase + c], n a multiple of LANES: vector v of the inputs goes
    into chain v % CHAINS, the chains are added (0 + 2) + (1 + 3), then the sum's lanes pairwise
    (lane l with l + LANES / 2 first)."""
    names = ("a", "abase", "x", "xbase", "n")
    sig = types.float32(a, abase, x, xbase, n)

    def codegen(context, builder, signature, args):
        p = arguments(context, builder, signature, args, names)
        at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
        chains = [cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(CHAINS)]

        def add(chain, c):  # chain += a[c : c + LANES] x[c : c + LANES]
            va = builder.load(_vec(builder, at(p["a"], p["abase"], c)), align=4)
            vx = builder.load(_vec(builder, at(p["x"], p["xbase"], c)), align=4)
            builder.store(fma(builder, va, vx, builder.load(chain)), chain)

        vectors = builder.udiv(p["n"], i64(LANES))
        whole = builder.udiv(vectors, i64(CHAINS))
        with cgutils.for_range(builder, whole) as loop:
            c0 = builder.mul(loop.index, i64(CHAINS * LANES))
            for i, chain in enumerate(chains):
                add(chain, builder.add(c0, i64(i * LANES)))
        done = builder.mul(whole, i64(CHAINS * LANES))
        rest = builder.sub(vectors, builder.mul(whole, i64(CHAINS)))
        for i in range(CHAINS - 1):  # the last vectors, fewer than CHAINS: chain i takes the i-th
            with builder.if_then(builder.icmp_unsigned(">", rest, i64(i))):
                add(chains[i], builder.add(done, i64(i * LANES)))
        v = [builder.load(chain) for chain in chains]
        total = builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))
        lanes = [builder.extract_element(total, ir.Constant(I32, i)) for i in range(LANES)]
        while len(lanes) > 1:
            half = len(lanes) // 2
            lanes = [builder.fadd(lanes[i], lanes[i + half]) for i in range(half)]
        return lanes[0]

    return sig, codegen


@intrinsic
def add_lowrank(typingctx, y, ybase, t, tbase, b, bbase, bstride, r):
    """y[ybase + j] += sum over k < r of t[tbase + k] b[bbase + k bstride + j], for the LANES columns j:
    the delta summed first (k in order, from zero), then added to y once (y + (x A^T) B^T, as the
    torch path adds a product to the base output)."""
    names = ("y", "ybase", "t", "tbase", "b", "bbase", "bstride", "r")
    sig = types.void(y, ybase, t, tbase, b, bbase, bstride, r)

    def codegen(context, builder, signature, args):
        p = arguments(context, builder, signature, args, names)
        at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
        acc = cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None))
        with cgutils.for_range(builder, p["r"]) as loop:
            k = loop.index
            tk = splat(builder, at(p["t"], p["tbase"], k))
            row = builder.load(_vec(builder, at(p["b"], p["bbase"], builder.mul(k, p["bstride"]))), align=4)
            builder.store(fma(builder, tk, row, builder.load(acc)), acc)
        out = _vec(builder, at(p["y"], p["ybase"]))
        builder.store(builder.fadd(builder.load(out, align=4), builder.load(acc)), out, align=4)
        return context.get_dummy_value()

    return sig, codegen
