"""A decode step of a few sequences as one Numba call, for gguf weights over an fp32, fp8 or q4 KV cache.

At batch 1 on a small model, torch's per-op dispatch is a third of the step: Model.forward issues
~30 ops per layer (norms, RoPE, the cache write and read, attention, the activation, residuals)
around its four matmuls, each a few microseconds of bookkeeping for a few hundred floats of work.
This is the same layer loop (model.py is the reference it is tested against) with every op a
loop in one compiled function, the matmuls being cpu_kernels' block kernels: the step costs the
weights' bytes and little else. It runs the steps it can (model_runner decides): sequences of one
new token each, however many, over fp32 keys and values or fp8 / q4 (which fused_kv.py
writes and reads), and over fp32 KV also prompt chunks and drafts' k + 1 tokens, as rows at
consecutive positions; no window or chunked attention, no bias. Every other step takes
Model.forward. Each row runs the same operations whatever the other rows: the matmul kernels'
rows are independent, norms and attention go row by row, so a prompt token's K/V and logits are
those of the same token decoded alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from kvgen.engine import block_matmul, cpu_kernels, exp_kernels, fused_kv, key_lanes, plain_attention
from kvgen.engine.blocks import GROUP, BlockLinear


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
    step runs it): NORM x = norm(h) w; ADD_NORM h += add, then NORM; ROPE_WRITE rotates the row's
    query and key heads in its qkv output (x) and writes its K/V into the plain cache; SILU
    act = silu(gate) up of its gate_up output (gu)."""
    if stage == SILU:
        for r in range(lo, hi):
            exp_kernels.silu_mul(gu[r], act[r])
        return
    if stage == ROPE_WRITE:
        block, nq, nk = kv.shape[3], heads * head_dim, kv_heads * head_dim
        for r in range(lo, hi):
            pos = positions[r]
            b, off, q = tables[r, pos // block], pos % block, x[r]
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
    parts = min(rows, cpu_kernels.PARTS)
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


@njit(cache=True, nogil=True)
def _step(tokens, positions, tables, kv, kvq, blocks, slot, kt, embed, ln1, ln2, norm, qkv, o, gate_up, down, head,
          head_q4, cos, sin, eps, heads, kv_heads, head_dim, inter, need, logits, features):  # pragma: no cover
    rows, hidden = tokens.shape[0], embed.shape[1]
    h = np.empty((rows, hidden), np.float32)
    for r in range(rows):
        h[r] = embed[tokens[r]]
    x = np.empty((rows, hidden), np.float32)
    qkv_out = np.empty((rows, qkv[1].shape[1] * qkv[1].shape[-1]), np.float32)
    att = np.empty((rows, heads * head_dim), np.float32)
    o_out = np.empty((rows, o[1].shape[1] * o[1].shape[-1]), np.float32)
    gu = np.empty((rows, gate_up[1].shape[1] * gate_up[1].shape[-1]), np.float32)
    act = np.empty((rows, inter), np.float32)
    d_out = np.empty((rows, down[1].shape[1] * down[1].shape[-1]), np.float32)
    # the head's rows may outnumber the step's (a row named twice in need)
    room = cpu_kernels.scratch(max(rows, need.shape[0]), max(hidden, inter, heads * head_dim))
    block = kv.shape[3]
    nq, nk = heads * head_dim, kv_heads * head_dim
    plain = kvq[fused_kv.KIND] == fused_kv.PLAIN
    plan, partial = plain_attention.plan(positions, kv_heads, heads // kv_heads, head_dim, not plain)
    for layer in range(ln1.shape[0]):
        # the previous layer's MLP output is added here, with this layer's first norm
        _stage(ADD_NORM if layer else NORM, h, d_out, ln1[layer], eps, x, positions, tables, kv, layer, cos, sin,
               heads, kv_heads, head_dim, gu, act)
        block_matmul.q4_linear(x, qkv[0][layer], qkv[1][layer], qkv[2][layer], qkv_out, room)
        if plain:
            _stage(ROPE_WRITE, h, d_out, ln1[layer], eps, qkv_out, positions, tables, kv, layer, cos, sin, heads,
                   kv_heads, head_dim, gu, act)
            if kt.shape[0]:
                key_lanes.transpose_blocks(kv, layer, blocks, kt)
        else:  # fp8 / q4 (fused_kv.py): the rows in turn (a block's scales are shared)
            for r in range(rows):
                pos = positions[r]
                b, off, q = tables[r, pos // block], pos % block, qkv_out[r]
                _rope_row(q, pos, heads + kv_heads, cos, sin)
                qk = kvq[fused_kv.QK]
                if qk.shape[0]:  # key channels equalised: queries times the scale, keys by it
                    for i in range(nq + nk):
                        q[i] *= qk[layer, i // head_dim, i % head_dim]
                fused_kv.write(kvq, layer, pos, b, off, q[nq:nq + nk], q[nq + nk:nq + 2 * nk], kv_heads)
        plain_attention.attend(qkv_out, kv, kvq, layer, tables, positions, heads, kv_heads, head_dim, att, plan,
                               partial, slot, kt)
        block_matmul.q4_linear(att, o[0][layer], o[1][layer], o[2][layer], o_out, room)
        _stage(ADD_NORM, h, o_out, ln2[layer], eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads,
               head_dim, gu, act)
        block_matmul.q4_linear(x, gate_up[0][layer], gate_up[1][layer], gate_up[2][layer], gu, room)
        _stage(SILU, h, d_out, ln2[layer], eps, x, positions, tables, kv, layer, cos, sin, heads, kv_heads, head_dim,
               gu, act)
        block_matmul.q4_linear(act, down[0][layer], down[1][layer], down[2][layer], d_out, room)
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
    if head_q4:
        block_matmul.q4_linear(x, head[0], head[1], head[2], logits, room)
    else:
        block_matmul.q8_linear(x, head[0], head[1], logits, room)


# Rows of one sequence in a step from which its blocks are transposed once a layer for them all
# (plain_attention.py) rather than read as rows by each: a draft's 5 or 9 rows took as long
# either way, a prompt chunk's 64 rows 10% less attention transposed.
TRANSPOSE_FROM = 16


def _aligned(shape) -> np.ndarray:
    """An empty float32 array whose data starts on a 64-byte line (numpy's own start 16 bytes into
    one: every 64-byte vector load of key_lanes' transposed copy then spanned two lines)."""
    n = int(np.prod(shape))
    buf = np.empty(n + 16, np.float32)
    at = (-buf.ctypes.data % 64) // 4
    return buf[at:at + n].reshape(shape)


def _longest_run(rows) -> int:
    """The most consecutive rows with the same block table (one sequence's prompt chunk or draft)."""
    best = run = 1
    for a, b in zip(rows, rows[1:], strict=False):
        run = run + 1 if a[2] == b[2] else 1
        best = max(best, run)
    return best


def _stack(linears: list[BlockLinear]) -> tuple:
    """(qs, d, m) of every layer's linear, stacked along a new first axis. Each linear then reads
    its own slice of the stack (a view), so the blocks are held once, not twice."""
    stacks = tuple(np.stack([getattr(lin, a) for lin in linears]) for a in ("qs", "d", "m"))
    for i, lin in enumerate(linears):
        lin.qs, lin.d, lin.m = (a[i] for a in stacks)
    return stacks


def _supports_kv(fmt, head_dim: int) -> bool:
    """fp32 (nothing held exact, no key equalisation), or fp8 / q4 (fused_kv.py), with or
    without ExactTail and key equalisation, computing in fp32; whole tiles of keys a block and
    whole vectors a head (key_lanes.py)."""
    if fmt.block_size % key_lanes.TILE or head_dim % key_lanes.LANES:
        return False
    if fmt.name == "fp32":
        return not fmt.recent_slots and fmt.qk_scale is None
    return (fmt.name in ("fp8", "q4") and fmt.compute_dtype == torch.float32
            and getattr(fmt, "group_size", key_lanes.LANES) % key_lanes.LANES == 0  # (kv_lanes: a vector a scale)
            and (fmt.qk_scale is None or fmt.qk_scale.dtype == torch.float32))


class FusedDecode:
    """Model.forward for a decode step, as one compiled call.
    `supports(model, fmt)` says whether a model and KV format can run it."""

    @staticmethod
    def supports(model, fmt) -> bool:
        lins = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return (model.device.type == "cpu" and model.weight_dtype == "gguf"
                and all(isinstance(lin, BlockLinear) and lin.kind == "q4" and lin.b is None for lin in lins)
                and isinstance(model.lm_head, BlockLinear) and model.lm_head.b is None
                and _supports_kv(fmt, model.cfg.head_dim)
                and model.cfg.hidden_size % GROUP == 0 and model.cfg.intermediate_size % GROUP == 0)

    def __init__(self, model):
        cfg = model.cfg
        layers = model.layers
        self.cfg = cfg
        self.embed = model.embed.contiguous().numpy()
        self.ln1 = np.stack([layer.ln1.w.numpy() for layer in layers])
        self.ln2 = np.stack([layer.ln2.w.numpy() for layer in layers])
        self.norm = model.norm.w.numpy()
        self.qkv = _stack([layer.qkv for layer in layers])
        self.o = _stack([layer.o for layer in layers])
        self.gate_up = _stack([layer.gate_up for layer in layers])
        self.down = _stack([layer.down for layer in layers])
        head = model.lm_head
        # (qs, d, m); Q8 has no m (the kernel call that reads it is not taken)
        self.head = (head.qs, head.d, head.m if head.kind == "q4" else head.d)
        self.head_q4 = head.kind == "q4"
        self.vocab = head.out_features
        self.padded_vocab = head.d.shape[0] * head.d.shape[-1]
        self._plain = fused_kv.cache_tuple(None, {})
        self._no_features = np.empty((0, cfg.hidden_size), np.float32)  # what a step without features passes
        # nor blocks to transpose (their list, their places in it, their transposed copy)
        self._no_blocks = (np.empty(0, np.int64), np.empty(0, np.int64),
                           np.empty((0, cfg.num_kv_heads, cfg.head_dim, 1), np.float32))
        self.cos = np.ascontiguousarray(model.rot.real.numpy())
        self.sin = np.ascontiguousarray(model.rot.imag.numpy())

    def compile(self) -> None:
        """Compile the step (or load it from Numba's disk cache) with a one-block scratch cache,
        at start-up rather than on the first request's first decode step."""
        cfg = self.cfg
        kv = torch.zeros((1, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim))
        # The step's parallel callees first, with the step's argument types: a cached function
        # loaded before a parallel one it calls segfaults (numba/numba#8578; blocks.compile_kernels
        # does the same for the block kernels, which model loading ran already). attend reads
        # a one-block fp8 cache of zeros (the Cache tuple's types are the same for every format).
        q = np.zeros((1, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim), np.float32)
        out, tables, positions = np.zeros((1, cfg.num_heads * cfg.head_dim), np.float32), np.zeros((1, 1), np.int64), \
            np.zeros(1, np.int64)
        fp8 = list(self._plain)
        fp8[fused_kv.KIND] = fused_kv.FP8
        fp8[fused_kv.CODES] = np.zeros(kv.shape, np.uint8)
        fp8[fused_kv.SCALE] = np.ones(kv.shape[:3] + kv.shape[4:5], np.float32)
        kt = np.zeros((1, cfg.num_kv_heads, cfg.head_dim, 16), np.float32)
        key_lanes.transpose_blocks(kv.numpy(), 0, np.zeros(1, np.int64), kt)
        group = cfg.num_heads // cfg.num_kv_heads
        parts = (np.zeros((1, group, cfg.head_dim), np.float32), np.zeros((1, group), np.float32),
                 np.ones((1, group), np.float32))
        # attend's parallel callee first
        plain_attention.merge(*parts, np.zeros(2, np.int64), positions, cfg.num_heads, out)
        plan = plain_attention.plan(positions, cfg.num_kv_heads, group, cfg.head_dim, True)
        plain_attention.attend(q, kv.numpy(), tuple(fp8), 0, tables, positions, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, out, *plan, np.zeros(1, np.int64), kt)
        h = np.zeros((1, cfg.hidden_size), np.float32)
        gu = np.zeros((1, 2 * cfg.intermediate_size), np.float32)
        _rows_parallel(SILU, h, h, self.norm, np.float32(cfg.rms_norm_eps), q, positions, tables, kv.numpy(), 0,
                       self.cos, self.sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, gu,
                       np.zeros((1, cfg.intermediate_size), np.float32))
        self([(0, 0, [0]), (0, 1, [0])], {"kv": kv})
        self([(0, 0, [0])], {"kv": kv})

    def __call__(self, rows: list[tuple[int, int, list[int]]], store: dict, fmt=None,
                 need: list[int] | None = None, features: np.ndarray | None = None) -> torch.Tensor:
        """rows: (token, position, block table) per new token: one per decoding sequence, or a
        run of consecutive positions of one sequence (a prompt chunk, a draft), each of which
        attends up to its own position. Writes every row's K/V into the store, of format fmt
        (None: plain fp32); returns the logits [len(need), vocab] of rows `need` (default all).
        features: where given, [len(rows), hidden] float32 that gets every row's final-norm
        hidden state (Model.forward's features)."""
        cfg = self.cfg
        if fmt is None or fmt.name == "fp32":
            kv, kvq = store["kv"].numpy(), self._plain
        else:
            bs = fmt.block_size
            if fmt.recent_slots:  # ExactTail's slots and flushes on the host, as for the GPU kernels
                fmt.prepare_decode(store, [blocks[pos // bs] for _, pos, blocks in rows],
                                   [pos % bs for _, pos, _ in rows], [pos for _, pos, _ in rows])
            kvq = fused_kv.cache_tuple(fmt, store)
            kv = np.empty((0, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim), np.float32)
        width = max(len(blocks) for _, _, blocks in rows)
        tables = np.zeros((len(rows), width), np.int64)
        for i, (_, _, blocks) in enumerate(rows):
            tables[i, :len(blocks)] = blocks
        tokens = np.array([t for t, _, _ in rows], np.int64)
        positions = np.array([p for _, p, _ in rows], np.int64)
        need = np.arange(len(rows), dtype=np.int64) if need is None else np.asarray(need, np.int64)
        if need.size and not (0 <= need.min() and need.max() < len(rows)):
            raise IndexError(f"logits asked for rows {need.tolist()} of {len(rows)}")
        logits = np.empty((len(need), self.padded_vocab), np.float32)
        # a prompt chunk's rows read their blocks again and again: transposed once a layer for all
        # of them (key_lanes.py); a decode row reads each of its blocks once
        blocks, slot, kt = self._no_blocks
        if kvq is self._plain and _longest_run(rows) >= TRANSPOSE_FROM:
            blocks, slot = plain_attention.blocks_read(tables, positions, kv.shape[3], kv.shape[0])
            kt = _aligned((len(blocks), cfg.num_kv_heads, cfg.head_dim, kv.shape[3]))
        _step(tokens, positions, tables, kv, kvq, blocks, slot, kt, self.embed, self.ln1, self.ln2,
              self.norm, self.qkv, self.o, self.gate_up, self.down, self.head, self.head_q4, self.cos, self.sin,
              np.float32(cfg.rms_norm_eps), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
              need, logits, self._no_features if features is None else features)
        return torch.from_numpy(logits[:, :self.vocab])
