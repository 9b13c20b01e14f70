"""A decode step of a few sequences as one compiled call, for gguf weights (any kinds of blocks, mixed
as the file mixes them: per layer, per part of a fused weight, the head) over an fp32, fp8 or q4 KV cache.

At batch 1 on a small model, torch's per-op dispatch is a third of the step: Model.forward issues
~30 ops per layer (norms, RoPE, the cache write and read, attention, the activation, residuals)
around its four matmuls, each a few microseconds of bookkeeping for a few hundred floats of work.
kvgen/cpu/decode_step.py is the same layer loop (model.py is the reference it is tested against)
with every op a loop in one compiled function. This module is the engine's side of it: whether a
model and KV format can take it (model_runner asks), the model's weights gathered once into the
arrays the step reads, and each step's rows, block tables and KV store turned into its arguments.
It runs sequences of one new token each, however many, over fp32 keys and values or fp8 / q4, and
over fp32 KV also prompt chunks and drafts' k + 1 tokens, as rows at consecutive positions; no
window or chunked attention, no bias but q|k|v's. Rows may each have a LoRA adapter: its low-rank
deltas are added inside the step (decode_step._lora), the base weights read once for all rows.
Every other step takes Model.forward.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from numba import typed

from kvgen.cpu import decode_step, key_lanes, kv_io, paged_attention
from kvgen.cpu.vector_matmul import TILE
from kvgen.cpu.weight_arena import ALIGN, WeightArena
from kvgen.cpu.weight_blocks import GROUP, BlockLinear
from kvgen.engine import lora


def _longest_run(rows) -> int:
    """The most consecutive rows with the same block table (one sequence's prompt chunk or draft)."""
    best = run = 1
    for a, b in zip(rows, rows[1:], strict=False):
        run = run + 1 if a[2] == b[2] else 1
        best = max(best, run)
    return best


FAMILIES = ("qkv", "o", "gate_up", "down")  # a layer's linears, in the step's table order
# The families whose layers the step computes (model.py's Llama loop; qwen2's q|k|v biases, qwen3's q/k head
# norms; phi3's q|k|v and gate|up are one matrix each in the file, as the step's linears are for every
# family): another family's model runs Model.forward, for the reason NOT_FUSED gives
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
NOT_FUSED = {
    "gemma2": "Gemma 2's layers are not the step's: norms after attention and after the MLP, (1 + w) norm weights, "
              "scaled embeddings, GELU-tanh, windowed layers between global ones, attention scores and logits "
              "soft-capped",
    "gemma3": "Gemma 3's layers are not the step's: norms after attention and after the MLP, (1 + w) norm weights, "
              "scaled embeddings, GELU-tanh, windowed layers with their own RoPE base between global ones, a final "
              "logit cap",
}


def _parts(lin) -> list:
    """A linear's matrices: a PartsLinear's parts (model.py: q|k|v whose parts differ in kind), or itself."""
    return list(getattr(lin, "parts", [lin]))


class _Weights:
    """Every matrix part of the model's linears in one flat byte buffer (q4 and packed codes, int8 codes,
    scale bytes: vector_matmul's layouts) that the step slices by its table's offsets
    (decode_step._linear), so each part keeps its own kind and layout, layer by layer and within a
    fused weight. A model loaded from a GGUF file has written every tile into its file's WeightArena:
    that arena is the buffer, and nothing is copied. Otherwise the parts are copied into an arena of
    their own and each BlockLinear pointed at its slice (a view), so the weights are held once, not
    twice: a linear is copied in and its old arrays dropped before the next, so the load's peak grows
    by one matrix, not the model."""

    def __init__(self, linears: list):
        parts = [p for lin in linears for p in _parts(lin)]
        # the parts not in an arena (made otherwise than from the file's blocks: an F16 matrix's Q8_0) are
        # copied into the arena the others share, which the file's bound left room for; else all into a new one
        held = {id(p): p.arena for p in parts
                if p.arena is not None and all(p.arena.offset(a) is not None for a in (p.qs, p.scales))}
        outside = [p for p in parts if id(p) not in held]
        arenas = {id(a): a for a in held.values()}
        need = sum(a.nbytes + ALIGN for p in outside for a in (p.qs, p.scales))
        self.arena = next(iter(arenas.values())) if len(arenas) == 1 else None
        if self.arena is None or self.arena.room < need:
            self.arena, outside = WeightArena(sum(a.nbytes + ALIGN for p in parts for a in (p.qs, p.scales))), parts
        self._outside = {id(p) for p in outside}  # (empty: nothing copied, no old arrays to give back)

    def _put(self, part) -> tuple[int, int]:
        """(offset of part's codes, of its scales) in the arena, copying them in first where they are not."""
        if id(part) in self._outside:
            for name in ("qs", "scales"):
                a = getattr(part, name)
                view = self.arena.empty(a.shape, a.dtype)
                view[...] = a
                setattr(part, name, view)
            part.arena = self.arena
        return self.arena.offset(part.qs), self.arena.offset(part.scales)

    def rows(self, lin) -> np.ndarray:
        """lin's parts as table rows [parts, FIELDS] (the parts copied into the arena where they are not
        in it); the parts' outputs side by side, in their order."""
        parts = _parts(lin)
        table = np.zeros((len(parts), decode_step.FIELDS), np.int64)
        col = 0
        for row, part in zip(table, parts, strict=True):
            row[decode_step.KIND] = decode_step.KINDS[part.kind]
            row[decode_step.CODES], row[decode_step.SCALES] = self._put(part)
            row[decode_step.LAYOUT] = part.layout
            row[decode_step.TILES], row[decode_step.GROUPS] = part.qs.shape[:2]
            row[decode_step.COL], row[decode_step.WIDTH] = col, part.out_features
            col += part.out_features
        return table

    @property
    def copied(self) -> bool:
        """Whether any part was copied in (its old arrays then freed)."""
        return bool(self._outside)

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q4 and packed codes, int8 codes, scales): the step's three buffers, here one."""
        buf = self.arena.buf
        return buf, buf.view(np.int8), buf


def _release_freed() -> None:
    """Give the pages of the blocks' old arrays back to the system: glibc keeps freed heap memory for
    reuse, so the copies left RSS a file's blocks higher (119 MiB on the SmolLM2 Q4_K_M, and the
    stacks before them the same); malloc_trim returns it (to below the model's RSS before)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _width(lin) -> int:
    """The columns a linear's output takes in the step: a one-part weight's whole tiles (the kernel
    writes them in place), a weight of parts the sum of theirs (each copied from the spare buffer)."""
    parts = _parts(lin)
    return parts[0].qs.shape[0] * TILE if len(parts) == 1 else sum(p.out_features for p in parts)


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


def _why_not_linear(lin, name: str, bias: bool = False) -> str | None:
    """bias: the step adds this linear's bias (qkv's: Qwen2's q/k/v biases)."""
    for part in _parts(lin):
        if not isinstance(part, BlockLinear):
            return f"{name} is not in GGUF blocks ({type(part).__name__}, {getattr(part, 'dtype', '?')})"
        if part.kind not in decode_step.KINDS:
            return f"{name} is in blocks of kind {part.kind}, which the step has no kernel for"
        if part.b is not None and not bias:
            return f"{name} has a bias"
    return None if bias or getattr(lin, "b", None) is None else f"{name} has a bias"


class FusedDecode:
    """Model.forward for a decode step, as one compiled call.
    `supports(model, fmt)` says whether a model and KV format can run it, `why_not` why not."""

    @staticmethod
    def why_not(model, fmt) -> str | None:
        """The first reason the model and KV format cannot take the step, in words; None if they can."""
        cfg = model.cfg
        if model.device.type != "cpu":
            return f"the model is on {model.device.type}: the step runs on the CPU"
        if model.weight_dtype != "gguf":
            return f"weights {model.weight_dtype}: the step multiplies GGUF blocks only (WEIGHT_DTYPE gguf or auto)"
        if cfg.architecture not in ARCHITECTURES:
            what = NOT_FUSED.get(cfg.architecture, "not a family whose layers the step computes")
            return f"architecture {cfg.architecture}: {what} (the step computes {', '.join(ARCHITECTURES)} layers)"
        for i, layer in enumerate(model.layers):
            for f in FAMILIES:
                if (why := _why_not_linear(getattr(layer, f), f"layer {i}'s {f}", bias=f == "qkv")) is not None:
                    return why
        if (why := _why_not_linear(model.lm_head, "the lm head")) is not None:
            return why
        if not _supports_kv(fmt, cfg.head_dim):
            return (f"KV format {fmt.name} (block size {fmt.block_size}, head dim {cfg.head_dim}): the step takes fp32 "
                    f"or fp8 / q4 computing in fp32, blocks of whole {key_lanes.TILE}-key tiles")
        if cfg.hidden_size % GROUP or cfg.intermediate_size % GROUP:
            return (f"hidden size {cfg.hidden_size}, intermediate size {cfg.intermediate_size}: "
                    f"the step takes multiples of {GROUP}")
        return None

    @staticmethod
    def supports(model, fmt) -> bool:
        return FusedDecode.why_not(model, fmt) is None

    def __init__(self, model):
        cfg = model.cfg
        layers = model.layers
        self.cfg = cfg
        self.embed = model.embed  # a TokenEmbedding: each step's rows looked up (dequantized) in __call__
        self.ln1 = np.stack([layer.ln1.w.numpy() for layer in layers])
        self.ln2 = np.stack([layer.ln2.w.numpy() for layer in layers])
        self.norm = model.norm.w.numpy()
        linears = [getattr(layer, f) for layer in layers for f in FAMILIES]
        # q|k|v biases (Qwen2), added to the qkv output before RoPE as Model.forward adds them; [layers, 0]: none
        biases = [layer.qkv.b for layer in layers]
        self.qkv_bias = (np.stack([np.zeros(layer.qkv.out_features, np.float32) if b is None else b.float().numpy()
                                   for layer, b in zip(layers, biases, strict=True)])
                         if any(b is not None for b in biases) else np.zeros((len(layers), 0), np.float32))
        # q and k head norm weights (Qwen3), normalising each head before RoPE as Model.forward does; [layers, 0]: none
        self.qk_norm = (np.stack([np.concatenate((layer.q_norm.w.float().numpy(), layer.k_norm.w.float().numpy()))
                                  for layer in layers])
                        if layers[0].q_norm is not None else np.zeros((len(layers), 0), np.float32))
        head = model.lm_head
        weights = _Weights([*linears, head])
        most = max(len(_parts(lin)) for lin in [*linears, head])
        self.table = np.zeros((len(layers), len(FAMILIES), most, decode_step.FIELDS), np.int64)
        self.table[..., decode_step.KIND] = decode_step.NONE
        widths = [max(_width(getattr(layer, f)) for layer in layers) for f in FAMILIES]
        spare = 0  # the widest part not written in place (decode_step._linear)
        for i, layer in enumerate(layers):
            for j, f in enumerate(FAMILIES):
                rows = weights.rows(getattr(layer, f))
                self.table[i, j, :len(rows)] = rows
                if len(rows) > 1 or rows[0, decode_step.TILES] * TILE != widths[j]:
                    spare = max(spare, int(rows[:, decode_step.TILES].max()) * TILE)
        self.head = weights.rows(head)
        self.padded_vocab = _width(head)
        if len(self.head) > 1:
            spare = max(spare, int(self.head[:, decode_step.TILES].max()) * TILE)
        self.widths = np.array([*widths, spare], np.int64)
        self.weights = weights.arrays
        if weights.copied:
            _release_freed()
        self.vocab = head.out_features
        self._plain = kv_io.cache_tuple(None, {})
        self._no_features = np.empty((0, cfg.hidden_size), np.float32)  # what a step without features passes
        # nor blocks to transpose (their list, their places in it, their transposed copy)
        self._no_blocks = (np.empty(0, np.int64), np.empty(0, np.int64),
                           np.empty((0, cfg.num_kv_heads, cfg.head_dim, 1), np.float32))
        self.cos = np.ascontiguousarray(model.rot.real.numpy())
        self.sin = np.ascontiguousarray(model.rot.imag.numpy())
        self._no_lora = decode_step.no_lora()
        self._last_lora = ((), self._no_lora)  # _lora_args' last (rows' adapters, step arguments)

    def compile(self) -> None:
        """Compile the step (or load it from Numba's disk cache) with a one-block scratch cache,
        at start-up rather than on the first request's first decode step."""
        cfg = self.cfg
        kv = torch.zeros((1, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim))
        decode_step.warm_up(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                            cfg.intermediate_size, self.norm, cfg.rms_norm_eps, self.cos, self.sin)
        # one call: a step's argument types are the same whatever its rows (one compiled step), so a second
        # (it was a 1-row step after this one) compiled nothing and cost a step over the whole model (1.2 s of
        # the 1.7B's start on a loaded 2-core machine)
        self([(0, 0, [0]), (0, 1, [0])], {"kv": kv})

    def _lora_args(self, adapters: list | None) -> tuple:
        """step's LoRA arguments for each row's adapter (lora.Adapter; None: the base model): the
        step's adapters' flat arrays and spans (lora.fused_arrays), and their rows, an adapter's
        listed together in the order adapters first appear (its A and B then read once a step). The last
        step's are kept: decode steps mostly repeat their rows' adapters (held here, an adapter unloaded
        meanwhile is not mistaken for another: Adapters compare by identity)."""
        key = tuple(adapters or ())
        if key == self._last_lora[0]:
            return self._last_lora[1]
        self._last_lora = (key, self._make_lora_args(key))
        return self._last_lora[1]

    def _make_lora_args(self, adapters: tuple) -> tuple:
        by: dict = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                by.setdefault(adapter, []).append(row)
        if not by:
            return self._no_lora
        exports = [lora.fused_arrays(adapter) for adapter in by]
        most = max(spans.shape[2] for _, spans in exports)
        table = np.zeros((len(exports), *self.table.shape[:2], most, decode_step.SPAN_FIELDS), np.int64)
        for i, (_, spans) in enumerate(exports):
            table[i, :, :, :spans.shape[2]] = spans
        rows = np.array([row for group in by.values() for row in group], np.int64)
        sizes = np.array([len(group) for group in by.values()], np.int64)
        ends = np.cumsum(sizes)
        groups = np.ascontiguousarray(np.stack([np.arange(len(by)), ends - sizes, ends], 1), np.int64)
        return typed.List([data for data, _ in exports]), table, rows, groups

    def __call__(self, rows: list[tuple[int, int, list[int]]], store: dict, fmt=None,
                 need: list[int] | None = None, features: np.ndarray | None = None,
                 adapters: list | None = None) -> torch.Tensor:
        """rows: (token, position, block table) per new token: one per decoding sequence, or a
        run of consecutive positions of one sequence (a prompt chunk, a draft), each of which
        attends up to its own position. Writes every row's K/V into the store, of format fmt
        (None: plain fp32); returns the logits [len(need), vocab] of rows `need` (default all).
        features: where given, [len(rows), hidden] float32 that gets every row's final-norm
        hidden state (Model.forward's features). adapters: each row's LoRA adapter (lora.Adapter,
        None: the base model), its delta added to the row's every linear (None: no row has one)."""
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
        decode_step.step(self.embed.rows(tokens), positions, tables, kv, kvq, blocks, slot, kt, self.ln1, self.ln2,
              self.norm, self.weights, self.table, self.head, self.qkv_bias, self.qk_norm, self.widths, self.cos,
              self.sin, np.float32(cfg.rms_norm_eps), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
              cfg.intermediate_size, need, logits, self._no_features if features is None else features,
              *self._lora_args(adapters))
        return torch.from_numpy(logits[:, :self.vocab])
