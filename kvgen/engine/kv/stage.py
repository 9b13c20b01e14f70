"""What a quantized KV format keeps exact: each sequence's newest block and its first token.

Newest block (KIVI's full-precision residual): a block is quantized once it is full and a
later forward pass writes elsewhere (its sequence moved on), so its key scales come from all of
its tokens and the tokens every query attends to most (its own block's) are never rounded. A
slot is taken by a write to layer 0 that leaves a block part-filled, and given back when a later
forward pass quantizes the block or the pool frees it; a block written whole in one go (a long
prompt's inner blocks) is quantized at once; with no slot free, writes go straight to the
quantized store.

First token (the attention sink): most heads put much of their attention on position 0, so its
rounding error reaches every query: on SmolLM2, q3 loses 18% perplexity over 1,024 tokens with
it quantized and 7% with it exact (KVQuant keeps it in fp16 too). It stays exact for as long as
its block lives; writes say which rows are position 0.

bench/results/kv.md measures both, on and off.
"""

from __future__ import annotations

import torch


class _Slots:
    """A side tensor's slots lent to blocks: held (block -> slot, asked without a device sync)
    and `of` [num_blocks] (the same on the device, -1 for none)."""

    def __init__(self, n: int, num_blocks: int, device):
        self.of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self.held: dict[int, int] = {}
        self.free = list(range(n))

    def acquire(self, block: int) -> int | None:
        if block in self.held:
            return self.held[block]
        if not self.free:
            return None
        slot = self.held[block] = self.free.pop()
        self.of[block] = slot
        return slot

    def release(self, blocks) -> None:
        for b in blocks:
            slot = self.held.pop(b, None)
            if slot is not None:
                self.of[b] = -1
                self.free.append(slot)


def _span(blocks: list[int], offsets: list[int]) -> dict[int, list[int]]:
    """block -> [first offset, last offset] written."""
    span: dict[int, list[int]] = {}
    for b, o in zip(blocks, offsets, strict=True):
        lo_hi = span.setdefault(b, [o, o])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], o), max(lo_hi[1], o)
    return span


class ExactTail:
    """A quantized format (`inner`, formats.py) with each sequence's newest block and first token
    held exact beside its store; it presents the format interface (allocate / write / read /
    release / take_block / put_block / sizes) and reaches the quantized store only through the
    inner format's own write and read.

    Its tensors are its own, never in the store, so the store stays exactly what the inner
    format (and a GPU kernel of it) reads: rows [slots, L, 2, BS, KVH, HD] (newest blocks, lent
    by `recent`) and sink [4 * slots, L, 2, KVH, HD] (first tokens, lent by `first`), in the
    compute dtype; pending: full blocks to quantize at the next forward pass that writes
    elsewhere. One store at a time: `allocate` starts a fresh one (and fresh slots).

    The GPU decode kernels (kvgen.gpu.ops) serve it too: `prepare_decode` does on the host what
    `write` does around a forward pass (slots, flushes), then the kernels write and read the
    tensors of `exact_tensors` through the device slot maps as `write` / `read` do.
    """

    def __init__(self, inner, slots: int):
        self.inner = inner
        self.recent_slots = slots
        self._store: dict | None = None

    # The inner format's parameters read through (name, num_layers, block_size, head_dim,
    # compute_dtype, equalize_keys, group_size, codebook, calibrate...): the model, the GPU
    # kernels and calibration read them on whatever make_format returns.
    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def qk_scale(self) -> torch.Tensor | None:
        return self.inner.qk_scale

    @qk_scale.setter
    def qk_scale(self, value: torch.Tensor | None) -> None:
        self.inner.qk_scale = value

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        fmt, slots = self.inner, self.recent_slots
        kvh, hd, dt = fmt.num_kv_heads, fmt.head_dim, fmt.compute_dtype
        self.rows = torch.zeros(slots, fmt.num_layers, 2, fmt.block_size, kvh, hd, dtype=dt, device=device)
        self.recent = _Slots(slots, num_blocks, device)
        self.pending: set[int] = set()
        self.sink = torch.zeros(4 * slots, fmt.num_layers, 2, kvh, hd, dtype=dt, device=device)
        self.first = _Slots(4 * slots, num_blocks, device)
        self._store = fmt.allocate(num_blocks, device)
        return self._store

    def stage_bytes(self) -> int:
        """Memory of the exact rows and first tokens (outside the blocks)."""
        fmt = self.inner
        return self.recent_slots * fmt.num_layers * 2 * (fmt.block_size + 4) * fmt.num_kv_heads * fmt.head_dim \
            * torch.empty(0, dtype=fmt.compute_dtype).element_size()

    def bytes_per_block(self) -> int:
        return self.inner.bytes_per_block()

    def bytes_per_token_per_layer(self) -> float:
        return self.inner.bytes_per_token_per_layer()

    @property
    def exact_blocks_used(self) -> int:
        """Newest blocks held exact now."""
        return len(self.recent.held) if self._store is not None else 0

    @property
    def exact_blocks_total(self) -> int:
        return self.recent_slots

    def _check(self, store: dict) -> None:
        if store is not self._store:
            raise ValueError("ExactTail serves the store of its last allocate() only")

    def write(self, store: dict, layer: int, blocks: torch.Tensor, offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """As KVFormat.write; rows of blocks holding a slot go to the exact rows, the rest to
        the quantized store, and rows at position 0 are kept exact too."""
        self._check(store)
        fmt = self.inner
        if positions is not None and int(positions.min()) == 0:
            for i in (positions == 0).nonzero()[:, 0].tolist():
                slot = self.first.acquire(int(blocks[i]))
                if slot is not None:
                    self.sink[slot, layer, 0], self.sink[slot, layer, 1] = k[i], v[i]
        bl, of = blocks.tolist(), offsets.tolist()
        span = _span(bl, of)
        if layer == 0:  # a forward pass starts: slots are given back and taken for all layers
            self._start_pass(store, span)
        slots = [self.recent.held.get(b, -1) for b in bl]
        staged = [i for i, sl in enumerate(slots) if sl >= 0]
        if len(staged) < len(bl):
            rest = torch.tensor([i for i, sl in enumerate(slots) if sl < 0], device=k.device)
            fmt.write(store, layer, blocks[rest], offsets[rest], k[rest], v[rest])
        if not staged:
            return
        dev = self.rows.device
        idx = torch.tensor(staged, device=k.device)
        sl = torch.tensor([slots[i] for i in staged], device=dev)
        off = torch.tensor([of[i] for i in staged], device=dev)
        rows = self.rows[:, layer]  # [S, 2, BS, KVH, HD]
        rows[:, 0].index_put_((sl, off), k[idx].to(dev, rows.dtype))
        rows[:, 1].index_put_((sl, off), v[idx].to(dev, rows.dtype))
        if layer == fmt.num_layers - 1:
            self._end_pass(span)

    def prepare_decode(self, store: dict, blocks: list[int], offsets: list[int], positions: list[int]) -> None:
        """What write does on the host for a whole forward pass, for a decode step the GPU
        kernels run (ops.kv_append / flash_decode read the slot maps on the device, inside a CUDA
        graph): each row writes one token at (blocks[i], offsets[i]), position positions[i],
        all known on the host. Flushes the full blocks this step does not write, takes the
        slots the rows write into (and a first-token slot for position 0), and marks the
        blocks the step fills as pending. Call before the step; reads no device value."""
        self._check(store)
        for b, p in zip(blocks, positions, strict=True):
            if p == 0:
                self.first.acquire(b)
        span = _span(blocks, offsets)
        self._start_pass(store, span)
        self._end_pass(span)  # host bookkeeping only: the step's writes come after, as in write

    def exact_tensors(self, store: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, recent slot map, sink, first-token slot map): what the GPU kernels read
        besides the store. Fixed addresses for the life of the store (maps change in place)."""
        self._check(store)
        return self.rows, self.recent.of, self.sink, self.first.of

    def _start_pass(self, store: dict, span: dict[int, list[int]]) -> None:
        """A forward pass writing `span` (block -> [first, last offset]) starts."""
        # A full block stays exact until a write goes elsewhere (its sequence's next block):
        # the query that filled it, like every other, saw its own block exact.
        done = [b for b in self.pending if b not in span]
        if done:
            self._flush(store, done)
        last = self.inner.block_size - 1
        for b, (lo, hi) in span.items():
            if b in self.recent.held or (lo == 0 and hi == last):  # a block written whole is old at once
                continue
            if self.recent.acquire(b) is not None and lo > 0:
                self._stage_existing(store, b)  # e.g. a block cut by truncate

    def _end_pass(self, span: dict[int, list[int]]) -> None:
        """The pass wrote `span`: its staged blocks that are now full wait for the next pass."""
        last = self.inner.block_size - 1
        self.pending.update(b for b, (_, hi) in span.items() if hi == last and b in self.recent.held)

    def _flush(self, store: dict, blocks: list[int]) -> None:
        """Quantize full staged blocks into the store, every layer (all their tokens are known),
        and give their slots back."""
        fmt = self.inner
        rows = self.rows[torch.tensor([self.recent.held[b] for b in blocks], device=self.rows.device)]
        ids = torch.tensor(blocks, device=self.recent.of.device)
        fb = ids.repeat_interleave(fmt.block_size)
        fo = torch.arange(fmt.block_size, device=ids.device).repeat(len(blocks))
        shape = (-1, fmt.num_kv_heads, fmt.head_dim)
        for layer in range(fmt.num_layers):
            x = rows[:, layer]  # [F, 2, BS, KVH, HD]
            fmt.write(store, layer, fb, fo, x[:, 0].reshape(shape), x[:, 1].reshape(shape))
        self.release_rows(blocks)

    def _stage_existing(self, store: dict, block: int) -> None:
        ids = torch.tensor([block], device=self.recent.of.device)
        slot = self.recent.held[block]
        for layer in range(self.inner.num_layers):
            k, v = self.inner.read(store, layer, ids)
            self.rows[slot, layer, 0], self.rows[slot, layer, 1] = k[0], v[0]

    def read(self, store: dict, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVFormat.read: the quantized store's K, V with what is held exact in their place."""
        self._check(store)
        k, v = self.inner.read(store, layer, block_ids)
        if self.recent.held:
            slot = self.recent.of.index_select(0, block_ids)
            hit = (slot >= 0).nonzero()[:, 0]
            if hit.numel():
                x = self.rows[slot[hit], layer].to(k.dtype)  # [h, 2, BS, KVH, HD]
                k, v = k.index_copy(0, hit, x[:, 0]), v.index_copy(0, hit, x[:, 1])
        if self.first.held:
            slot = self.first.of.index_select(0, block_ids)
            hit = (slot >= 0).nonzero()[:, 0]
            if hit.numel():
                x = self.sink[slot[hit], layer].to(k.dtype)  # [h, 2, KVH, HD]
                k, v = k.clone(), v.clone()
                k[hit, 0], v[hit, 0] = x[:, 0], x[:, 1]
        return k, v

    def release(self, store: dict, blocks: list[int]) -> None:
        """The pool freed the blocks: their slots (rows and first token) are free again."""
        self._check(store)
        self.inner.release(store, blocks)
        self.first.release(blocks)
        self.release_rows(blocks)

    def release_rows(self, blocks) -> None:
        """The blocks are quantized: their row slots are free again (a first token stays)."""
        self.recent.release(blocks)
        self.pending.difference_update(blocks)

    def take_block(self, store: dict, block: int, fill: int) -> dict[str, torch.Tensor]:
        """The inner format's block, plus copies of what is held exact for it ("stage": rows
        past `fill` zeroed; "sink")."""
        self._check(store)
        out = self.inner.take_block(store, block, fill)
        if block in self.recent.held:
            rows = self.rows[self.recent.held[block]].clone()
            rows[:, :, fill:] = 0
            out["stage"] = rows
        if block in self.first.held:
            out["sink"] = self.sink[self.first.held[block]].clone()
        return out

    def put_block(self, store: dict, block: int, data: dict[str, torch.Tensor], fill: int) -> None:
        """Inverse of take_block into a freshly allocated block; with no slot free, the exact
        rows are quantized into the block."""
        self._check(store)
        self.inner.put_block(store, block, {n: t for n, t in data.items() if n not in ("stage", "sink")}, fill)
        if "sink" in data and self.first.acquire(block) is not None:
            self.sink[self.first.held[block]] = data["sink"].to(self.sink.device, self.sink.dtype)
        if "stage" not in data:
            return
        slot = self.recent.acquire(block)
        if slot is not None:
            self.rows[slot] = data["stage"].to(self.rows.device, self.rows.dtype)
            if fill == self.inner.block_size:  # full: quantized at the next write, as before it left
                self.pending.add(block)
            return
        dev = self.rows.device
        blocks, offsets = torch.full((fill,), block, device=dev), torch.arange(fill, device=dev)
        for layer in range(self.inner.num_layers):
            x = data["stage"][layer, :, :fill].to(dev)
            self.inner.write(store, layer, blocks, offsets, x[0], x[1])
