"""The scheduler's KV memory: the block pool, every sequence's block table, the tables of idle
sessions, and the warm / cold tiers beneath the pool, behind intent-named verbs.

Only the engine thread calls it (the scheduler owns it, as vLLM's Scheduler owns its
KVCacheManager), so it takes no locks. A table moves through these states:

    reserve / advance        a running sequence's table grows (and, behind a sliding window or
                             chunk, frees the blocks no query will read again)
    share_prefix             a new request starts with the prefix cache's blocks of its prompt
    release                  a finished request: its full blocks join the prefix cache, every
                             block reference goes back
    compress                 KV_COMPRESS: rows older than the recent window pooled or picked
                             into fewer blocks (compress.py); never indexed in the prefix cache
    preempt                  the pool ran dry: the same, and the sequence is recomputed (from
                             the prefix cache, mostly; a compressed one from its tokens)
    park                     a session's turn ended: the blocks stay, and while the session is
                             idle they may be moved down to the warm / cold tiers (demoted)
    resume                   the session's next turn: keep the prefix it shares, bring tiered
                             blocks back into the pool (promote)
    drop                     the session closed: blocks anywhere are freed

A state-space model's recurrent state per table (states.py) follows its table through these verbs: freed
with it, kept with a parked one, copied with a fork, and dropped (the table recomputed from its first
token) wherever the table would keep fewer tokens than the state has seen.

What happens to blocks is told to listeners as KVEvents (tracing turns them into span events);
nothing here knows about requests or spans.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.prefix import PrefixCache
from kvgen.engine.kv.states import StateStore
from kvgen.engine.kv.tiers import Tier, TieredKV
from kvgen.errors import PoolExhausted


@dataclass(slots=True)
class KVEvent:
    name: str  # "kv.alloc", "kv.free", "kv.preempt", "kv.retain", "kv.truncate", "kv.promote", ...
    table: PagedKVCache
    blocks: list[int] | None = None  # pool block ids the event is about (None: not about blocks)
    attrs: dict = field(default_factory=dict)
    t: float = field(default_factory=time.perf_counter)


class KVManager:
    def __init__(self, pool: BlockPool, tiers: TieredKV, warm_bytes: int, prefix: PrefixCache | None = None,
                 shift_keys=None):
        """shift_keys(k, delta): keys re-rotated delta positions back (Model.shift_keys), for
        context shifts of plain formats; None: a shift recomputes what follows the kept head."""
        self.shift_keys = shift_keys
        self.compressor = None  # the server's KV_COMPRESS (compress.py), new tables' default; None: off
        self.pool = pool
        self.tiers = tiers
        self.prefix = prefix  # None: no sharing across requests (PREFIX_CACHE=0, or a window)
        self.warm_bytes = warm_bytes  # past this, demoted blocks go on to disk
        self._parked: dict[PagedKVCache, None] = {}  # idle sessions' tables, least recently used first
        self._dropped: weakref.WeakSet[PagedKVCache] = weakref.WeakSet()  # closed sessions' tables
        self._listeners: list[Callable[[KVEvent], None]] = []
        # a state-space model's per-table recurrent states (states.py), freed and kept with the tables; None: none
        self.states: StateStore | None = None

    def listen(self, fn: Callable[[KVEvent], None]) -> None:
        self._listeners.append(fn)

    def _emit(self, name: str, table: PagedKVCache, blocks: list[int] | None = None, **attrs) -> None:
        if self._listeners:
            ev = KVEvent(name, table, blocks, attrs)
            for fn in self._listeners:
                fn(ev)

    # what the pool holds

    def new_table(self, compressor=...) -> PagedKVCache:
        """compressor: the table's KVCompressor, None to keep it exact (default: the server's)."""
        table = PagedKVCache(self.pool)
        table.compressor = self.compressor if compressor is ... else compressor
        return table

    @property
    def used(self) -> int:
        """Blocks held by requests and sessions: a block only the prefix cache holds is counted
        as free (the next reserve that needs it takes it), as vLLM counts its cached blocks."""
        return self.pool.used - (self.prefix.blocks_idle if self.prefix is not None else 0)

    def tier_bytes(self, tier: Tier) -> int:
        return self.tiers.nbytes(tier)

    # a running sequence

    def reserve(self, table: PagedKVCache, n: int) -> bool:
        """Room for n more tokens in the table, demoting idle sessions' blocks if the pool is
        short. False (nothing allocated) when even that leaves too little room."""
        need = table.blocks_needed(n)
        if need == 0:
            return True
        if need > self.pool.available and self.prefix is not None:
            self.prefix.evict(need)  # the index's own blocks go first: nobody is using them
        if need > self.pool.available and not self._make_room(need):
            return False
        had = len(table.blocks)
        try:
            table.reserve(n)
        except PoolExhausted:
            return False
        self._emit("kv.alloc", table, table.blocks[had:], tokens=n)
        return True

    def advance(self, table: PagedKVCache, n: int, oldest_needed: int = 0) -> None:
        """n more tokens of the table are written; blocks wholly before position oldest_needed
        (out of a sliding window or a finished chunk) go back to the pool."""
        table.advance(n)
        if oldest_needed:
            dropped = table.drop_before(oldest_needed)
            if dropped:
                self._emit("kv.drop", table, dropped, before=oldest_needed)

    def compress(self, table: PagedKVCache) -> None:
        """After a step: KV_COMPRESS pools or picks the rows now older than its window."""
        if table.compressor is None or not table.compressor.due(table):
            return
        before = table.rows
        freed = table.compressor.compress(table)
        if freed:
            self._emit("kv.compress", table, freed, rows_before=before, rows_after=table.rows, tokens=table.length)

    def index_prompt(self, table: PagedKVCache, salt: str, prompt: list[int], n: int) -> None:
        """After a step wrote n tokens of a running request: when they completed a block of its
        prompt, the prompt's blocks written so far join the prefix cache now, not at its end, so
        a request that arrives meanwhile starting the same way shares them (whole blocks of the
        prompt only: nothing writes into them again)."""
        bs, end = self.pool.block_size, table.length
        if end - n < len(prompt) and end // bs > (end - n) // bs and not table.compressed_to:
            self._index(table, salt, prompt)

    def truncate(self, table: PagedKVCache, n: int) -> None:
        """A running sequence keeps only its first n tokens' K/V (speculative decoding's rejected
        drafts): the blocks past them go back to the pool."""
        before = table.length
        freed = table.truncate(n)
        if table.length != before:
            self._emit("kv.truncate", table, freed, tokens_before=before, tokens_after=table.length)

    def fork(self, table: PagedKVCache, child: PagedKVCache) -> bool:
        """Give the empty table `child` the same tokens' K/V as `table`: the full blocks shared
        (reference counted, never written again: a sequence writes only past its length), the
        partly filled last block copied now, since both tables will write into it (copy on
        write, done at the fork). False (child left empty) when the pool has no block for the copy."""
        bs = self.pool.block_size
        full, fill = divmod(table.rows, bs)  # a compressed table's rows, shared as they are
        shared = table.blocks[:full]
        if any(b < 0 for b in shared):  # dropped behind a window or demoted: nothing to share
            return False
        if fill and not self.reserve_blocks(1):
            return False
        self.pool.share(shared)
        child.blocks = list(shared)
        if fill:
            copy = self.pool.alloc(1)[0]
            fmt, store, last = self.pool.fmt, self.pool.store, table.blocks[full]
            fmt.put_block(store, copy, fmt.take_block(store, last, fill), fill)
            child.blocks.append(copy)
        child.length, child.removed, child.compressed_to = table.length, table.removed, table.compressed_to
        if self.states is not None:
            self.states.fork(table, child)
        self._emit("kv.fork", child, list(child.blocks), tokens=child.length, copied=int(bool(fill)))
        return True

    def reserve_blocks(self, n: int) -> bool:
        """At least n free blocks in the pool, evicting the prefix cache's idle blocks and
        demoting idle sessions' if need be."""
        if n > self.pool.available and self.prefix is not None:
            self.prefix.evict(n)
        return n <= self.pool.available or self._make_room(n)

    def share_prefix(self, table: PagedKVCache, salt: str, ids: list[int]) -> int:
        """Start an empty table with the cached blocks ids begin with. Returns the tokens reused."""
        if self.prefix is None or table.blocks:
            return 0
        n = self.prefix.share_into(table, salt, ids)
        if n:
            self._emit("kv.prefix_hit", table, list(table.blocks), tokens=n)
        else:
            self._emit("kv.prefix_miss", table, None, tokens=0)
        return n

    def release(self, table: PagedKVCache, salt: str = "", tokens: list[int] | None = None) -> None:
        """The request is over: its blocks join the prefix cache (given its tokens; the partly
        filled last one for copies only), and every block reference goes back."""
        self._index(table, salt, tokens, tail=True)
        blocks, n = _held(table), table.length
        self.tiers.reset(table)
        self._free_state(table)
        self._emit("kv.free", table, blocks, tokens=n)

    def preempt(self, table: PagedKVCache, salt: str = "", tokens: list[int] | None = None) -> None:
        """The pool ran dry: the blocks go back (the full ones kept by the prefix cache, so the
        recompute mostly finds them), and the sequence will be recomputed."""
        self._index(table, salt, tokens)
        blocks, n = _held(table), table.length
        self.tiers.reset(table)
        self._free_state(table)  # recomputed from the tokens, as the K/V is
        self._emit("kv.preempt", table, blocks, tokens=n)

    def _index(self, table: PagedKVCache, salt: str, tokens: list[int] | None, tail: bool = False) -> None:
        if self.prefix is not None and tokens is not None and table.first == 0 and not table.compressed_to:
            self.prefix.insert(salt, tokens, table, tail)

    # sessions

    def park(self, table: PagedKVCache, salt: str = "", tokens: list[int] | None = None) -> None:
        """A session's turn is over: its blocks stay for the next turn, and may be demoted to
        the tiers while it is idle (least recently used session first). Its full blocks join the
        prefix cache too (given its tokens), so a request that starts like the conversation
        reuses them, as the session itself does. A closed session's table (a turn that reached
        the engine after the close) is released instead: nobody would ever resume or drop it."""
        if table in self._dropped:
            self.release(table, salt, tokens)
            return
        self._index(table, salt, tokens)
        self._parked.pop(table, None)
        self._parked[table] = None
        self.tiers.touch(table)
        self._emit("kv.retain", table, _held(table), tokens=table.length)
        if self.states is not None and self.states.over_budget:
            self._let_go_of_states()

    def _let_go_of_states(self) -> None:
        """Idle sessions' recurrent states (and their blocks, which count positions of nothing else), least
        recently used first, until the store is within its budget: each such session recomputes its next turn."""
        for table in list(self._parked):
            if not self.states.over_budget:
                return
            if self.states.length(table) is None:
                continue
            blocks, tokens = _held(table), table.length
            self.tiers.reset(table)
            self._free_state(table)
            self._emit("kv.evict", table, blocks, tokens=tokens)

    def resume(self, table: PagedKVCache, keep: int) -> int:
        """A session's next turn: keep its first `keep` cached tokens (what the new prompt shares
        with them), with every demoted block back in the pool. With no room to bring them back,
        the prompt is computed again. Returns the tokens kept."""
        self._parked.pop(table, None)
        old, held = table.length, _held(table)
        parked = self.tiers.parked(table)
        if self.states is not None:  # a recurrent state is kept whole or not at all (states.py)
            keep = self.states.restorable(table, keep)
        if parked and self.prefix is not None:
            self.prefix.evict(parked)  # cache-only blocks make way for the session's own
        try:
            self.tiers.truncate(table, keep)
        except PoolExhausted:
            self.tiers.reset(table)
        self._own_last_block(table)
        if self.states is not None and self.states.length(table) != table.length:
            self.tiers.reset(table)  # its blocks could not all come back: from the start, state and all
            self._free_state(table)
        if table.length != old:
            now = set(_held(table))
            self._emit("kv.truncate", table, [b for b in held if b not in now], tokens_before=old,
                       tokens_after=table.length)
        if parked and table.length:
            self._emit("kv.promote", table, _held(table), tokens=table.length)
        if table.length:
            self._emit("kv.prefix_hit", table, _held(table), tokens=table.length)
        else:
            self._emit("kv.prefix_miss", table, None, tokens=0)
        return table.length

    def shift(self, table: PagedKVCache, keep_blocks: int, drop_blocks: int) -> bool:
        """A session outgrew the context (llama.cpp's context shift): its blocks keep_blocks ..
        keep_blocks + drop_blocks - 1 are freed and the blocks after them move up, their keys
        re-rotated to the new positions (keys are stored rotated), so nothing is recomputed. With
        a quantized format (re-rotating would re-quantize), blocks parked in the tiers, or blocks
        the prefix cache shares, only the head is kept: the rest is computed again. Returns whether
        the blocks after the dropped ones were kept (moved up)."""
        if self.states is not None:  # a recurrent state cannot drop its oldest tokens: all recomputed
            self.tiers.reset(table)
            self._free_state(table)
            return False
        parked = self._parked.pop(table, 0) is None  # never demoted to make room for its own copies
        try:
            return self._shift(table, keep_blocks, drop_blocks)
        finally:
            if parked:
                self._parked[table] = None

    def _shift(self, table: PagedKVCache, keep_blocks: int, drop_blocks: int) -> bool:
        bs = self.pool.block_size
        if self.shift_keys is None or self.pool.fmt.name not in ("fp32", "fp16", "bf16") or table.first \
                or table.compressed_to \
                or self.tiers.parked(table) or (keep_blocks + drop_blocks) * bs > table.length \
                or any(self.pool.refs(b) > 1 for b in table.blocks):
            # A quantized format (re-rotating would re-quantize), blocks out in the tiers or shared
            # with the prefix cache, or compressed rows (their positions are not whole blocks): keep
            # the head only (a compressed table: nothing), the rest is computed again.
            try:
                self.tiers.truncate(table, keep_blocks * bs)  # parked blocks past it dropped, the rest back
            except PoolExhausted:
                self.tiers.reset(table)
            return False
        before, blocks = table.length, table.blocks
        end = keep_blocks + drop_blocks
        table.blocks = blocks[:keep_blocks] + blocks[end:]
        table.length -= drop_blocks * bs
        self.pool.free(blocks[keep_blocks:end])
        self._emit("kv.shift", table, blocks[keep_blocks:end], tokens_before=before, tokens_after=table.length)
        moved, tokens = table.blocks[keep_blocks:], table.length - keep_blocks * bs
        if not moved:
            return True
        fmt = self.pool.fmt
        ids = torch.tensor(moved, device=self.pool.device)
        where = ids.repeat_interleave(bs)[:tokens]
        offsets = torch.arange(bs, device=ids.device).repeat(len(moved))[:tokens]
        for layer in range(fmt.num_layers):
            k, v = fmt.read(self.pool.store, layer, ids)  # [blocks, BS, KVH, HD]
            k = self.shift_keys(k, drop_blocks * bs)
            shape = (-1, *k.shape[-2:])
            fmt.write(self.pool.store, layer, where, offsets, k.reshape(shape)[:tokens], v.reshape(shape)[:tokens])
        return True

    def _own_last_block(self, table: PagedKVCache) -> None:
        """Copy on write: a table about to write into its partly kept last block must hold that
        block alone (the prefix cache may share it, full, with other requests). With no block
        for the copy, the partial block's tokens are dropped and computed again."""
        bs = self.pool.block_size
        full, fill = divmod(table.rows, bs)
        if fill and self.pool.refs(table.blocks[full]) > 1 and not self._copy_block(table, full, fill):
            self.truncate(table, table.length - fill)

    def _copy_block(self, table: PagedKVCache, index: int, fill: int) -> bool:
        """Give table a private copy of its block `index` (first `fill` tokens); False: no room."""
        if not self.reserve_blocks(1):
            return False
        old = table.blocks[index]
        new = self.pool.alloc(1)[0]
        fmt, store = self.pool.fmt, self.pool.store
        fmt.put_block(store, new, fmt.take_block(store, old, fill), fill)
        table.blocks[index] = new
        self.pool.free([old])
        self._emit("kv.copy", table, [new], source=old, tokens=fill)
        return True

    def unresume(self, table: PagedKVCache) -> None:
        """The turn could not be admitted after all: idle again, its blocks demotable."""
        self._parked[table] = None

    def drop(self, table: PagedKVCache) -> None:
        """The session is closed: its blocks, wherever they are, are freed (and stay so)."""
        self._dropped.add(table)
        self._parked.pop(table, None)
        blocks, tokens = _held(table), table.length
        if tokens or self.tiers.parked(table):
            self.tiers.reset(table)
            self._emit("kv.evict", table, blocks, tokens=tokens)
        self._free_state(table)

    def _free_state(self, table: PagedKVCache) -> None:
        if self.states is not None:
            self.states.free(table)

    def _make_room(self, need: int) -> bool:
        """Demote idle sessions' blocks (least recently read first) until `need` blocks are
        free, and spill the warm tier past its budget to disk."""
        idle = [t for t in self._parked if t.length]
        if not idle:
            return False
        before = {t: self.tiers.parked(t) for t in idle}
        room = self.tiers.make_room(need, only=idle)
        self.tiers.spill(self.warm_bytes)
        for t, n in before.items():
            moved = self.tiers.parked(t) - n
            if moved:
                self._emit("kv.demote", t, None, blocks_moved=moved)
        return room


def _held(table: PagedKVCache) -> list[int]:
    """Blocks the table holds in the pool (dropped or demoted ones are -1)."""
    return [b for b in table.blocks if b >= 0]
