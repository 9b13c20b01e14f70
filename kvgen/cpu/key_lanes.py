"""The kernels of decode_step's attention over plain fp32 KV (paged_attention.py): a score with a
lane per key.

A score is a dot product over head_dim. With a lane per dimension (the obvious vectorization of
keys stored as rows) every key ends in a horizontal sum across its vector, one key at a time;
on a 512-token prompt chunk that, not the multiplies, made the attention 43% of the chunk.

- scores_transposed reads transpose_blocks' copy of the blocks, a vector per dimension holding
  16 keys: a tile's scores are multiply-adds into vectors of 16 sums, LANES chains of them, and
  the chains are added as vectors. A prompt chunk's rows read the same blocks again and again,
  so the copy is made once a layer for all of them (30 layers of a 512-token chunk's attention:
  191 -> 116 ms).
- scores_rows reads a decode row's keys from the cache's rows (each is read once, a copy would
  cost as much as it saves): a lane per dimension, but the 16 keys' horizontal sums are done
  together by a transpose that adds as it goes (_tree_across).
  Both make the same roundings in the same order (chain l: dimensions c LANES + l in order of
  c; then the chains added pairwise, l with l + LANES / 2 first): a key's score is the same bits
  either way, so a row's output does not depend on whether it came in a prompt chunk.
- scores_heads is scores_transposed for the 2 to MAX_HEADS query heads that share a KV head,
  each load of the copy serving them all: the same chains and tree, computed a chain at a time
  (30 layers of a 512-token chunk's scores: ~43 -> ~30 ms).
- values adds weight x value rows into the sums of up to MAX_HEADS heads, key after key, a lane
  per dimension (no horizontal sum there): each value row is loaded once for the heads.

The operations are LLVM IR (Numba has no vector types), as vector_matmul.py's block matmuls are.
A multiply-add is one fused `llvm.fma` where the CPU has FMA, else a multiply and an add: never
`fmuladd`, which leaves the choice to each compilation. Their callers are compiled without
fastmath, whose flags Numba would put on these additions too (paged_attention.py).
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgen.cpu.llvm_ir import FLOATS, I32, LANES, add_all, arguments, broadcast, fma, i64, splat, vector
from kvgen.cpu.threads import PARTS

TILE = 16  # keys a scores call computes; a KV block must hold a whole number of them
VECS = TILE // LANES  # vectors a tile of keys fills
MAX_HEADS = 4  # heads one values call serves (more: several calls, the same arithmetic per head)



def _vec(builder, ptr):
    return builder.bitcast(ptr, FLOATS.as_pointer())


def _transpose(builder, rows):
    """LANES vectors -> their transpose, one stage per bit of the index: stage k swaps bit k of
    the row and the column index (two-input shuffles, LANES per stage)."""
    rows = list(rows)
    for k in reversed(range(int(math.log2(LANES)))):
        b = 1 << k
        out = list(rows)
        for i in range(LANES):
            if i & b:
                continue
            lo = [j if not j & b else LANES + j - b for j in range(LANES)]
            hi = [j + b if not j & b else LANES + j for j in range(LANES)]
            out[i] = builder.shuffle_vector(rows[i], rows[i + b], vector(I32, lo))
            out[i + b] = builder.shuffle_vector(rows[i], rows[i + b], vector(I32, hi))
        rows = out
    return rows


@intrinsic
def _transpose_tile(typingctx, src, sbase, sstride, hd, dst, dbase, dstride):
    """dst[dbase + d dstride + t] = src[sbase + t sstride + d] for the TILE keys t, every d < hd."""
    names = ("src", "sbase", "sstride", "hd", "dst", "dbase", "dstride")
    sig = types.void(src, sbase, sstride, hd, dst, dbase, dstride)

    def codegen(context, builder, signature, args):
        a = arguments(context, builder, signature, args, names)
        at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
        with cgutils.for_range(builder, builder.udiv(a["hd"], i64(LANES))) as loop:
            d0 = builder.mul(loop.index, i64(LANES))
            for v in range(VECS):
                rows = [builder.load(_vec(builder, at(a["src"], a["sbase"], d0,
                                                      builder.mul(a["sstride"], i64(v * LANES + t)))), align=4)
                        for t in range(LANES)]
                for i, col in enumerate(_transpose(builder, rows)):
                    out = at(a["dst"], a["dbase"], builder.mul(builder.add(d0, i64(i)), a["dstride"]), i64(v * LANES))
                    builder.store(col, _vec(builder, out), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _tree(builder, parts):
    """parts[0] + ... + parts[LANES - 1], added pairwise: parts l and l + LANES / 2 first, then l
    and l + LANES / 4 of those sums, and so on (the order of both _scores variants)."""
    parts = list(parts)
    while len(parts) > 1:
        half = len(parts) // 2
        parts = [builder.fadd(parts[i], parts[i + half]) for i in range(half)]
    return parts[0]


def _tree_across(builder, vecs):
    """LANES vectors a_t (t < LANES) -> one vector whose lane for key t holds _tree of a_t's lanes:
    the same additions as _tree over vectors, done across lanes by two-input shuffles (a
    transpose that adds as it goes), and the keys' lanes put back in order at the end."""
    vecs, keys = list(vecs), [[t] * LANES for t in range(LANES)]  # keys[i][j]: the key in lane j of vecs[i]
    b = LANES // 2
    while b:
        out, out_keys = [], []
        for t in range(b):  # pair vectors t and t + b; in each segment of 2b lanes, the lower
            lo, hi = [], []  # half takes vector t's lanes and the upper half vector t + b's
            for j in range(LANES):
                seg, m = j - j % (2 * b), j % (2 * b)
                lo.append(seg + m if m < b else LANES + seg + m - b)
                hi.append(seg + m + b if m < b else LANES + seg + m)
            x = builder.shuffle_vector(vecs[t], vecs[t + b], vector(I32, lo))
            y = builder.shuffle_vector(vecs[t], vecs[t + b], vector(I32, hi))
            out.append(builder.fadd(x, y))
            out_keys.append([keys[t][i] if i < LANES else keys[t + b][i - LANES] for i in lo])
        vecs, keys, b = out, out_keys, b // 2
    order = [keys[0].index(t) for t in range(LANES)]
    return builder.shuffle_vector(vecs[0], vecs[0], vector(I32, order))


def _scores(transposed: bool):
    """An intrinsic: out[obase + t] = scale sum_d q[qbase + d] key_t[d] for the TILE keys t of a tile.
    The sum over d: for each lane l < LANES, the dimensions c LANES + l in order of c (a chain of
    multiply-adds), then the LANES chains added pairwise, l with l + LANES / 2 first.
    transposed: key_t[d] = k[kbase + d kstride + t] (transpose_blocks' copy): a chain is a vector
    over keys, and _tree adds the chains as vectors. Else key_t[d] = k[kbase + t kstride + d] (the
    cache's rows): a key's chains are the lanes of one vector, and _tree_across adds across them.
    The same roundings in the same order: a key's score is the same bits either way. (Chains of
    several heads at once, sharing each load of the copy, were slower: they left the registers.)"""
    names = ("k", "kbase", "kstride", "q", "qbase", "hd", "scale", "out", "obase")

    @intrinsic
    def scores(typingctx, k, kbase, kstride, q, qbase, hd, scale, out, obase):
        sig = types.void(k, kbase, kstride, q, qbase, hd, scale, out, obase)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            # chains[v][l]: chain l of the keys of vector v (transposed), or the chains of key
            # v LANES + l (rows); zeros to start: fma(x, y, 0) rounds x y once, as a multiply would
            chains = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None)) for _ in range(LANES)]
                      for _ in range(VECS)]
            with cgutils.for_range(builder, builder.udiv(a["hd"], i64(LANES))) as loop:
                d0 = builder.mul(loop.index, i64(LANES))
                if transposed:
                    for lane in range(LANES):
                        d = builder.add(d0, i64(lane))
                        ql = splat(builder, at(a["q"], a["qbase"], d))
                        for v in range(VECS):
                            kd = at(a["k"], a["kbase"], builder.mul(d, a["kstride"]), i64(v * LANES))
                            chain = chains[v][lane]
                            builder.store(fma(builder, ql, builder.load(_vec(builder, kd), align=4),
                                                builder.load(chain)), chain)
                else:
                    qv = builder.load(_vec(builder, at(a["q"], a["qbase"], d0)), align=4)
                    for v in range(VECS):
                        for t in range(LANES):
                            kt = at(a["k"], a["kbase"], builder.mul(a["kstride"], i64(v * LANES + t)), d0)
                            chain = chains[v][t]
                            builder.store(fma(builder, qv, builder.load(_vec(builder, kt), align=4),
                                                builder.load(chain)), chain)
            s = broadcast(builder, a["scale"])
            for v in range(VECS):
                total = (_tree if transposed else _tree_across)(builder, [builder.load(c) for c in chains[v]])
                builder.store(builder.fmul(total, s), _vec(builder, at(a["out"], a["obase"], i64(v * LANES))), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores


def _scores_heads(heads: int):
    """An intrinsic: scores_transposed for `heads` query heads at once (q[qbase + g hd + d] for head
    g; out[obase + g ostride + t]), each K vector loaded once for them all. The same roundings in
    the same order as scores_transposed: a key's score is the same bits. What differs is when:
    a chain at a time (two, for the first pairwise addition), each added into the tree as soon as
    its partner is ready, so a head needs a few registers, not LANES, and several heads fit
    (one head at a time, a tile cost a K load and a q broadcast a multiply-add: the loads, not the
    multiplies, bounded a prompt chunk's scores)."""
    names = ("k", "kbase", "kstride", "q", "qbase", "hd", "scale", "out", "obase", "ostride")

    @intrinsic
    def scores(typingctx, k, kbase, kstride, q, qbase, hd, scale, out, obase, ostride):
        sig = types.void(k, kbase, kstride, q, qbase, hd, scale, out, obase, ostride)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731
            steps = builder.udiv(a["hd"], i64(LANES))

            def chains(lanes, v):  # {(lane, head): chain} over dimensions c LANES + lane, in order of c
                acc = {(lane, g): cgutils.alloca_once_value(builder, ir.Constant(FLOATS, None))
                       for lane in lanes for g in range(heads)}
                with cgutils.for_range(builder, steps) as loop:
                    for lane in lanes:
                        d = builder.add(builder.mul(loop.index, i64(LANES)), i64(lane))
                        kd = builder.load(_vec(builder, at(a["k"], a["kbase"], builder.mul(d, a["kstride"]),
                                                          i64(v * LANES))), align=4)
                        for g in range(heads):
                            qg = splat(builder, at(a["q"], a["qbase"], builder.mul(a["hd"], i64(g)), d))
                            builder.store(fma(builder, qg, kd, builder.load(acc[lane, g])), acc[lane, g])
                return {key: builder.load(ptr) for key, ptr in acc.items()}

            def node(i, level, v):  # _tree's level-`level` partial sum i, for every head
                if level == 1:
                    c = chains([i, i + LANES // 2], v)
                    return [builder.fadd(c[i, g], c[i + LANES // 2, g]) for g in range(heads)]
                left, right = node(i, level - 1, v), node(i + (LANES >> level), level - 1, v)
                return [builder.fadd(x, y) for x, y in zip(left, right, strict=True)]

            s = broadcast(builder, a["scale"])
            for v in range(VECS):
                for g, total in enumerate(node(0, int(math.log2(LANES)), v)):
                    dest = at(a["out"], a["obase"], builder.mul(a["ostride"], i64(g)), i64(v * LANES))
                    builder.store(builder.fmul(total, s), _vec(builder, dest), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores


def _values(heads: int):
    """An intrinsic: acc[abase + g hd + d] += w[wbase + g wstride + t] v[vbase + t vstride + d] for
    t < n in order, heads g < `heads`, every d < hd; four vectors of dimensions at a time where hd
    allows (the same sums, in the same order, as one at a time)."""
    names = ("v", "vbase", "vstride", "n", "w", "wbase", "wstride", "hd", "acc", "abase")

    @intrinsic
    def values(typingctx, v, vbase, vstride, n, w, wbase, wstride, hd, acc, abase):
        sig = types.void(v, vbase, vstride, n, w, wbase, wstride, hd, acc, abase)

        def codegen(context, builder, signature, args):
            a = arguments(context, builder, signature, args, names)
            at = lambda ptr, *terms: builder.gep(ptr, [add_all(builder, terms)])  # noqa: E731

            def run(start, count, unroll):  # `count` runs of `unroll` vectors of dimensions from start
                sums = [[cgutils.alloca_once(builder, FLOATS) for _ in range(unroll)] for _ in range(heads)]
                with cgutils.for_range(builder, count) as chunk:
                    d0 = builder.add(start, builder.mul(chunk.index, i64(unroll * LANES)))
                    dest = [[_vec(builder, at(a["acc"], a["abase"], builder.mul(a["hd"], i64(g)), d0,
                                              i64(u * LANES))) for u in range(unroll)] for g in range(heads)]
                    for g in range(heads):
                        for u in range(unroll):
                            builder.store(builder.load(dest[g][u], align=4), sums[g][u])
                    with cgutils.for_range(builder, a["n"]) as key:
                        t = key.index
                        row = [builder.load(_vec(builder, at(a["v"], a["vbase"], builder.mul(t, a["vstride"]), d0,
                                                             i64(u * LANES))), align=4) for u in range(unroll)]
                        for g in range(heads):
                            w_at = at(a["w"], a["wbase"], builder.mul(a["wstride"], i64(g)), t)
                            wt = splat(builder, w_at)
                            for u in range(unroll):
                                builder.store(fma(builder, wt, row[u], builder.load(sums[g][u])), sums[g][u])
                    for g in range(heads):
                        for u in range(unroll):
                            builder.store(builder.load(sums[g][u]), dest[g][u], align=4)

            unroll = max(1, min(4, 12 // heads))
            whole = builder.udiv(a["hd"], i64(unroll * LANES))
            run(i64(0), whole, unroll)
            done = builder.mul(whole, i64(unroll * LANES))
            run(done, builder.udiv(builder.sub(a["hd"], done), i64(LANES)), 1)
            return context.get_dummy_value()

        return sig, codegen

    return values


scores_rows, scores_transposed = _scores(False), _scores(True)
_s2, _s3, _s4 = (_scores_heads(n) for n in range(2, MAX_HEADS + 1))


@njit(nogil=True, inline="always")
def scores_heads(n, k, kbase, kstride, q, qbase, hd, scale, out, obase, ostride):  # pragma: no cover
    """scores_transposed for n (2 to MAX_HEADS) heads whose queries are hd apart."""
    if n == 4:
        _s4(k, kbase, kstride, q, qbase, hd, scale, out, obase, ostride)
    elif n == 3:
        _s3(k, kbase, kstride, q, qbase, hd, scale, out, obase, ostride)
    else:
        _s2(k, kbase, kstride, q, qbase, hd, scale, out, obase, ostride)
_v1, _v2, _v3, _v4 = (_values(n) for n in range(1, MAX_HEADS + 1))


@njit(nogil=True, inline="always")
def values(n, v, vbase, vstride, count, w, wbase, wstride, hd, acc, abase):  # pragma: no cover
    if n == 4:
        _v4(v, vbase, vstride, count, w, wbase, wstride, hd, acc, abase)
    elif n == 3:
        _v3(v, vbase, vstride, count, w, wbase, wstride, hd, acc, abase)
    elif n == 2:
        _v2(v, vbase, vstride, count, w, wbase, wstride, hd, acc, abase)
    else:
        _v1(v, vbase, vstride, count, w, wbase, wstride, hd, acc, abase)


@njit(parallel=True, cache=True, nogil=True)
def transpose_blocks(kv, layer, blocks, kt):  # pragma: no cover - compiled
    """kt[i, kh] = the keys of block blocks[i] at layer, head kh, transposed: [head_dim, block]."""
    kv_heads, head_dim, block = kv.shape[4], kv.shape[5], kv.shape[3]
    n = blocks.shape[0] * kv_heads
    kf, ktf = kv.reshape(-1), kt.reshape(-1)
    per_block, per_layer = kv[0].size, kv[0, 0].size
    parts = min(n, PARTS)
    for part in prange(parts):
        for i in range(part * n // parts, (part + 1) * n // parts):
            b, kh = i // kv_heads, i % kv_heads
            for t0 in range(0, block, TILE):
                src = blocks[b] * per_block + layer * per_layer + (t0 * kv_heads + kh) * head_dim
                _transpose_tile(kf, src, kv_heads * head_dim, head_dim, ktf, i * head_dim * block + t0, block)
