"""A model's decode step as one compiled call: the Llama layer loop (RMS norm, RoPE, the KV write,
paged attention, SiLU, residuals; Qwen3's per-head q/k RMS norms where given) with every op a loop,
the matmuls being block_matmul's kernels over weight_blocks' codes, so a step costs the weights'
bytes and little else.

The engine's fused_decode.py gathers a model's weights into the arrays `step` reads and calls it;
this module knows nothing of the model beyond those arrays (every matrix a table's rows of parts,
each part of any kind of blocks, in flat buffers: _linear). It runs rows of one new token each,
however many, over fp32 keys and values or fp8 / q4 (kv_io.py writes and reads them), and over
fp32 KV also runs of consecutive positions of one sequence (a prompt chunk, a draft's k + 1
tokens). Each row runs the same operations whatever the other rows: the matmul kernels' rows are
independent, norms and attention go row by row, so a prompt token's K/V and logits are those of
the same token decoded alone.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, typed, types

from kvgen.cpu import (
    block_matmul,
    int16_rounding,
    key_lanes,
    kv_io,
    lora_lanes,
    paged_attention,
    vector_exp,
    vector_matmul,
)
from kvgen.cpu.threads import PARTS


@njit(fastmath=True, cache=True, nogil=True)
def _rms_norm(h, w, eps, out):  # pragma: no cover - compiled
    ss = np.float32(0)
    for i in range(h.shape[0]):
        ss += h[i] * h[i]
    inv = np.float32(1) / math.sqrt(ss / h.shape[0] + eps)
    for i in range(h.shape[0]):
        out[i] = h[i] * inv * w[i]


@njit(fastmath=True, cache=True, nogil=True)
def _rope(x, head, cos, sin):  # pragma: no cover - compiled
    """Rotate the interleaved pairs of x[head * D : (head + 1) * D] (model.py's layout)."""
    half = cos.shape[0]
    base = head * 2 * half
    for i in range(half):
        a, b = x[base + 2 * i], x[base + 2 * i + 1]
        x[base + 2 * i] = a * cos[i] - b * sin[i]
        x[base + 2 * i + 1] = a * sin[i] + b * cos[i]


@njit(cache=True, nogil=True)
def _head_norms(q, w, heads, kv_heads, head_dim, eps):  # pragma: no cover - compiled
    """Qwen3's q/k norms, in place, before RoPE: each of a row's query heads in its qkv output (q)
    RMS-normed with w[:head_dim], each key head with w[head_dim:] (w empty: none; model.py's
    q_norm / k_norm, their weights already in the heads' interleaved order)."""
    if w.shape[0] == 0:
        return
    for hd in range(heads + kv_heads):
        at, wat = hd * head_dim, 0 if hd < heads else head_dim
        _rms_norm(q[at:at + head_dim], w[wat:wat + head_dim], eps, q[at:at + head_dim])


@njit(cache=True, nogil=True)
def _rope_row(q, pos, heads, cos, sin):  # pragma: no cover - compiled
    """Rotate a row's first `heads` heads of its qkv output at position pos: the query heads then
    the key heads, adjacent in the fused output."""
    for hd in range(heads):
        _rope(q, hd, cos[pos], sin[pos])


# What a stage of _rows does to each row
NORM, ADD_NORM, ROPE_WRITE, SILU = 0, 1, 2, 3
# Rows from which a step's row-by-row stages are cut among the threads (a prompt chunk's: on one
# thread they were a tenth of a 512-token chunk; a decode step's few rows are not worth waking
# the other thread for).
PARALLEL_ROWS = 16


@njit(cache=True, nogil=True)
def _rows(stage, lo, hi, h, add, w, eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads, head_dim, gu,
          act):  # pragma: no cover - compiled
    """One stage for rows lo .. hi - 1, each row on its own (the same calls whichever thread or
    step runs it): NORM x = norm(h) w; ADD_NORM h += add, then NORM; ROPE_WRITE normalises the
    row's query and key heads in its qkv output (x) by w's halves (_head_norms; w empty: none),
    rotates them and writes its K/V into the plain cache; SILU act = silu(gate) up of its gate_up
    output (gu)."""
    if stage == SILU:
        for r in range(lo, hi):
            vector_exp.silu_mul(gu[r], act[r])
        return
    if stage == ROPE_WRITE:
        block, nq, nk = kv.shape[3], heads * head_dim, kv_heads * head_dim
        for r in range(lo, hi):
            pos = positions[r]
            b, off, q = tables[r, pos // block], pos % block, x[r]
            _head_norms(q, w, heads, kv_heads, head_dim, eps)
            _rope_row(q, pos, heads + kv_heads, cos, sin)
            for kh in range(kv_heads):
                for i in range(head_dim):
                    kv[b, layer, 0, off, kh, i] = q[nq + kh * head_dim + i]
                    kv[b, layer, 1, off, kh, i] = q[nq + nk + kh * head_dim + i]
        return
    for r in range(lo, hi):
        if stage == ADD_NORM:
            for i in range(h.shape[1]):
                h[r, i] += add[r, i]
        _rms_norm(h[r], w, eps, x[r])


@njit(parallel=True, cache=True, nogil=True)
def _rows_parallel(stage, h, add, w, eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads, head_dim, gu,
                   act):  # pragma: no cover - compiled
    """_rows over all rows, cut in runs of consecutive rows, one a thread."""
    rows = positions.shape[0]
    parts = min(rows, PARTS)
    for part in prange(parts):
        _rows(stage, part * rows // parts, (part + 1) * rows // parts, h, add, w, eps, x, positions, tables, kv,
              layer, cos, sin, heads, kv_heads, head_dim, gu, act)


@njit(cache=True, nogil=True)
def _stage(stage, h, add, w, eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads, head_dim, gu,
           act):  # pragma: no cover - compiled
    if positions.shape[0] >= PARALLEL_ROWS:
        _rows_parallel(stage, h, add, w, eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads, head_dim,
                       gu, act)
    else:
        _rows(stage, 0, positions.shape[0], h, add, w, eps, x, positions, tables, kv, layer, cos, sin, heads,
              kv_heads, head_dim, gu, act)


# A weight's parts (decode step's `table`: every matrix part a row of int64 fields): its kind of
# blocks (weight_blocks.BLOCK_TYPES; NONE ends a linear's list of parts), where its codes start in
# the flat buffers of `weights` (the uint8 buffer for q4 and the packed kinds, the int8 one for the others) and its
# scales in the byte buffer, their layout (vector_matmul's F16 .. SUB_MIN4), its tiles of TILE output
# rows and blocks of 32 inputs, and the output columns it fills (a fused q|k|v whose v is another
# kind: its parts side by side).
NONE, Q4, Q8, Q8H, Q8HM, Q5, Q5M, Q6H, Q4I, Q3H, Q2HM = -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
KINDS = {"q4": Q4, "q8": Q8, "q8h": Q8H, "q8hm": Q8HM, "q5": Q5, "q5m": Q5M, "q6h": Q6H, "q4i": Q4I, "q3h": Q3H,
         "q2hm": Q2HM}
# code pairs a block of each kind, by its number (vector_matmul.KINDS')
PAIRS = tuple(vector_matmul.KINDS[name][0] for name, _ in sorted(KINDS.items(), key=lambda item: item[1]))
KIND, CODES, SCALES, LAYOUT, TILES, GROUPS, COL, WIDTH = range(8)
FIELDS = 8


@njit(cache=True, nogil=True)
def _part(kind, p, weights, x, y, room, sums):  # pragma: no cover - compiled
    """y = x W^T for the part of table row p (its whole tiles: y has tiles * TILE columns), on the
    kernel of its kind, over views of the flat buffers shaped as BlockLinear holds them."""
    codes4, codes8, scales = weights
    tiles, groups, at, sat, layout = p[TILES], p[GROUPS], p[CODES], p[SCALES], p[LAYOUT]
    halves = 2 if kind == Q8H or kind == Q8HM or kind == Q6H or kind == Q3H or kind == Q2HM else 1
    supers, per = vector_matmul.scale_shape(layout, halves, groups)
    sc = scales[sat:sat + tiles * supers * per].reshape((tiles, supers, per))
    n, pairs = tiles * groups * vector_matmul.TILE, PAIRS[kind]  # (block, output row) pairs; a block's code pairs
    if kind == Q4 or kind == Q4I:  # nibbles, in the uint8 buffer
        qs = codes4[at:at + n * 2 * pairs].reshape((tiles, groups, pairs, vector_matmul.TILE, 2))
        if kind == Q4:
            block_matmul.q4_linear(x, qs, sc, layout, y, room)
        else:
            block_matmul.q4i_linear(x, qs, sc, layout, y, room)
        return
    if kind == Q5 or kind == Q5M or kind == Q6H or kind == Q3H or kind == Q2HM:  # packed, in the uint8 buffer
        qs = codes4[at:at + n * 2 * pairs].reshape((tiles, groups, pairs, vector_matmul.TILE, 2))
        if kind == Q5:
            block_matmul.q5_linear(x, qs, sc, y, room)
        elif kind == Q5M:
            block_matmul.q5m_linear(x, qs, sc, layout, y, room)
        elif kind == Q6H:
            block_matmul.q6h_linear(x, qs, sc, y, room)
        elif kind == Q3H:
            block_matmul.q3h_linear(x, qs, sc, y, room)
        else:
            block_matmul.q2hm_linear(x, qs, sc, y, room, sums)
        return
    qs = codes8[at:at + n * 2 * pairs].reshape((tiles, groups, pairs, vector_matmul.TILE, 2))
    if kind == Q8:
        block_matmul.q8_linear(x, qs, sc, layout, y, room)
    elif kind == Q8H:
        block_matmul.q8h_linear(x, qs, sc, y, room)
    else:
        block_matmul.q8hm_linear(x, qs, sc, y, room, sums)


@njit(cache=True, nogil=True)
def _linear(parts, weights, x, y, room, sums, spare):  # pragma: no cover - compiled
    """y = x W^T for one weight whose parts (rows of the table) may each be of another kind: a
    weight of one part whose tiles fill y is written in place; each part of the others into
    spare (flat), then its own columns copied to theirs in y (a part's padding rows dropped)."""
    rows = x.shape[0]
    single = parts.shape[0] == 1 or parts[1, KIND] == NONE
    for i in range(parts.shape[0]):
        p = parts[i]
        kind = p[KIND]
        if kind == NONE:
            break
        wide = p[TILES] * vector_matmul.TILE
        if single and wide == y.shape[1]:
            _part(kind, p, weights, x, y, room, sums)
            continue
        out = spare[:rows * wide].reshape((rows, wide))
        _part(kind, p, weights, x, out, room, sums)
        col, width = p[COL], p[WIDTH]
        for r in range(rows):
            y[r, col:col + width] = out[r, :width]


# A LoRA span (lora.fused_arrays): where one adapter module's A [rank, in] and its block of B, as
# [width / LANES, rank, LANES] (lora_lanes.add_lowranks' order), lie in the adapter's flat float32
# array, the rank (0 ends a linear's spans) and the output columns the block adds to
LORA_A, LORA_B, LORA_RANK, LORA_COL, LORA_WIDTH = range(5)
SPAN_FIELDS = 5


@njit(cache=True, nogil=True)
def _lora_span(data, span, x, y, rows, lo, hi):  # pragma: no cover - compiled
    """y[row, col:col + width] += (x[row] A^T) B^T for the rows rows[lo:hi] of one adapter (lora_lanes.span:
    A and B read once for all of them, each vector for several rows at once). Inputs and widths are
    whole vectors (FusedDecode.why_not)."""
    lora_lanes.span(data, span[LORA_A], span[LORA_B], span[LORA_RANK], span[LORA_COL], span[LORA_WIDTH], x, y,
                    rows, lo, hi)


@njit(parallel=True, cache=True, nogil=True)
def _lora(lora, lora_table, layer, linear, groups, rows, x, y):  # pragma: no cover - compiled
    """Each adapter's low-rank delta on its rows' output y of one linear (input x), after the base
    matmul over all rows (Punica's / S-LoRA's grouped products): groups [G, 3] are (the adapter's
    place in lora and lora_table, its first and end place in rows), an adapter's rows listed together
    in rows. Each (adapter, span) is a thread's item: they write apart (rows by adapter, columns by span)."""
    per = lora_table.shape[3]
    for item in prange(groups.shape[0] * per):
        g, s = item // per, item % per
        slot = groups[g, 0]
        span = lora_table[slot, layer, linear, s]
        if span[LORA_RANK]:
            _lora_span(lora[slot], span, x, y, rows, groups[g, 1], groups[g, 2])


@njit(cache=True, nogil=True)
def step(h, positions, tables, kv, kvq, blocks, slot, kt, ln1, ln2, norm, weights, table, head, qkv_bias,
         qk_norm, widths, cos, sin, eps, heads, kv_heads, head_dim, inter, need, logits, features, lora, lora_table,
         lora_rows, lora_groups):  # pragma: no cover
    """h [rows, hidden]: the rows' token embeddings (the caller looks them up: a GGUF's table stays
    quantized), the residual stream from then on (written over). table [layers, 4, parts, FIELDS]:
    each layer's qkv, o, gate_up and down as rows of parts (_linear); head [parts, FIELDS] the same
    for the lm head; qkv_bias [layers, qkv columns] added to qkv's output ([layers, 0]: no bias); qk_norm
    [layers, 2 * head_dim] each layer's query then key head norm weights (Qwen3; [layers, 0]: none); widths: the
    four outputs' columns, then the widest part that goes through the
    spare buffer (0: none does). LoRA adapters (_lora; lora_groups [0, 3]: none): lora a typed list of
    the step's adapters' flat arrays, lora_table [adapters, layers, 4, spans, SPAN_FIELDS] their spans,
    lora_rows the rows with an adapter, grouped by adapter, lora_groups each group's adapter and rows."""
    rows, hidden = h.shape[0], h.shape[1]
    x = np.empty((rows, hidden), np.float32)
    qkv_out = np.empty((rows, widths[0]), np.float32)
    att = np.empty((rows, heads * head_dim), np.float32)
    o_out = np.empty((rows, widths[1]), np.float32)
    gu = np.empty((rows, widths[2]), np.float32)
    act = np.empty((rows, inter), np.float32)
    d_out = np.empty((rows, widths[3]), np.float32)
    # the head's rows may outnumber the step's (a row named twice in need)
    most, widest = max(rows, need.shape[0]), max(hidden, inter, heads * head_dim)
    room = int16_rounding.scratch(most, widest)
    sums = np.empty(most * (widest // 16), np.float32)  # q8hm's sums of x per 16 inputs
    spare = np.empty(most * widths[4], np.float32)
    block = kv.shape[3]
    nq, nk = heads * head_dim, kv_heads * head_dim
    plain = kvq[kv_io.KIND] == kv_io.PLAIN
    plan, partial = paged_attention.plan(positions, kv_heads, heads // kv_heads, head_dim, not plain)
    adapted = lora_groups.shape[0] > 0
    for layer in range(ln1.shape[0]):
        # the previous layer's MLP output is added here, with this layer's first norm
        _stage(ADD_NORM if layer else NORM, h, d_out, ln1[layer], eps, x, positions, tables, kv, layer, cos, sin,
               heads, kv_heads, head_dim, gu, act)
        _linear(table[layer, 0], weights, x, qkv_out, room, sums, spare)
        for r in range(rows if qkv_bias.shape[1] else 0):  # fp32 adds, as Model.forward's out + b
            for i in range(qkv_bias.shape[1]):
                qkv_out[r, i] += qkv_bias[layer, i]
        if adapted:  # before RoPE and the KV write, after the bias (Model.forward's (W x + b) + delta)
            _lora(lora, lora_table, layer, 0, lora_groups, lora_rows, x, qkv_out)
        if plain:  # (ROPE_WRITE's w: the layer's q/k norm weights)
            _stage(ROPE_WRITE, h, d_out, qk_norm[layer], eps, qkv_out, positions, tables, kv, layer, cos, sin, heads,
                   kv_heads, head_dim, gu, act)
            if kt.shape[0]:
                key_lanes.transpose_blocks(kv, layer, blocks, kt)
        else:  # fp8 / q4 (kv_io.py): the rows in turn (a block's scales are shared)
            for r in range(rows):
                pos = positions[r]
                b, off, q = tables[r, pos // block], pos % block, qkv_out[r]
                _head_norms(q, qk_norm[layer], heads, kv_heads, head_dim, eps)
                _rope_row(q, pos, heads + kv_heads, cos, sin)
                qk = kvq[kv_io.QK]
                if qk.shape[0]:  # key channels equalised: queries times the scale, keys by it
                    for i in range(nq + nk):
                        q[i] *= qk[layer, i // head_dim, i % head_dim]
                kv_io.write(kvq, layer, pos, b, off, q[nq:nq + nk], q[nq + nk:nq + 2 * nk], kv_heads)
        paged_attention.attend(qkv_out, kv, kvq, layer, tables, positions, heads, kv_heads, head_dim, att, plan,
                               partial, slot, kt)
        _linear(table[layer, 1], weights, att, o_out, room, sums, spare)
        if adapted:
            _lora(lora, lora_table, layer, 1, lora_groups, lora_rows, att, o_out)
        _stage(ADD_NORM, h, o_out, ln2[layer], eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads,
               head_dim, gu, act)
        _linear(table[layer, 2], weights, x, gu, room, sums, spare)
        if adapted:
            _lora(lora, lora_table, layer, 2, lora_groups, lora_rows, x, gu)
        _stage(SILU, h, d_out, ln2[layer], eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads, head_dim,
               gu, act)
        _linear(table[layer, 3], weights, act, d_out, room, sums, spare)
        if adapted:
            _lora(lora, lora_table, layer, 3, lora_groups, lora_rows, act, d_out)
    for r in range(rows):
        for i in range(hidden):
            h[r, i] += d_out[r, i]
    # logits of the rows asked for only (a prompt chunk needs its last row's; the head is a
    # quarter of a small model's weights), in need's order, a row as often as it is named
    x = np.empty((need.shape[0], hidden), np.float32)
    for i in range(need.shape[0]):
        _rms_norm(h[need[i]], norm, eps, x[i])
    for r in range(features.shape[0]):  # every row's final-norm hidden state, where asked (EAGLE)
        _rms_norm(h[r], norm, eps, features[r])
    _linear(head, weights, x, logits, room, sums, spare)


# Rows of one sequence in a step from which its blocks are transposed once a layer for them all
# (paged_attention.py) rather than read as rows by each: a draft's 5 or 9 rows took as long
# either way, a prompt chunk's 64 rows 10% less attention transposed.
TRANSPOSE_FROM = 16


def aligned(shape) -> np.ndarray:
    """An empty float32 array whose data starts on a 64-byte line (numpy's own start 16 bytes into
    one: every 64-byte vector load of key_lanes' transposed copy then spanned two lines)."""
    n = int(np.prod(shape))
    buf = np.empty(n + 16, np.float32)
    at = (-buf.ctypes.data % 64) // 4
    return buf[at:at + n].reshape(shape)


def warm_up(layers, heads, kv_heads, head_dim, hidden, inter, norm, eps, cos, sin) -> None:
    """Compile (or load from the disk cache) step's parallel callees with step's argument types,
    before step itself: a cached function loaded before a parallel one it calls segfaults
    (numba/numba#8578; weight_blocks.compile_kernels does the same for the block kernels). attend
    reads a one-block fp8 cache of zeros (the cache tuple's types are the same for every format)."""
    kv = np.zeros((1, layers, 2, 16, kv_heads, head_dim), np.float32)
    q = np.zeros((1, (heads + 2 * kv_heads) * head_dim), np.float32)
    out, tables, positions = np.zeros((1, heads * head_dim), np.float32), np.zeros((1, 1), np.int64), \
        np.zeros(1, np.int64)
    fp8 = list(kv_io.cache_tuple(None, {}))
    fp8[kv_io.KIND] = kv_io.FP8
    fp8[kv_io.CODES] = np.zeros(kv.shape, np.uint8)
    fp8[kv_io.SCALE] = np.ones(kv.shape[:3] + kv.shape[4:5], np.float32)
    kt = np.zeros((1, kv_heads, head_dim, 16), np.float32)
    key_lanes.transpose_blocks(kv, 0, np.zeros(1, np.int64), kt)
    group = heads // kv_heads
    parts = (np.zeros((1, group, head_dim), np.float32), np.zeros((1, group), np.float32),
             np.ones((1, group), np.float32))
    # attend's parallel callee first
    paged_attention.merge(*parts, np.zeros(2, np.int64), positions, heads, out)
    plan = paged_attention.plan(positions, kv_heads, group, head_dim, True)
    paged_attention.attend(q, kv, tuple(fp8), 0, tables, positions, heads, kv_heads, head_dim, out, *plan,
                           np.zeros(1, np.int64), kt)
    h = np.zeros((1, hidden), np.float32)
    gu = np.zeros((1, 2 * inter), np.float32)
    _rows_parallel(SILU, h, h, norm, np.float32(eps), q, positions, tables, kv, 0, cos, sin, heads, kv_heads,
                   head_dim, gu, np.zeros((1, inter), np.float32))
    # a rank-1 span of one adapter on one row, with step's argument types (no_lora's list type)
    lora, table = _adapter_list(np.zeros(2 * hidden, np.float32)), np.zeros((1, layers, 4, 1, SPAN_FIELDS), np.int64)
    table[0, 0, 0, 0] = (0, hidden, 1, 0, hidden)
    _lora(lora, table, 0, 0, np.array([[0, 0, 1]], np.int64), np.zeros(1, np.int64), h, h.copy())


def no_lora():
    """step's LoRA arguments for a step without adapters: an empty typed list of the adapters' flat
    float32 arrays (its type is step's argument type: one compiled step whether rows have adapters
    or not), an empty table, no rows, no groups."""
    return (_no_adapters(), np.zeros((0, 1, 4, 1, SPAN_FIELDS), np.int64),
            np.zeros(0, np.int64), np.zeros((0, 3), np.int64))


# The typed lists step takes, made by compiled code that Numba's disk cache keeps: a typed.List built from
# Python compiles its constructor anew in every process (0.2 s of a start each, #41).
@njit(cache=True)
def _no_adapters():
    return typed.List.empty_list(types.float32[::1])


@njit(cache=True)
def _adapter_list(first):
    out = typed.List.empty_list(types.float32[::1])
    out.append(first)
    return out
