"""One sequence's view of the pool: a block table and a length.

The seed's CacheProvider verbs (update / get / seq_len / reset / truncate) work on it for
single-sequence use; the batched forward writes through `slots` instead.
"""

from __future__ import annotations

import torch

from kvgen.engine.kv.pool import BlockPool


class PagedKVCache:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []  # block i holds positions i*block_size...; -1 once dropped
        self.first = 0  # blocks before this were dropped (out of a sliding window)
        self.length = 0  # tokens whose K/V are written

    @property
    def seq_len(self) -> int:
        return self.length

    def blocks_needed(self, n_new: int) -> int:
        bs = self.pool.block_size
        return max(0, -(-(self.length + n_new) // bs) - len(self.blocks))

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more tokens (raises PoolExhausted, allocating nothing)."""
        need = self.blocks_needed(n_new)
        if need:
            self.blocks.extend(self.pool.alloc(need))

    def slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of positions start..start+n, which must be reserved."""
        bs = self.pool.block_size
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return table[pos // bs], pos % bs

    @property
    def live_blocks(self) -> list[int]:
        return self.blocks[self.first:]

    @property
    def kv_start(self) -> int:
        """Position of the first key still held."""
        return self.first * self.pool.block_size

    def drop_before(self, pos: int) -> list[int]:
        """Free the blocks whose positions all lie before pos (no query will see them again)."""
        end = min(pos // self.pool.block_size, len(self.blocks))
        if end <= self.first:
            return []
        dropped = self.blocks[self.first:end]
        self.blocks[self.first:end] = [-1] * (end - self.first)
        self.first = end
        self.pool.free(dropped)
        return dropped

    def advance(self, n: int) -> None:
        bs = self.pool.block_size
        first = self.length // bs
        self.length += n
        for i in range(first, -(-self.length // bs)):
            self.pool.set_fill(self.blocks[i], min(bs, self.length - i * bs))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [n, kv_heads, head_dim] for one layer; the last layer advances seq_len."""
        n = k.shape[0]
        self.reserve(n)
        blocks, offsets = self.slots(self.length, n)
        positions = torch.arange(self.length, self.length + n)
        self.pool.fmt.write(self.pool.store, layer, blocks, offsets, k, v, positions)
        if layer == self.pool.fmt.num_layers - 1:
            self.advance(n)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [seq_len, kv_heads, head_dim] of one layer, gathered from the blocks."""
        n_blocks = -(-self.length // self.pool.block_size)
        live = torch.tensor(self.blocks[self.first:n_blocks], dtype=torch.long)
        k, v = self.pool.fmt.read(self.pool.store, layer, live)
        shape = (-1, self.pool.fmt.num_kv_heads, self.pool.fmt.head_dim)
        n = self.length - self.kv_start
        return k.reshape(shape)[:n], v.reshape(shape)[:n]

    def truncate(self, new_len: int) -> list[int]:
        """Keep the first new_len tokens; returns the blocks given back to the pool (reserved
        but unwritten blocks included)."""
        new_len = max(0, min(new_len, self.length))
        if self.first and new_len < self.length:
            new_len = 0  # keys before the window are gone: recompute from the start
        bs = self.pool.block_size
        keep = -(-new_len // bs)
        freed = [b for b in self.blocks[keep:] if b >= 0]
        self.blocks = self.blocks[:keep]
        self.first = min(self.first, keep)
        self.length = new_len
        self.pool.free(freed)
        if new_len % bs and self.blocks:
            self.pool.set_fill(self.blocks[-1], new_len % bs)
        return freed

    def reset(self) -> None:
        self.truncate(0)

    free = reset
