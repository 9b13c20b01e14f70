"""Which sequences run in the next forward pass, and how many tokens each.

Every step takes all running sequences' pending tokens (one each while decoding) and
fills what is left of the token budget with prefill chunks, oldest first, so a long
prompt never stalls the streams already running. When the pool runs dry the newest
running sequence is preempted: its blocks go back and it is recomputed later.

The scheduler owns the KV manager: admission reserves blocks (demoting idle sessions' blocks
when the pool is short), a session's turn resumes its cached prefix when it is admitted, and
`finish` releases a request's blocks or parks a session's. Only the engine thread calls it.
"""

from __future__ import annotations

from collections import deque

from kvgen.engine.kv.manager import KVManager
from kvgen.engine.sequence import Sequence


class Scheduler:
    def __init__(self, kv: KVManager, token_budget: int = 512, max_running: int = 64):
        self.kv = kv
        self.token_budget = token_budget
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues (it is finished or cancelled); `finish` lets go of its KV."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Sequence) -> None:
        """seq is done: out of the queues, and its blocks released (a session's parked)."""
        self.remove(seq)
        if seq.keep_kv:
            self.kv.park(seq.cache, seq.cache_salt, seq.tokens)
        else:
            self.kv.release(seq.cache, seq.cache_salt, seq.tokens)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.token_budget
        batch: list[tuple[Sequence, int]] = []
        # running first, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.pending, budget)
            if not self._reserve_running(seq, n):
                if seq not in self.running:  # it was the newest and preempted itself
                    continue
            else:
                batch.append((seq, n))
                budget -= n
            i += 1
        # then admit waiting sequences while there is budget and room
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = min(seq.pending, budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Reserve the first chunk of a waiting sequence; a session's turn first takes back the
        prefix it shares with the session's cache."""
        if seq.resume_from is not None:
            if seq.shift is not None:  # the session outgrew the context: drop its oldest blocks first
                self.kv.shift(seq.cache, *seq.shift)
                seq.shift = None
            seq.cached_tokens = self.kv.resume(seq.cache, seq.resume_from)
            if not seq.cached_tokens and seq.reuses_kv:  # a new session: the prefix cache may hold its start
                seq.cached_tokens = self._share_prefix(seq)
        elif seq.shares_prompt:  # a request of its own: the prefix cache may hold its start
            seq.cached_tokens = self._share_prefix(seq)
        if not self._prefilled_by_another(seq) and self.kv.reserve(seq.cache, min(seq.pending, budget)):
            seq.resume_from = None
            return True
        if seq.resume_from is not None:  # waits with its prefix, which stays demotable meanwhile
            self.kv.unresume(seq.cache)
        elif not seq.keep_kv and seq.cache.blocks:  # waits holding nothing; matched again next time
            self.kv.release(seq.cache)
            seq.cached_tokens = 0
        return False

    def _share_prefix(self, seq: Sequence) -> int:
        """Start seq with the prefix cache's KV of its prompt's start. Returns what usage reports:
        the tokens of whole shared blocks (rows copied from a block matched in part are reused
        too, but not counted: cached_tokens is a multiple of the block size, as the README says)."""
        bs = self.kv.pool.block_size
        return min(self.kv.share_prefix(seq.cache, seq.cache_salt, seq.tokens) // bs * bs, len(seq.prompt_ids))

    def _prefilled_by_another(self, seq: Sequence) -> bool:
        """Whether a running request (same salt, the same prompt up to there) has yet to compute
        the prompt block seq would compute next. seq then waits: the block joins the prefix cache
        when it is written (Engine indexes prompt blocks as they complete), and seq shares it
        instead of computing it a second time (SGLang's in-batch prefix sharing): of 8 chat
        clients that arrive together, one computes the system prompt."""
        if self.kv.prefix is None or not seq.shares_prompt:  # nothing to share: no waiting
            return False
        bs = self.kv.pool.block_size
        end = (seq.cache.length // bs + 1) * bs
        if end >= len(seq.prompt_ids):  # no whole block of the prompt ahead (its last token is computed anyway)
            return False
        head = seq.prompt_ids[:end]
        return any(o.shares_prompt and o.cache_salt == seq.cache_salt and o.cache.length < end
                   and o.prompt_ids[:end] == head for o in self.running)

    def _reserve_running(self, seq: Sequence, n: int) -> bool:
        """Reserve for a running sequence, preempting the newest others until it fits."""
        while not self.kv.reserve(seq.cache, n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.cut_draft(0)  # recomputed from its tokens; it may draft again once decoding
        if seq.keep_kv:
            self.kv.preempt(seq.cache)
        else:
            self.kv.preempt(seq.cache, seq.cache_salt, seq.tokens)
        seq.cached_tokens = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
