"""Which sequences run in the next forward pass, and how many tokens each.

Every step takes all running sequences' pending tokens (one each while decoding) and
fills what is left of the token budget with prefill chunks, oldest first, so a long
prompt never stalls the streams already running. When the pool runs dry the newest
running sequence is preempted: its blocks go back and it is recomputed later.
"""

from __future__ import annotations

from collections import deque

from kvgen.errors import Overloaded, PoolExhausted
from kvgen.engine.sequence import Sequence


class Scheduler:
    def __init__(self, token_budget: int = 512, max_running: int = 64, max_waiting: int = 256,
                 reclaim=None):
        self.token_budget = token_budget
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.reclaim = reclaim  # fn(blocks_needed) -> bool: free idle session caches

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise Overloaded(f"{len(self.waiting)} requests already waiting (MAX_WAITING)")
        self.waiting.append(seq)

    def drop(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.token_budget
        batch: list[tuple[Sequence, int]] = []
        # running first, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.pending, budget)
            if not self._reserve(seq, n):
                if seq not in self.running:  # it was the newest and preempted itself
                    continue
            else:
                batch.append((seq, n))
                budget -= n
            i += 1
        # then admit waiting sequences while there is budget and room
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = min(seq.pending, budget)
            if not self._try_reserve(seq, n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _try_reserve(self, seq: Sequence, n: int) -> bool:
        need = seq.cache.blocks_needed(n)
        if need > seq.cache.pool.available and not (self.reclaim and self.reclaim(need)):
            return False
        try:
            seq.cache.reserve(n)
            return True
        except PoolExhausted:
            return False

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Reserve for a running sequence, preempting the newest others until it fits."""
        while not self._try_reserve(seq, n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.cache.reset()
        seq.cached_tokens = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
