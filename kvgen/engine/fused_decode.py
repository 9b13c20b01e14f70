"""A decode step of a few sequences as one compiled call, for gguf weights (each family of matrices in
one kind over the layers: 4-bit blocks or 8-bit codes) over an fp32, fp8 or q4 KV cache.

At batch 1 on a small model, torch's per-op dispatch is a third of the step: Model.forward issues
~30 ops per layer (norms, RoPE, the cache write and read, attention, the activation, residuals)
around its four matmuls, each a few microseconds of bookkeeping for a few hundred floats of work.
kvgen/cpu/decode_step.py is the same layer loop (model.py is the reference it is tested against)
with every op a loop in one compiled function. This module is the engine's side of it: whether a
model and KV format can take it (model_runner asks), the model's weights gathered once into the
arrays the step reads, and each step's rows, block tables and KV store turned into its arguments.
It runs sequences of one new token each, however many, over fp32 keys and values or fp8 / q4, and
over fp32 KV also prompt chunks and drafts' k + 1 tokens, as rows at consecutive positions; no
window or chunked attention, no bias. Every other step takes Model.forward.
"""

from __future__ import annotations

import numpy as np
import torch

from kvgen.cpu import decode_step, key_lanes, kv_io, paged_attention
from kvgen.cpu.weight_blocks import GROUP, BlockLinear


def _longest_run(rows) -> int:
    """The most consecutive rows with the same block table (one sequence's prompt chunk or draft)."""
    best = run = 1
    for a, b in zip(rows, rows[1:], strict=False):
        run = run + 1 if a[2] == b[2] else 1
        best = max(best, run)
    return best


def _stack(linears: list[BlockLinear]) -> tuple:
    """(codes, d, m, q4) of every layer's linear, stacked along a new first axis (m is d again for
    8-bit codes, which have none: the step's call that would read it is not taken). Each linear
    then reads its own slice of the stack (a view), so the blocks are held once, not twice."""
    q4 = linears[0].kind == "q4"
    names = ("qs", "d", "m") if q4 else ("qs", "d")
    stacks = tuple(np.stack([getattr(lin, a) for lin in linears]) for a in names)
    for i, lin in enumerate(linears):
        for a, stack in zip(names, stacks, strict=True):
            setattr(lin, a, stack[i])
    return stacks[0], stacks[1], stacks[-1], q4


def _supports_kv(fmt, head_dim: int) -> bool:
    """fp32 (nothing held exact, no key equalisation), or fp8 / q4 (kv_io.py), with or
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
        families = [[getattr(layer, f) for layer in model.layers] for f in ("qkv", "o", "gate_up", "down")]
        return (model.device.type == "cpu" and model.weight_dtype == "gguf"
                and all(isinstance(lin, BlockLinear) and lin.b is None for fam in families for lin in fam)
                # each family's layers in one kind the step's calls take (a stack of one dtype)
                and all(len({lin.kind for lin in fam}) == 1 and fam[0].kind in ("q4", "q8") for fam in families)
                and isinstance(model.lm_head, BlockLinear) and model.lm_head.b is None
                and model.lm_head.kind in ("q4", "q8")  # the step's head call takes these two
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
        self._plain = kv_io.cache_tuple(None, {})
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
        decode_step.warm_up(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                            cfg.intermediate_size, self.norm, cfg.rms_norm_eps, self.cos, self.sin)
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
            kvq = kv_io.cache_tuple(fmt, store)
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
        if kvq is self._plain and _longest_run(rows) >= decode_step.TRANSPOSE_FROM:
            blocks, slot = paged_attention.blocks_read(tables, positions, kv.shape[3], kv.shape[0])
            kt = decode_step.aligned((len(blocks), cfg.num_kv_heads, cfg.head_dim, kv.shape[3]))
        decode_step.step(tokens, positions, tables, kv, kvq, blocks, slot, kt, self.embed, self.ln1, self.ln2,
              self.norm, self.qkv, self.o, self.gate_up, self.down, self.head, self.head_q4, self.cos, self.sin,
              np.float32(cfg.rms_norm_eps), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
              need, logits, self._no_features if features is None else features)
        return torch.from_numpy(logits[:, :self.vocab])
