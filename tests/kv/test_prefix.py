"""The prefix cache on a tiny pool (no model): sharing full blocks by their tokens, salts that
never share, eviction down the tiers and back, and random traffic that never leaks a block."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.manager import KVManager
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.prefix import PrefixCache
from kvgen.engine.kv.tiers import HOLE, Tier, TieredKV

BS = 4


def manager(blocks=16, tier_blocks=64, dtype="fp32") -> KVManager:
    pool = BlockPool(make_format(dtype, 2, BS, 1, 8), blocks)
    tiers = TieredKV(pool)
    prefix = PrefixCache(pool, tiers, tier_bytes=tier_blocks * pool.fmt.bytes_per_block())
    return KVManager(pool, tiers, warm_bytes=1 << 30, prefix=prefix)


def written(kv: KVManager, tokens: list[int]):
    """A table whose K/V for `tokens` are written: each position's values derive from its token
    and position, so two tables hold equal bytes exactly when they hold the same prefix."""
    table = kv.new_table()
    assert kv.reserve(table, len(tokens))
    blocks, offsets = table.slots(0, len(tokens))
    x = torch.tensor(tokens, dtype=torch.float32)[:, None, None] * 10 + torch.arange(len(tokens))[:, None, None]
    x = x.expand(-1, 1, 8).contiguous()
    for layer in range(2):
        kv.pool.fmt.write(kv.pool.store, layer, blocks, offsets, x, -x)
    kv.advance(table, len(tokens))
    return table


def read(kv: KVManager, table) -> torch.Tensor:
    n = -(-table.length // BS)
    k, _ = kv.pool.fmt.read(kv.pool.store, 1, torch.tensor(table.blocks[:n]))
    return k.reshape(-1, 1, 8)[: table.length].clone()


def holders(kv: KVManager, tables) -> dict[int, int]:
    """Expected references per block: every table's blocks plus the index's."""
    count: dict[int, int] = {}
    for blocks in [t.blocks for t in tables] + [[n.block] for n in kv.prefix._nodes]:
        for b in blocks:
            if b != HOLE:
                count[b] = count.get(b, 0) + 1
    return count


def test_a_request_reuses_the_full_blocks_of_an_earlier_one():
    kv = manager()
    first = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 more
    t1 = written(kv, first)
    kv.release(t1, salt="", tokens=first)  # indexed, then let go
    # only the index holds them: the 4 full blocks, and the last one's 2 rows for copies
    assert kv.prefix.blocks_held == 5 and kv.pool.used == 5 and kv.used == 0
    t2 = kv.new_table()
    assert kv.share_prefix(t2, "", first[:16] + [99, 98]) == 16
    assert [kv.pool.refs(b) for b in t2.blocks] == [2, 2, 2, 2]
    assert torch.equal(read(kv, t2), read(kv, written(kv, first[:16]))[:16])
    # the whole prompt cached: the last token is still computed (its logits are needed); of the
    # last block, the 3 rows before it are copied into a block of t3's own
    t3 = kv.new_table()
    assert kv.share_prefix(t3, "", first[:16]) == 15
    assert [kv.pool.refs(b) for b in t3.blocks] == [3, 3, 3, 1]
    assert torch.equal(read(kv, t3), read(kv, written(kv, first[:16]))[:15])
    s = kv.prefix.stats
    assert (s.hits, s.misses, s.hit_tokens) == (2, 0, 31)


def test_rows_of_a_partly_matching_block_are_copied_not_shared():
    """A prompt that goes on to match the start of a cached block (a resent chat turn) copies
    those rows into a block of its own, which it then writes on; the cached block is untouched.
    Quantized formats (a block's rows share scales) and a mismatch at the block's first token
    copy nothing."""
    kv = manager()
    first = list(range(1, 13))  # 3 full blocks
    kv.release(written(kv, first), salt="", tokens=first)
    cached = read(kv, written(kv, first))
    t = kv.new_table()
    assert kv.share_prefix(t, "", first[:10] + [77, 78]) == 10  # 2 whole blocks and 2 rows of the third
    assert [kv.pool.refs(b) for b in t.blocks] == [2, 2, 1] and kv.prefix.blocks_held == 3
    assert torch.equal(read(kv, t), cached[:10])
    assert kv.reserve(t, 2)  # writes go on in the copy
    assert kv.share_prefix(kv.new_table(), "", first[:8] + [77, 2, 3]) == 8
    q = manager(dtype="fp8")
    q.release(written(q, first), salt="", tokens=first)
    assert q.share_prefix(q.new_table(), "", first[:10] + [77]) == 8


def test_a_finished_requests_partly_filled_last_block_serves_copies():
    """A chat client's next turn resends the reply, whose end lies in the finished request's
    partly filled last block: those rows are copied, not computed again. Only a finished
    request's (a preempted one comes back to its own), only a plain format's, and never shared:
    the block's rows past the key were never written."""
    kv = manager()
    first = list(range(1, 15))  # 3 full blocks and 2 rows
    t1 = written(kv, first)
    kv.release(t1, salt="", tokens=first)
    assert kv.prefix.blocks_held == 4
    t = kv.new_table()
    assert kv.share_prefix(t, "", first + [50, 51]) == 14  # 3 shared blocks and the 2 rows copied
    assert [kv.pool.refs(b) for b in t.blocks] == [2, 2, 2, 1]
    assert torch.equal(read(kv, t), read(kv, written(kv, first)))
    assert kv.share_prefix(kv.new_table(), "", first[:13] + [9, 9]) == 13  # one of the 2 rows
    # the same tail again, or a tail that a cached child already starts with: nothing new
    kv.release(written(kv, first), salt="", tokens=first)
    kv.release(written(kv, first[:13]), salt="", tokens=first[:13])
    assert kv.prefix.blocks_held == 4
    p = manager()
    p.preempt(written(p, first), salt="", tokens=first)
    assert p.prefix.blocks_held == 3
    q = manager(dtype="fp8")
    q.release(written(q, first), salt="", tokens=first)
    assert q.prefix.blocks_held == 3


def test_different_salts_share_nothing():
    kv = manager()
    tokens = list(range(1, 13))
    kv.release(written(kv, tokens), salt="tenant-a", tokens=tokens)
    assert kv.share_prefix(kv.new_table(), "tenant-b", tokens + [1]) == 0
    assert kv.share_prefix(kv.new_table(), "tenant-a", tokens + [1]) == 12


def test_evicted_blocks_go_down_a_tier_and_come_back_exactly():
    kv = manager(blocks=8)
    tokens = list(range(1, 17))  # 4 blocks
    t = written(kv, tokens)
    before = read(kv, t)
    kv.release(t, salt="", tokens=tokens)
    hog = kv.new_table()
    assert kv.reserve(hog, 8 * BS)  # the whole pool: the index's 4 blocks had to move out
    assert kv.prefix.blocks_tiered == 4 and kv.tiers.nbytes(Tier.WARM) > 0
    kv.release(hog)
    again = kv.new_table()
    assert kv.share_prefix(again, "", tokens + [0]) == 16  # brought back into the pool
    assert kv.prefix.blocks_tiered == 0 and torch.equal(read(kv, again), before)


def test_the_tiers_keep_a_bounded_number_of_old_blocks():
    kv = manager(blocks=8, tier_blocks=2)
    for start in (100, 200, 300):
        tokens = list(range(start, start + 8))  # 2 blocks each
        kv.release(written(kv, tokens), salt="", tokens=tokens)
    assert kv.reserve(kv.new_table(), 8 * BS)
    assert kv.prefix.blocks_tiered <= 2 and kv.prefix.stats.evictions >= 6


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.sampled_from(["finish", "preempt", "hold"]),
                          st.sampled_from(["", "x"])), min_size=1, max_size=25), st.integers(0, 2**31))
def test_random_traffic_keeps_references_exact_and_leaks_nothing(ops, seed):
    """Requests over a few shared prefixes, finishing, preempted or still running; a small pool,
    so blocks are demoted and dropped. Reference counts always equal the holders."""
    rnd = random.Random(seed)
    kv = manager(blocks=12, tier_blocks=6)
    bases = [[rnd.randrange(50) for _ in range(24)] for _ in range(4)]
    running = []
    for base, extra, end, salt in ops:
        tokens = bases[base][: rnd.randrange(1, 24)] + [rnd.randrange(50) for _ in range(extra)]
        table = kv.new_table()
        kv.share_prefix(table, salt, tokens)
        if not kv.reserve(table, len(tokens) - table.length):
            kv.release(table)  # no room: it would wait, holding nothing
            continue
        kv.advance(table, len(tokens) - table.length)
        if end == "finish":
            kv.release(table, salt=salt, tokens=tokens)
        elif end == "preempt":
            kv.preempt(table, salt=salt, tokens=tokens)
        else:
            running.append(table)
        expected = holders(kv, running)
        assert {b: kv.pool.refs(b) for b in expected} == expected
        assert kv.pool.used == len(expected)
        assert kv.used == len(holders(kv, running)) - kv.prefix.blocks_idle
    for table in running:
        kv.release(table)
    kv.prefix.clear()
    assert kv.pool.used == 0 and kv.tiers.nbytes(Tier.WARM) == kv.tiers.nbytes(Tier.COLD) == 0


def test_a_parked_session_is_indexed_and_copies_a_shared_block_before_writing_into_it():
    kv = manager()
    tokens = list(range(1, 13))  # three full blocks
    session = written(kv, tokens)
    kv.park(session, "", tokens)  # the turn is over: its full blocks join the index
    other = kv.new_table()
    assert kv.share_prefix(other, "", tokens + [99]) == 12  # a stateless request reuses them
    before = read(kv, other)
    shared = session.blocks[1]
    assert kv.resume(session, 6) == 6  # the next turn parts from the history inside block 1
    assert session.blocks[1] != shared and kv.pool.refs(session.blocks[1]) == 1  # its own copy
    assert torch.equal(read(kv, session), before[:6])
    x = torch.full((2, 1, 8), -5.0)  # the session writes its new tokens there
    kv.pool.fmt.write(kv.pool.store, 0, torch.tensor([session.blocks[1]] * 2), torch.tensor([2, 3]), x, x)
    kv.pool.fmt.write(kv.pool.store, 1, torch.tensor([session.blocks[1]] * 2), torch.tensor([2, 3]), x, x)
    assert torch.equal(read(kv, other), before)  # what the index shares is untouched
    assert holders(kv, [session, other]) == {b: kv.pool.refs(b) for b in holders(kv, [session, other])}
