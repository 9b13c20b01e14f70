"""The prefix cache: full KV blocks of past requests, indexed by their tokens, shared by later
requests that start the same way (SGLang's radix cache, at block granularity).

Each node of the tree is one full block: its key is the block's block_size token ids, its path
from the root is everything before it, and it holds one pool reference to the block (through a
one-block table, `holder`, so the tiers can move it). A request that starts with a node's path
shares the node's block: only full blocks are shared and a sequence's own writes start after
them, so no write ever lands in a shared block. Where the blocks stop matching, the rows the
request has in common with the start of a child block are copied into a block of its own
(plain formats only; copy on write, done at the match). A finished request's partly filled
last block is indexed too, as a leaf whose key is its rows' tokens, for that copy alone.

Trees are per `cache_salt`: requests with different salts never share a block, so a tenant
cannot learn from timing what another one sent (vLLM's reason for the salt). The KV format and
the model are the server's own, so they need no key.

When the pool runs short, nodes that only the tree still holds are demoted, least recently
used first, to the warm / cold tiers rather than dropped: a later hit brings them back. Past
`tier_bytes`, the least recently used leaves leave the tree for good.

Listeners (`listeners`, events.py) hear of every full block that joins the tree and every one
that leaves it, by chain hash; a demoted block is still in the tree (a hit brings it back).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvgen.engine.kv import events
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.tiers import HOLE, TieredKV
from kvgen.errors import PoolExhausted


@dataclass
class PrefixStats:
    hits: int = 0  # requests that reused at least one block
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens not computed again
    evictions: int = 0  # blocks moved out of the pool (demoted) or out of the tree (dropped)


class _Node:
    __slots__ = ("key", "parent", "children", "holder", "used", "hash")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, holder: PagedKVCache | None,
                 hash: int | None = None):
        self.key = key
        self.hash = hash  # events.block_hash of its path (None: a root)
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.holder = holder  # one block, one pool reference (None: a root)
        self.used = 0  # tick of the last match or insert (LRU)

    @property
    def block(self) -> int:
        return self.holder.blocks[0]


class PrefixCache:
    def __init__(self, pool: BlockPool, tiers: TieredKV, tier_bytes: int):
        self.pool = pool
        self.tiers = tiers
        self.tier_bytes = tier_bytes
        self.block_size = pool.block_size
        self.stats = PrefixStats()
        self._roots: dict[str, _Node] = {}
        self._nodes: list[_Node] = []  # every non-root node
        self._tick = itertools.count(1)
        self.listeners: list[events.PrefixListener] = []  # called on the engine thread (events.py)

    @property
    def blocks_held(self) -> int:
        """Blocks of the tree in the pool (shared or not)."""
        return sum(n.block != HOLE for n in self._nodes)

    @property
    def blocks_idle(self) -> int:
        """Blocks in the pool that only the tree holds: reclaimable at once, like free ones."""
        return sum(n.block != HOLE and self.pool.refs(n.block) == 1 for n in list(self._nodes))

    @property
    def blocks_tiered(self) -> int:
        return sum(n.block == HOLE for n in self._nodes)

    def share_into(self, table: PagedKVCache, salt: str, ids: list[int]) -> int:
        """Start an empty table with the longest run of cached full blocks that ids begin with
        (at most up to the last token: one token is always computed, for its logits), and the
        rows of a block it goes on to match in part (_copy_rows). Blocks that were demoted come
        back into the pool on the way; with no room for one, the match stops there. Returns the
        tokens reused."""
        bs = self.block_size
        parent, shared, cut_short = self._roots.get(salt), [], False
        for i in range((len(ids) - 1) // bs if parent else 0):
            node = parent.children.get(tuple(ids[i * bs:(i + 1) * bs]))
            if node is None:
                break
            if node.block == HOLE:
                if not self.pool.available:
                    node.used = next(self._tick)  # the newest: trimming the tiers takes older leaves
                    self.evict(1)  # blocks matched so far are shared already: never the victims
                    if not node.holder.blocks:  # trimmed out of the tiers all the same: the match ends
                        cut_short = True
                        break
                try:
                    self.tiers.promote(node.holder)
                except PoolExhausted:
                    cut_short = True
                    break
            node.used = next(self._tick)
            self.pool.share([node.block])
            shared.append(node.block)
            parent = node
        table.blocks, table.length = shared, len(shared) * bs
        if parent is not None and not cut_short:  # a block it could not bring back: nothing past it
            self._copy_rows(parent, table, ids)
        if table.length:
            self.stats.hits += 1
            self.stats.hit_tokens += table.length
        else:
            self.stats.misses += 1
        return table.length

    def _copy_rows(self, node: _Node, table: PagedKVCache, ids: list[int]) -> None:
        """Past the shared whole blocks, ids may go on to match the start of a cached block (a
        resent chat turn: the old prompt's partial last block, the reply's first tokens): those
        rows are copied into a block of the table's own, which it then fills, instead of being
        computed again. Only where a block's rows are independent of each other (fp32 / fp16 /
        bf16, nothing held exact), so the copy holds the bytes a cold run would write."""
        if not self._copies_rows():
            return
        fmt = self.pool.fmt
        start = table.length
        want = ids[start:min(start + self.block_size, len(ids) - 1)]  # never the last token
        best, rows = None, 0
        for key, child in node.children.items():
            m = 0
            while m < len(want) and m < len(key) and key[m] == want[m]:
                m += 1
            if m > rows and child.block != HOLE:
                best, rows = child, m
        if best is None:
            return
        best.used = next(self._tick)  # the newest: not the block evict() frees for the copy
        if not self.pool.available:
            self.evict(1)
        if not self.pool.available or best.block == HOLE:
            return
        copy = self.pool.alloc(1)[0]
        fmt.put_block(self.pool.store, copy, fmt.take_block(self.pool.store, best.block, rows), rows)
        table.blocks.append(copy)
        table.length += rows

    def _copies_rows(self) -> bool:
        """Whether a block's rows can be copied out of it on their own: only where they are
        independent of each other (fp32 / fp16 / bf16, nothing held exact), so the copy holds
        the bytes a cold run would write."""
        fmt = self.pool.fmt
        return fmt.name in ("fp32", "fp16", "bf16") and not fmt.recent_slots

    def insert(self, salt: str, tokens: list[int], table: PagedKVCache, tail: bool = False) -> int:
        """Index the table's full written blocks under their tokens (the table keeps its own
        references); with `tail` (a finished request), its partly filled last block too, as a
        leaf that only _copy_rows reads (its key is shorter than a block, so no whole-block match
        finds it, and nothing is ever indexed below it): a chat client's next turn resends the
        reply whose end is in that block. Returns how many blocks were new to the tree."""
        if table.compressed_to:  # its rows are pooled / picked (compress.py) from position 0: none is exact
            return 0
        bs = self.block_size
        node = self._roots.setdefault(salt, _Node((), None, None))
        added, n = 0, min(table.length, len(tokens))
        new: list[_Node] = []  # a chain: below a new node every node is new
        stopped = False
        for i in range(n // bs):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                block = table.blocks[i]
                if block < 0:  # dropped behind a window, or demoted: nothing to index from here
                    stopped = True
                    break
                child = node.children[key] = self._new_node(key, node, block, bs, salt)
                new.append(child)
                added += 1
            child.used = next(self._tick)
            node = child
        if new and self.listeners:
            events.publish(self.listeners, events.BlocksStored(salt, new[0].parent.hash,
                                                               [events.StoredBlock(c.hash, c.key) for c in new]))
        if stopped:
            return added
        if tail and n % bs and self._copies_rows():
            key = tuple(tokens[n - n % bs:n])
            block = table.blocks[n // bs]
            # a child that starts with these tokens (a full block, or an earlier tail) serves
            # the same copies already
            if block >= 0 and not any(k[:len(key)] == key for k in node.children):
                node.children[key] = self._new_node(key, node, block, len(key), salt)
                added += 1
        return added

    def _new_node(self, key: tuple[int, ...], parent: _Node, block: int, rows: int, salt: str) -> _Node:
        holder = PagedKVCache(self.pool)
        holder.blocks, holder.length = [block], rows
        self.pool.share([block])
        node = _Node(key, parent, holder, events.block_hash(parent.hash, salt, key))
        node.used = next(self._tick)
        self._nodes.append(node)
        return node

    def evict(self, need: int) -> int:
        """Demote blocks only the tree holds, least recently used first, until `need` blocks
        are free; then keep the tiers within tier_bytes by dropping old leaves. Returns how many
        blocks left the pool."""
        moved = 0
        if need > self.pool.available:
            idle = sorted((n for n in self._nodes if n.block != HOLE and self.pool.refs(n.block) == 1),
                          key=lambda n: n.used)
            for n in idle[: need - self.pool.available]:
                self.tiers.demote(n.holder, 0)
                moved += 1
        self.stats.evictions += moved
        self._trim_tiers()
        return moved

    def _trim_tiers(self) -> None:
        per_block = self.pool.fmt.bytes_per_block()
        excess = self.blocks_tiered - self.tier_bytes // per_block
        if excess <= 0:
            return
        # leaves only (a node's path must stay whole for its children to be found); a parent
        # whose last child went is a leaf for the next round
        while excess > 0:
            leaves = sorted((n for n in self._nodes if n.block == HOLE and not n.children), key=lambda n: n.used)
            if not leaves:
                return
            for n in leaves[:excess]:
                self._drop(n)
                excess -= 1

    def _drop(self, n: _Node) -> None:
        self.tiers.reset(n.holder)  # frees the block or its tiered copy
        del n.parent.children[n.key]
        self._nodes.remove(n)
        self.stats.evictions += 1
        if self.listeners and len(n.key) == self.block_size:  # a tail leaf was never told of
            events.publish(self.listeners, events.BlocksRemoved([n.hash]))

    def clear(self) -> None:
        """Drop every node (their pool references go back)."""
        for n in self._nodes:
            self.tiers.reset(n.holder)
        self._nodes.clear()
        self._roots.clear()
        if self.listeners:
            events.publish(self.listeners, events.CacheCleared())
