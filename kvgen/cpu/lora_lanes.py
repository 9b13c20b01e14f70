"""A LoRA adapter's low-rank delta in the fused decode step (decode_step._lora_span, `span`): for the rows
of one adapter, t = x A^T, a dot product per rank, then y += t B^T, LANES output columns at a time.

Numba's loops of the same sums did not vectorize (scalar multiply-adds: 5 GB/s of adapter weights on one
core, where a plain read of them ran at 8), so they are LLVM IR, as key_lanes.py's attention is. Each
multiply-add is one `llvm.fma` where the CPU has it (llvm_ir.fma); the sums have a fixed order that does
not depend on how many rows share the adapter, so a row's delta is the same bits alone or in a batch.
Callers are compiled without fastmath (Numba would put its flags on these additions too).

The adapter's weights are the step's only bytes that grow with the number of adapters (fp32, ~20 MB per
rank-16 adapter on every linear of the embedded model): read from memory once a step, so each vector of
A or B is loaded once for up to ROWS of the adapter's rows (`dots`, `add_lowranks`), each row keeping its
own sums in the order one row alone has. At 16 rows over 8 adapters (bench/lora.py) the deltas ran at
23 GB/s on one core, a plain read of the same bytes at 25; a row at a time (each vector loaded again for
the adapter's second row, from L1) they ran at 18.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.features import WIDE
from kvgen.cpu.llvm_ir import FLOATS, I32, LANES, add_all, arguments, fma, i64, splat

CHAINS = 4  # a dot product's independent chains of vector multiply-adds (one would wait on its own latency)
# rows that share each load of A and B: 4 rows x 4 chains of sums fit AVX-512's 32 vector registers,
# AVX2's 16 hold 2 rows' (more would spill the sums)
ROWS = 4 if WIDE else 2


def _vec(builder, ptr):
    return builder.bitcast(ptr, FLOATS.as_pointer())


def _dots(m: int):
    @intrinsic
    def dots(typingctx, a, abase, x, rows, first, n, t, tbase, tstride):
        """For i < m: t[tbase + i tstride] = sum over c < n of a[abase + c] x[rows[first + i] n + c], n a
        multiple of LANES; each vector of a loaded once for the m rows. Each row's sum in one fixed
        order: vector v of the inputs goes into the row's chain v % CHAINS, the chains are added
        (0 + 2) + (1 + 3), then the sum's lanes pairwise (lane l with l + LANES / 2 first)."""
        names = ("a", "abase", "x", "rows", "first", "n", "t", "tbase", "tstride")
        sig = types.void(a, abase, x, rows, first, n, t, tbase, tstride)

        def codegen(context, builder, signature, args):
            p = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            xbase = [builder.mul(builder.load(at(p["rows"], p["first"], i64(i))), p["n"]) for i in range(m)]
            chains = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(CHAINS)]
                      for _ in range(m)]

            def add(ci, c):  # chain ci of each row += a[c : c + LANES] x_row[c : c + LANES]
                va = builder.load(_vec(builder, at(p["a"], p["abase"], c)), align=4)
                for i in range(m):
                    vx = builder.load(_vec(builder, at(p["x"], xbase[i], c)), align=4)
                    builder.store(fma(builder, va, vx, builder.load(chains[i][ci])), chains[i][ci])

            vectors = builder.udiv(p["n"], i64(LANES))
            whole = builder.udiv(vectors, i64(CHAINS))
            with cgutils.for_range(builder, whole) as loop:
                c0 = builder.mul(loop.index, i64(CHAINS * LANES))
                for ci in range(CHAINS):
                    add(ci, builder.add(c0, i64(ci * LANES)))
            done = builder.mul(whole, i64(CHAINS * LANES))
            rest = builder.sub(vectors, builder.mul(whole, i64(CHAINS)))
            for ci in range(CHAINS - 1):  # the last vectors, fewer than CHAINS: chain ci takes the ci-th
                with builder.if_then(builder.icmp_unsigned(">", rest, i64(ci))):
                    add(ci, builder.add(done, i64(ci * LANES)))
            for i in range(m):
                v = [builder.load(chain) for chain in chains[i]]
                total = builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))
                lanes = [builder.extract_element(total, ir.Constant(I32, j)) for j in range(LANES)]
                while len(lanes) > 1:
                    half = len(lanes) // 2
                    lanes = [builder.fadd(lanes[j], lanes[j + half]) for j in range(half)]
                builder.store(lanes[0], at(p["t"], p["tbase"], builder.mul(p["tstride"], i64(i))))
            return context.get_dummy_value()

        return sig, codegen

    return dots


def _add_lowranks(m: int):
    @intrinsic
    def add_lowranks(typingctx, y, rows, first, wide, col, t, tbase, b, bbase, r):
        """For i < m and the LANES columns j: y[rows[first + i] wide + col + j] += sum over k < r of
        t[tbase + i r + k] b[bbase + k LANES + j], each vector of b loaded once for the m rows: each
        row's delta summed first (k in order, from zero), then added to y once (y + (x A^T) B^T, as the
        torch path adds a product to the base output)."""
        names = ("y", "rows", "first", "wide", "col", "t", "tbase", "b", "bbase", "r")
        sig = types.void(y, rows, first, wide, col, t, tbase, b, bbase, r)

        def codegen(context, builder, signature, args):
            p = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            accs = [cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(m)]
            with cgutils.for_range(builder, p["r"]) as loop:
                k = loop.index
                row = builder.load(_vec(builder, at(p["b"], p["bbase"], builder.mul(k, i64(LANES)))), align=4)
                for i in range(m):
                    tk = splat(builder, at(p["t"], p["tbase"], builder.mul(p["r"], i64(i)), k))
                    builder.store(fma(builder, tk, row, builder.load(accs[i])), accs[i])
            for i in range(m):
                ybase = builder.mul(builder.load(at(p["rows"], p["first"], i64(i))), p["wide"])
                out = _vec(builder, at(p["y"], ybase, p["col"]))
                builder.store(builder.fadd(builder.load(out, align=4), builder.load(accs[i])), out, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return add_lowranks


dots1, dots2, dots3, dots4 = (_dots(m) for m in (1, 2, 3, 4))
add_lowranks1, add_lowranks2, add_lowranks3, add_lowranks4 = (_add_lowranks(m) for m in (1, 2, 3, 4))


@njit(cache=True, nogil=True)
def span(data, a, b, r, col, w, x, y, rows, lo, hi):  # pragma: no cover - compiled
    """y[row, col:col + w] += (x[row] A^T) B^T for the rows rows[lo:hi] of one adapter: A [r, n] at
    data[a:], B's block [w / LANES, r, LANES] at data[b:] (lora.fused_arrays). A is read once, a rank
    at a time, for ROWS rows at once (`dots`), then B's block in order, LANES columns at a time, for
    ROWS rows at once (`add_lowranks`). x's width and w are whole vectors (FusedDecode.why_not)."""
    n, wide = x.shape[1], y.shape[1]
    xf, yf = x.reshape(-1), y.reshape(-1)
    t = np.empty((hi - lo) * r, np.float32)
    for g in range(lo, hi, ROWS):
        m, tg = min(ROWS, hi - g), (g - lo) * r
        for k in range(r):
            if m == 4:
                dots4(data, a + k * n, xf, rows, g, n, t, tg + k, r)
            elif m == 3:
                dots3(data, a + k * n, xf, rows, g, n, t, tg + k, r)
            elif m == 2:
                dots2(data, a + k * n, xf, rows, g, n, t, tg + k, r)
            else:
                dots1(data, a + k * n, xf, rows, g, n, t, tg + k, r)
    for j in range(0, w, LANES):
        for g in range(lo, hi, ROWS):
            m, tg = min(ROWS, hi - g), (g - lo) * r
            if m == 4:
                add_lowranks4(yf, rows, g, wide, col + j, t, tg, data, b + j * r, r)
            elif m == 3:
                add_lowranks3(yf, rows, g, wide, col + j, t, tg, data, b + j * r, r)
            elif m == 2:
                add_lowranks2(yf, rows, g, wide, col + j, t, tg, data, b + j * r, r)
            else:
                add_lowranks1(yf, rows, g, wide, col + j, t, tg, data, b + j * r, r)
