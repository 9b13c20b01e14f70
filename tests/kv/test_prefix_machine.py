"""A hypothesis state machine over the KV manager with the prefix cache: requests over shared
prefixes, finishing and preempted; n-sample forks; sessions parked (indexed), resumed at any
point (copy on write inside a shared block) and context-shifted; a hog that forces demotions to
the tiers and back.
After every step, reference counts equal the holders (tables and index nodes), the pool counts
exactly the held blocks, and every table in the pool reads back exactly the values written for
its positions (nothing shared was overwritten, nothing moved wrongly)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.manager import KVManager
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.prefix import PrefixCache
from kvgen.engine.kv.tiers import HOLE, Tier, TieredKV

BS = 4
BASES = [[(7 * b + 3 * i) % 40 + 1 for i in range(40)] for b in range(3)]


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        pool = BlockPool(make_format("fp32", 1, BS, 1, 2), 24)
        tiers = TieredKV(pool)
        # keys moved by a context shift keep their values (no rotation): the check stays exact
        self.kv = KVManager(pool, tiers, warm_bytes=1 << 30,
                            prefix=PrefixCache(pool, tiers, tier_bytes=8 * pool.fmt.bytes_per_block()),
                            shift_keys=lambda k, delta: k)
        self.tick = 0
        self.running: list[tuple] = []  # (table, tokens, values)
        self.sessions: list[tuple] = []  # parked (table, tokens, values)

    # ---- helpers ----

    def _write(self, table, tokens, values, start: int) -> bool:
        """Reserve and write tokens[start:] at their positions; values get a fresh number each."""
        n = len(tokens) - start
        if n <= 0:
            return True
        if not self.kv.reserve(table, n):
            return False
        blocks, offsets = table.slots(start, n)
        new = []
        for _ in range(n):
            self.tick += 1
            new.append(float(self.tick))
        x = torch.tensor(new)[:, None, None].expand(n, 1, 2).contiguous()
        self.kv.pool.fmt.write(self.kv.pool.store, 0, blocks, offsets, x, -x)
        del values[start:]
        values.extend(new)
        self.kv.advance(table, n)
        return True

    def _shared_values(self, table, tokens) -> list[float]:
        """Values read back for what the prefix cache gave the table."""
        if not table.length:
            return []
        k, _ = self.kv.pool.fmt.read(self.kv.pool.store, 0, torch.tensor(table.blocks))
        return k[..., 0, 0].reshape(-1)[:table.length].tolist()

    # ---- rules ----

    @rule(base=st.integers(0, 2), cut=st.integers(1, 40), extra=st.integers(0, 9))
    def request(self, base, cut, extra):
        tokens = BASES[base][:cut] + [90 + i for i in range(extra)]
        table = self.kv.new_table()
        self.kv.share_prefix(table, "", tokens)
        values = self._shared_values(table, tokens)
        if not self._write(table, tokens, values, table.length):
            self.kv.release(table)
            return
        self.running.append((table, tokens, values))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), how=st.sampled_from(["finish", "preempt", "park"]))
    def end(self, i, how):
        table, tokens, values = self.running.pop(i % len(self.running))
        if how == "finish":
            self.kv.release(table, "", tokens)
        elif how == "preempt":
            self.kv.preempt(table, "", tokens)
        else:
            self.kv.park(table, "", tokens)
            self.sessions.append((table, tokens, values))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), extra=st.integers(1, 6))
    def fork(self, i, extra):
        table, tokens, values = self.running[i % len(self.running)]
        child = self.kv.new_table()
        if not self.kv.fork(table, child):
            return
        more = tokens + [80 + j for j in range(extra)]
        vals = list(values)
        if self._write(child, more, vals, child.length):
            self.running.append((child, more, vals))
        else:
            self.kv.release(child)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 99), keep=st.integers(0, 40), extra=st.integers(1, 6))
    def resume(self, i, keep, extra):
        table, tokens, values = self.sessions.pop(i % len(self.sessions))
        self._next_turn(table, tokens, values, min(keep, table.length), [70 + j for j in range(extra)])

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 99), keep=st.integers(0, 3), drop=st.integers(1, 4), extra=st.integers(1, 6))
    def shift(self, i, keep, drop, extra):
        """A turn that outgrew the context, as the scheduler admits it: shift, then resume."""
        table, tokens, values = self.sessions.pop(i % len(self.sessions))
        if self.kv.shift(table, keep, drop):  # moved up: the dropped blocks' positions are gone
            cut = slice(keep * BS, (keep + drop) * BS)
            del tokens[cut]
            del values[cut]
        self._next_turn(table, tokens, values, table.length, [60 + j for j in range(extra)])

    def _next_turn(self, table, tokens, values, keep: int, new: list[int]) -> None:
        """Resume a parked session keeping `keep` tokens, then write the turn's new ones."""
        kept = self.kv.resume(table, keep)
        more, vals = tokens[:kept] + new, values[:kept]
        if not self._write(table, more, vals, kept):
            self.kv.drop(table)
            return
        self.running.append((table, more, vals))

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 99))
    def close(self, i):
        table, _, _ = self.sessions.pop(i % len(self.sessions))
        self.kv.drop(table)

    @rule()
    def hog(self):
        """A request wanting most of the pool: idle index blocks and parked sessions move down."""
        table = self.kv.new_table()
        if self.kv.reserve(table, 16 * BS):
            self.kv.release(table)

    # ---- invariants ----

    def _holders(self) -> dict[int, int]:
        count: dict[int, int] = {}
        tables = [t for t, _, _ in self.running + self.sessions]
        for blocks in [t.blocks for t in tables] + [[n.block] for n in self.kv.prefix._nodes]:
            for b in blocks:
                if b >= 0 and b != HOLE:
                    count[b] = count.get(b, 0) + 1
        return count

    @invariant()
    def references_equal_holders(self):
        held = self._holders()
        assert {b: self.kv.pool.refs(b) for b in held} == held
        assert self.kv.pool.used == len(held)

    @invariant()
    def tables_read_back_what_was_written(self):
        for table, _, values in self.running + [s for s in self.sessions if not self.kv.tiers.parked(s[0])]:
            assert table.length == len(values)
            assert self._shared_values(table, None) == values

    def teardown(self):
        for table, tokens, _ in self.running:
            self.kv.release(table, "", tokens)
        for table, _, _ in self.sessions:
            self.kv.drop(table)
        self.kv.prefix.clear()
        assert self.kv.pool.used == 0
        assert self.kv.tiers.nbytes(Tier.WARM) == self.kv.tiers.nbytes(Tier.COLD) == 0


PrefixMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_prefix_cache_state_machine = PrefixMachine.TestCase
