"""A pool of fixed-size KV blocks shared by every sequence, in one storage format.

A block can have several holders (sequences starting with the same prefix, and the prefix
cache's index): `alloc` gives one reference, `share` adds one, `free` drops one, and the block
goes back to the free list when the last is dropped."""

from __future__ import annotations

import threading
from collections import deque

import torch

from kvgen.engine.kv.formats import KVFormat
from kvgen.errors import PoolExhausted


class BlockPool:
    def __init__(self, fmt: KVFormat, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.fmt = fmt
        self.device = torch.device(device)
        self.store = fmt.allocate(num_blocks, device)
        self.capacity = num_blocks
        self.block_size = fmt.block_size
        self._free = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # allocated block -> holders
        self._lock = threading.Lock()

    @classmethod
    def from_budget(cls, fmt: KVFormat, budget_mb: float, device="cpu") -> BlockPool:
        """As many blocks as fit in budget_mb next to the format's stage of recent blocks."""
        return cls(fmt, (int(budget_mb * 2**20) - fmt.stage_bytes()) // fmt.bytes_per_block(), device)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def exact_blocks_used(self) -> int:
        """Sequences' newest blocks held exact beside the quantized store (stage.ExactTail;
        0 for formats without one)."""
        return self.fmt.exact_blocks_used

    @property
    def exact_blocks_total(self) -> int:
        """Slots for exact newest blocks (0: the format keeps none)."""
        return self.fmt.exact_blocks_total

    def alloc(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(f"need {n} KV blocks, {len(self._free)} free of {self.capacity}")
            blocks = [self._free.popleft() for _ in range(n)]
            for b in blocks:
                self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder of each (allocated) block."""
        with self._lock:
            for b in blocks:
                if b not in self._refs:
                    raise RuntimeError(f"KV block {b} shared but not allocated")
                self._refs[b] += 1

    def refs(self, block: int) -> int:
        """Holders of a block (0: free)."""
        return self._refs.get(block, 0)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the ones nobody holds any more are free again."""
        with self._lock:
            gone = []
            for b in blocks:
                n = self._refs.get(b, 0)
                if n == 0:
                    raise RuntimeError(f"KV block {b} freed twice or never allocated")
                if n == 1:
                    del self._refs[b]
                    self._free.append(b)
                    gone.append(b)
                else:
                    self._refs[b] = n - 1
            if gone:
                self.fmt.release(self.store, gone)
