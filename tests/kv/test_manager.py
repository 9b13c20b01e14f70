"""The KV manager's verbs on a tiny pool (no model), and the events they tell listeners, as a
traced request's KVRecord sees them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.manager import KVManager
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.record import KVInfo, KVRecorder
from kvgen.engine.kv.tiers import Tier, TieredKV
from kvgen.engine.scheduler import Scheduler

BS = 4  # tokens per block


def manager(dtype="fp32", blocks=8, warm_bytes=1 << 30) -> tuple[KVManager, KVRecorder]:
    pool = BlockPool(make_format(dtype, 2, BS, 1, 8), blocks)
    kv = KVManager(pool, TieredKV(pool), warm_bytes)
    rec = KVRecorder(KVInfo.of(pool.fmt))
    kv.listen(rec.on_event)
    return kv, rec


def seq(kv: KVManager, seq_id: int, prompt_len: int, table=None):
    return SimpleNamespace(seq_id=seq_id, prompt_ids=[0] * prompt_len, cache=table or kv.new_table(),
                           cached_tokens=0, preemptions=0, keep_kv=True, draft=[], cut_draft=lambda keep: None)


def run(kv: KVManager, rec: KVRecorder, s, n: int, oldest_needed: int = 0) -> None:
    """One engine step's worth for s: reserve, write n tokens, record the step."""
    assert kv.reserve(s.cache, n)
    kv.advance(s.cache, n, oldest_needed)
    rec.on_step([(s, n)], 0.001)


def fill(kv: KVManager, table, n: int, value: float) -> None:
    """Write n tokens of recognisable K/V into the table's blocks (what a forward pass does)."""
    fmt, store = kv.pool.fmt, kv.pool.store
    start = table.length
    assert kv.reserve(table, n)
    blocks, offsets = table.slots(start, n)
    x = torch.full((n, 1, 8), value) + torch.arange(start, start + n).float()[:, None, None]
    for layer in range(fmt.num_layers):
        fmt.write(store, layer, blocks, offsets, x, -x)
    kv.advance(table, n)


def read(kv: KVManager, table) -> torch.Tensor:
    n_blocks = -(-table.length // BS)
    k, _ = kv.pool.fmt.read(kv.pool.store, 1, torch.tensor(table.blocks[:n_blocks]))
    return k.reshape(-1, 1, 8)[: table.length].clone()


def test_block_ops_are_recorded_and_appends_coalesce():
    kv, rec = manager()
    s = seq(kv, 7, prompt_len=6)
    record = rec.attach(s)
    run(kv, rec, s, 6)  # prefill: 2 blocks
    for _ in range(7):  # decode: 2 more blocks
        run(kv, rec, s, 1)
    kv.park(s.cache)  # a session's turn ends
    assert kv.resume(s.cache, 5) == 5  # the next prompt shares 5 tokens
    kv.release(s.cache)
    assert rec.detach(s) is record
    assert [op.name for op in record.ops] == [
        "kv.alloc", "kv.append", "kv.append", "kv.alloc", "kv.append", "kv.alloc", "kv.append",
        "kv.retain", "kv.truncate", "kv.prefix_hit", "kv.free"]
    # the prefill chunk's append on its own, then decode appends coalesced until the next block
    assert [op.attrs.get("kvgen.kv.tokens") for op in record.ops if op.name == "kv.append"] == [6, 2, 4, 1]
    assert [c.tokens for c in record.chunks] == [6] and record.decode_steps == 7
    trunc, hit, free = record.ops[-3:]
    assert trunc.attrs["kvgen.kv.blocks"] == 2 and trunc.attrs["kvgen.kv.tokens_after"] == 5
    assert hit.attrs["kvgen.kv.tokens"] == 5
    assert free.attrs["kvgen.kv.blocks"] == 2 and len(free.attrs["kvgen.kv.block_ids"]) == 2
    assert free.attrs["kvgen.kv.bytes"] == 2 * kv.pool.fmt.bytes_per_block()
    assert all(op.attrs["kvgen.seq.id"] == 7 and op.attrs["kvgen.kv.layers"] == 2 for op in record.ops)
    assert kv.used == 0


def test_preemption_quantize_and_the_ops_of_an_idle_table():
    kv, rec = manager("fp8")
    s = seq(kv, 1, prompt_len=3)
    record = rec.attach(s)
    run(kv, rec, s, 3)
    sched = Scheduler(kv)
    sched.running.append(s)
    sched.preempt(s)
    assert [op.name for op in record.ops] == ["kv.alloc", "kv.append", "kv.quantize", "kv.preempt"]
    assert record.ops[2].attrs["kvgen.kv.dtype"] == "fp8" and record.preemptions == 1
    assert sched.waiting[0] is s and s.preemptions == 1 and kv.used == 0
    # detached (a session between turns): what happens to its table waits for the next turn's record
    rec.detach(s)
    assert kv.reserve(s.cache, 2)
    kv.advance(s.cache, 2)
    kv.drop(s.cache)
    nxt = rec.attach(seq(kv, 2, 1, table=s.cache))
    assert [op.name for op in nxt.ops] == ["kv.alloc", "kv.evict"]


def test_blocks_behind_a_sliding_window_are_dropped():
    kv, rec = manager()
    s = seq(kv, 3, prompt_len=12)
    record = rec.attach(s)
    run(kv, rec, s, 12, oldest_needed=9)
    assert s.cache.kv_start == 8 and len(s.cache.live_blocks) == 1
    kv.release(s.cache)
    assert [op.name for op in record.ops] == ["kv.alloc", "kv.drop", "kv.append", "kv.free"]
    _, drop, _, free = record.ops
    assert (drop.name, drop.attrs["kvgen.kv.blocks"], drop.attrs["kvgen.kv.before"]) == ("kv.drop", 2, 9)
    assert (free.name, free.attrs["kvgen.kv.blocks"]) == ("kv.free", 1)
    assert kv.used == 0


def test_an_untraced_sequence_has_no_record():
    kv, rec = manager()
    assert rec.detach(seq(kv, 4, 1)) is None


def test_idle_sessions_make_room_and_resume_exactly():
    """A pool of 8 blocks: an idle session holding 5 gives way to a request needing 6; its blocks
    go warm (or cold past the warm budget) and its next turn gets them back bit for bit."""
    for warm_bytes, tier in ((1 << 30, Tier.WARM), (0, Tier.COLD)):
        kv, _ = manager(warm_bytes=warm_bytes)
        session = kv.new_table()
        fill(kv, session, 18, 1.0)  # 5 blocks
        before = read(kv, session)
        kv.park(session)
        running = kv.new_table()
        assert kv.reserve(running, 6 * BS)  # 6 blocks: 3 of the session's had to move
        assert kv.tiers.parked(session) == 3 and {kv.tiers.tier(session, i) for i in range(3)} == {tier}
        assert not kv.reserve(kv.new_table(), 5 * BS)  # nothing idle is left to move
        kv.release(running)
        assert kv.resume(session, 18) == 18
        assert kv.tiers.parked(session) == 0 and torch.equal(read(kv, session), before)
        kv.park(session)
        kv.drop(session)
        assert kv.used == 0 and kv.tier_bytes(Tier.WARM) == kv.tier_bytes(Tier.COLD) == 0
        kv.tiers.close()


def test_a_running_table_is_never_demoted():
    kv, _ = manager()
    busy = kv.new_table()
    fill(kv, busy, 5 * BS, 1.0)  # not parked: a turn is using it
    assert not kv.reserve(kv.new_table(), 4 * BS)
    assert kv.tiers.parked(busy) == 0 and kv.used == 5


def test_resume_without_room_recomputes():
    """The blocks of an idle session went down a tier, and the pool is full when its next turn
    comes: the turn starts from nothing (recomputes), nothing waits forever."""
    kv, _ = manager()
    session = kv.new_table()
    fill(kv, session, 4 * BS, 1.0)
    kv.park(session)
    hog = kv.new_table()
    assert kv.reserve(hog, 8 * BS)
    assert kv.tiers.parked(session) == 4
    assert kv.resume(session, 4 * BS) == 0 and kv.tiers.parked(session) == 0
    kv.release(hog)
    assert kv.used == 0


def test_a_turn_that_ends_after_its_session_closed_keeps_nothing():
    """The close reached the engine first (it came from another thread than the turn): the
    turn still runs, and its blocks go back when it ends instead of being parked for nobody."""
    kv, _ = manager()
    session = kv.new_table()
    fill(kv, session, 2 * BS, 1.0)
    kv.park(session)
    kv.drop(session)
    assert kv.used == 0
    assert kv.resume(session, 0) == 0
    fill(kv, session, 3 * BS, 2.0)  # the late turn
    kv.park(session)
    assert kv.used == 0 and kv.pool.used == 0
