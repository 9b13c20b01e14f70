"""One sequence's view of the pool: a block table and a length.

It only keeps the books (which blocks, how many tokens written); the forward pass writes K/V
through `slots` into the pool's store, then `advance`s the length.
"""

from __future__ import annotations

import torch

from kvgen.engine.kv.pool import BlockPool


class PagedKVCache:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []  # block i holds positions i*block_size...; -1 once dropped
        self.first = 0  # blocks before this were dropped (out of a sliding window)
        self.length = 0  # tokens whose K/V are written (positions: the next token's is `length`)
        # KV_COMPRESS (compress.py): positions before `compressed_to` are held in fewer rows; the
        # rows after them are exact, position p in row p - removed (rows: length - removed)
        self.removed = 0
        self.compressed_to = 0
        self.compressor = None  # its KVCompressor (the request's or the server's KV_COMPRESS); None: exact

    @property
    def rows(self) -> int:
        """K/V rows held: the tokens written, less what compression took out."""
        return self.length - self.removed

    def blocks_needed(self, n_new: int) -> int:
        bs = self.pool.block_size
        return max(0, -(-(self.rows + n_new) // bs) - len(self.blocks))

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more tokens (raises PoolExhausted, allocating nothing)."""
        need = self.blocks_needed(n_new)
        if need:
            self.blocks.extend(self.pool.alloc(need))

    def slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of positions start..start+n, which must be reserved."""
        bs = self.pool.block_size
        pos = torch.arange(start - self.removed, start + n - self.removed)
        table = torch.tensor(self.blocks, dtype=torch.long)
        return table[pos // bs], pos % bs

    @property
    def live_blocks(self) -> list[int]:
        return self.blocks[self.first:]

    @property
    def kv_start(self) -> int:
        """Position of the first key still held; a compressed table's rows are fewer than its
        positions, and attention reads `length - kv_start` rows from the first live block."""
        return self.first * self.pool.block_size + self.removed

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
        """n more tokens' K/V are written (into slots reserved before)."""
        self.length += n

    def truncate(self, new_len: int) -> list[int]:
        """Keep the first new_len tokens; returns the blocks given back to the pool (reserved
        but unwritten blocks included)."""
        new_len = max(0, min(new_len, self.length))
        if self.first and new_len < self.length or new_len < self.compressed_to:
            new_len = 0  # keys before the window are gone, or cut inside the compressed rows: from the start
        if not new_len:
            self.removed = self.compressed_to = 0
        bs = self.pool.block_size
        keep = -(-(new_len - self.removed) // bs)
        freed = [b for b in self.blocks[keep:] if b >= 0]
        self.blocks = self.blocks[:keep]
        self.first = min(self.first, keep)
        self.length = new_len
        self.pool.free(freed)
        return freed

    def reset(self) -> None:
        """Give every block back to the pool; the cache is empty."""
        self.truncate(0)
