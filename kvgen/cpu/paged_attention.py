"""decode_step's attention: a step's rows, each over its own cached positions, in the plain fp32
cache's rows or in a quantized format's (fp8, q4) blocks, each dequantized a KV head at a time
into a tile that stays in L1 for the task's query heads and rows (kv_io.load). Both take the
same tasks: at 1k tokens of context the quantized formats' own split scheme, a block's scores a
query head at a time, had fp8 at 0.78x and q4 at 0.65x of fp32's decode on a Sapphire Rapids;
these tasks, with kv_lanes.py's dequantizing, 1.02x and 0.93x (bench/results/kv.md).

A task is one row, one run of SPLIT keys and the query heads of one KV head, or one of those
heads (plan says when); the threads take runs of tasks holding equal numbers of keys, and a row
of several runs merges their partial softmaxes in order (FlashDecoding with a fixed split: a
row's sums do not depend on the batch, and one row of 1k keys still keeps both cores busy).
The scores and weighted values are key_lanes.py's kernels. A thread takes the tasks of up to
BUNDLE consecutive rows of one sequence together, reading each tile of keys and block of values
once for them (30 layers of a 512-token chunk's attention: ~110 -> ~88 ms). Every head's
arithmetic is the same whatever else its task or step holds, so a row's output is the same bits
in any step: a prompt token's K/V and logits are those of the same token decoded alone (the
batch invariance and the prefix cache's exactness rest on that).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kvgen.cpu import key_lanes, kv_io, vector_exp
from kvgen.cpu.threads import PARTS

# Keys per attention task: a row's keys go in runs of SPLIT (a multiple of key_lanes.TILE), whose
# partial softmaxes are merged in order. Fixed, not cut to the batch: a row's sums are then the
# same in every step, and one row with 1k keys still keeps both cores busy.
SPLIT = 256
# Fewer (key, query head) pairs than this in a step are attended on the calling thread alone.
SERIAL_BELOW = 1024
# From this many (row, run of keys, KV head) triples in a step, a task holds a KV head's whole group.
GROUP_TASKS_FROM = 4 * PARTS


@njit(cache=True, nogil=True)
def blocks_read(tables, positions, block, pool):  # pragma: no cover - compiled
    """The distinct blocks the rows read, in order of first read, and each block's index in that
    list (-1 where unread): what key_lanes.transpose_blocks copies for a step whose rows read the
    same blocks again and again (a prompt chunk)."""
    slot = np.full(pool, -1, np.int64)
    order = np.empty(pool, np.int64)
    n = 0
    for r in range(tables.shape[0]):
        for j in range(positions[r] // block + 1):
            b = tables[r, j]
            if slot[b] < 0:
                slot[b] = n
                order[n] = b
                n += 1
    return order[:n].copy(), slot


@njit(cache=True, nogil=True)
def plan(positions, kv_heads, group, head_dim, quantized=False):  # pragma: no cover - compiled
    """A step's attention tasks, the same at every layer. A task is a row's run of SPLIT keys and
    `per` query heads of one KV head: the whole group where there are tasks enough for the
    threads (a tile of keys is then read from memory once for the group; a 512-token prompt
    chunk's attention took twice as long with a task a head), else one (a row of 150 keys is
    three group tasks on two threads: 18 -> 27 us a layer against the per-head kernel before
    this one, 18 -> 22 with a task a head). Returns (each row's first task, each task's row, the
    threads' runs of tasks) and the tasks' partial outputs, maxes and sums ([tasks, per, ...]).
    The runs hold equal numbers of keys, not of tasks: a prompt chunk's later rows see more keys."""
    rows = positions.shape[0]
    runs = 0
    for r in range(rows):
        runs += positions[r] // SPLIT + 1
    # (a quantized cache's blocks are dequantized a task: always the group, once for its heads)
    per = group if runs * kv_heads >= GROUP_TASKS_FROM or quantized else 1
    wide = kv_heads * group // per  # tasks a run
    first = np.empty(rows + 1, np.int64)
    first[0] = 0
    for r in range(rows):
        first[r + 1] = first[r] + (positions[r] // SPLIT + 1) * wide
    tasks = first[rows]
    task_row = np.empty(tasks, np.int64)
    keys = np.empty(tasks + 1, np.int64)  # keys[i]: keys read by tasks before task i
    keys[0] = 0
    for r in range(rows):
        for i in range(first[r], first[r + 1]):
            task_row[i] = r
            keys[i + 1] = keys[i] + min(SPLIT, positions[r] + 1 - (i - first[r]) // wide * SPLIT)
    parts = min(tasks, PARTS) if keys[tasks] * group >= SERIAL_BELOW else 1
    cuts = np.empty(parts + 1, np.int64)
    for part in range(parts):
        cuts[part] = np.searchsorted(keys, keys[tasks] * part // parts)
    cuts[parts] = tasks
    partial = (np.empty((tasks, per, head_dim), np.float32), np.empty((tasks, per), np.float32),
               np.empty((tasks, per), np.float32))
    return (first, task_row, cuts), partial


# No fastmath here: Numba would put its flags on key_lanes' additions, which LLVM could then
# reorder, differently where the same kernel is inlined twice (its rows and transposed variants
# gave different bits that way).
@njit(parallel=True, cache=True, nogil=True)
def attend(q, kv, c, layer, tables, positions, heads, kv_heads, head_dim, out, tasks, partial, slot,
           kt):  # pragma: no cover - compiled
    """out[r, h] = softmax(q_rh K^T / sqrt(D)) V over row r's cached positions 0..positions[r], for
    the tasks of plan(positions, ...) (the module's docstring), with keys from kt (their
    transposed copy, key_lanes.transpose_blocks, where kt is not empty: slot maps a block to its
    place there) or from the cache. A step of few keys runs on this thread alone (waking the
    other costs more than it saves)."""
    first, task_row, cuts = tasks
    parts = cuts.shape[0] - 1
    if parts == 1:
        _run(0, cuts[1], q, kv, c, layer, tables, positions, heads, kv_heads, head_dim, out, first, task_row, partial,
             slot, kt)
    else:
        for part in prange(parts):
            _run(cuts[part], cuts[part + 1], q, kv, c, layer, tables, positions, heads, kv_heads, head_dim, out, first,
                 task_row, partial, slot, kt)
    if positions.shape[0] and positions.max() >= SPLIT:
        merge(partial[0], partial[1], partial[2], first, positions, heads, out)


# Tasks of consecutive rows of one sequence (a prompt chunk's) done together: each tile of keys and
# block of values is read for all of them while it is in L1. One row at a time, the 512 rows of a
# chunk read a layer's whole cache, some 800 KB, once each, from L2 or beyond: the loads, not the
# multiply-adds, bounded its attention.
BUNDLE = 4


@njit(cache=True, nogil=True)
def _bundle(task, hi, first, task_row, tables, positions, block, members):  # pragma: no cover - compiled
    """Fill members with task and the tasks after it in [task, hi) that hold the same run and
    heads of the next rows of the same sequence (consecutive positions, the same blocks); return
    how many (at most BUNDLE)."""
    r, i = task_row[task], task - first[task_row[task]]
    members[0] = task
    n = 1
    while n < BUNDLE and r + n < positions.shape[0]:
        nxt = first[r + n] + i
        if nxt >= hi or positions[r + n] != positions[r] + n:
            break
        for j in range(positions[r + n] // block + 1):
            if tables[r + n, j] != tables[r, j]:
                return n
        members[n] = nxt
        n += 1
    return n


@njit(cache=True, nogil=True)
def _run(lo, hi, q, kv, c, layer, tables, positions, heads, kv_heads, head_dim, out, first, task_row, partial, slot,
         kt):  # pragma: no cover - compiled
    """attend's tasks lo .. hi - 1 (no fastmath, as attend), a bundle at a time: a task's
    arithmetic is the same whichever bundle holds it (a score is one call's, the values are added
    in order of key however the calls cut them). Keys and values come from kv's rows, or where c
    is a quantized format's (kv_io.py) from a tile a block's rows are dequantized into, once
    for the bundle's rows and the task's heads."""
    group = heads // kv_heads
    block, hd = kv.shape[3], head_dim
    scale = np.float32(1.0 / math.sqrt(head_dim))
    transposed = kt.shape[0] > 0
    # the Cache tuple's members kv_io.load reads, taken out once (kv_io.py says why)
    kind, codes, block_scale, kscale, vscale = (c[kv_io.KIND], c[kv_io.CODES], c[kv_io.SCALE],
                                                c[kv_io.KSCALE], c[kv_io.VSCALE])
    q4_group, exact, recent, sink, sink_slot = (c[kv_io.GROUP], c[kv_io.ROWS], c[kv_io.RECENT],
                                                c[kv_io.SINK], c[kv_io.FIRST])
    quantized = kind != kv_io.PLAIN
    part_acc, part_top, part_sum = partial
    per = part_acc.shape[1]  # heads a task
    kvf, ktf, qf, accf = kv.reshape(-1), kt.reshape(-1), q.reshape(-1), part_acc.reshape(-1)
    per_block, per_layer, per_key = kv[0].size, kv[0, 0].size, kv_heads * hd
    # zeros: a tile's rows past those loaded are scored too (and not used): never garbage floats
    tile = np.zeros((-(-block // key_lanes.TILE) * key_lanes.TILE if quantized else 0, hd), np.float32)
    tf = tile.reshape(-1)
    scores = np.empty((BUNDLE, per, SPLIT), np.float32)
    sf = scores.reshape(-1)
    members, done = np.empty(BUNDLE, np.int64), np.zeros(hi - lo, np.bool_)
    for task in range(lo, hi):
        if done[task - lo]:
            continue
        n = _bundle(task, hi, first, task_row, tables, positions, block, members)
        r = task_row[task]
        i = task - first[r]
        run, h0 = i // (heads // per), i % (heads // per) * per  # h0: the tasks' first head
        kh = h0 // group
        p0, table = run * SPLIT, tables[r]
        most = min(SPLIT, positions[r] + n - p0)  # keys of the bundle's last row
        for t in range(0, most, key_lanes.TILE):  # the tile stays in L1 for the bundle's rows and heads
            b, off = table[(p0 + t) // block], (p0 + t) % block
            src, at, stride = kvf, b * per_block + layer * per_layer + off * per_key + kh * hd, per_key
            if quantized:
                if t == 0 or off == 0:  # the block's keys the bundle reads
                    kv_io.load(kind, codes, block_scale, kscale, vscale, q4_group, exact, recent, sink,
                                  sink_slot, layer, 0, b, kh, min(block, off + most - t), tile)
                src, at, stride = tf, off * hd, hd
            for m in range(n):
                if t >= positions[r + m] + 1 - p0:
                    continue
                rq, o = (r + m) * q.shape[1], m * per * SPLIT
                shared = 0
                while transposed and per - shared >= 2:  # heads sharing each load of the copy
                    k = min(per - shared, key_lanes.MAX_HEADS)
                    key_lanes.scores_heads(k, ktf, (slot[b] * kv_heads + kh) * hd * block + off, block, qf,
                                           rq + (h0 + shared) * hd, hd, scale, sf, o + shared * SPLIT + t, SPLIT)
                    shared += k
                for g in range(shared, per):
                    if transposed:
                        key_lanes.scores_transposed(ktf, (slot[b] * kv_heads + kh) * hd * block + off, block, qf,
                                                    rq + (h0 + g) * hd, hd, scale, sf, o + g * SPLIT + t)
                    else:
                        key_lanes.scores_rows(src, at, stride, qf, rq + (h0 + g) * hd, hd, scale, sf,
                                              o + g * SPLIT + t)
        for m in range(n):
            tm, n_keys = members[m], min(SPLIT, positions[r + m] + 1 - p0)
            done[tm - lo] = True
            for g in range(per):
                top = vector_exp.largest(scores[m, g], n_keys)
                part_top[tm, g] = top
                part_sum[tm, g] = vector_exp.exp_shifted(scores[m, g], n_keys, top)
            part_acc[tm] = 0
        t = 0
        while t < most:  # the values, a block's run at a time, for the bundle's rows
            b, off = table[(p0 + t) // block], (p0 + t) % block
            run_len = min(block - off, most - t)
            src, at, stride = kvf, b * per_block + layer * per_layer + per_layer // 2 + off * per_key + kh * hd, per_key
            if quantized:
                kv_io.load(kind, codes, block_scale, kscale, vscale, q4_group, exact, recent, sink, sink_slot,
                              layer, 1, b, kh, off + run_len, tile)
                src, at, stride = tf, off * hd, hd
            for m in range(n):
                n_vals = min(run_len, positions[r + m] + 1 - p0 - t)
                if n_vals <= 0:
                    continue
                for g0 in range(0, per, key_lanes.MAX_HEADS):
                    key_lanes.values(min(key_lanes.MAX_HEADS, per - g0), src, at, stride, n_vals, sf,
                                     (m * per + g0) * SPLIT + t, SPLIT, hd, accf, (members[m] * per + g0) * hd)
            t += run_len
        for m in range(n):
            if positions[r + m] < SPLIT:  # the row's only run: its output
                for g in range(per):
                    inv = np.float32(1) / part_sum[members[m], g]
                    for d in range(hd):
                        out[r + m, (h0 + g) * hd + d] = part_acc[members[m], g, d] * inv


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def merge(part_acc, part_top, part_sum, first, positions, heads, out):  # pragma: no cover
    """The output of every row of several runs: their partial softmaxes rescaled to the largest
    max and added in order of position."""
    per, hd = part_acc.shape[1], part_acc.shape[2]
    for rh in prange(positions.shape[0] * heads):
        r, h = rh // heads, rh % heads
        runs = positions[r] // SPLIT + 1
        if runs == 1:
            continue
        at, g = first[r] + h // per, h % per  # the task of run 0 that holds head h, and its place there
        top = np.float32(-np.inf)
        for run in range(runs):
            top = max(top, part_top[at + run * (heads // per), g])
        total = np.float32(0)
        o = out[r, h * hd:(h + 1) * hd]
        o[:] = 0
        for run in range(runs):
            t = at + run * (heads // per)
            f = np.float32(math.exp(part_top[t, g] - top))
            total += part_sum[t, g] * f
            for d in range(hd):
                o[d] += part_acc[t, g, d] * f
        inv = np.float32(1) / total
        for d in range(hd):
            o[d] *= inv
