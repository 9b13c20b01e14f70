"""The recurrent states the KV manager keeps beside the block tables (kv/states.py), through the manager's
verbs: a state lives and dies with its table, is kept whole for a session's next turn or dropped with the
table's tokens, and is copied with a forked table. (The model's side: tests/engine/test_mamba2.py.)"""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.kv.manager import KVManager
from kvgen.engine.kv.states import StateStore, position_pool
from kvgen.engine.kv.tiers import TieredKV

SHAPES = [(6, 3), (2, 4, 5)]  # a conv state and a scan state, one layer's


@pytest.fixture
def kv():
    pool = position_pool(16, 16 * 64 * 128 / 2**20)  # 64 blocks of 128 bytes
    manager = KVManager(pool, TieredKV(pool), warm_bytes=0)
    manager.states = StateStore(SHAPES)
    return manager


def run(kv: KVManager, table, n: int, fill: float) -> list[torch.Tensor]:
    """What a step does: continue from the state at the table's length, put the state after n tokens, advance."""
    before = kv.states.at(table)
    assert kv.reserve(table, n)
    after = [t + fill for t in before]
    kv.states.put(table, after, table.length + n)
    kv.advance(table, n)
    return after


def test_a_new_table_starts_from_zeros_and_continues_from_its_own_state(kv):
    table = kv.new_table()
    assert all(not t.any() for t in kv.states.at(table)) and [t.shape for t in kv.states.at(table)] == SHAPES
    after = run(kv, table, 20, 1.0)
    assert kv.states.at(table) is after
    assert kv.states.state_bytes() == (18 + 40) * 4 and kv.states.nbytes == kv.states.state_bytes()


def test_a_state_not_at_its_tables_length_is_never_used(kv):
    table = kv.new_table()
    run(kv, table, 20, 1.0)
    table.length += 1  # as if a step had run without its state
    with pytest.raises(RuntimeError, match="no recurrent state at position 21"):
        kv.states.at(table)


@pytest.mark.parametrize("verb", ["release", "preempt", "drop"])
def test_release_preempt_and_drop_free_the_state_with_the_blocks(kv, verb):
    table = kv.new_table()
    run(kv, table, 20, 1.0)
    getattr(kv, verb)(table)
    assert len(kv.states) == 0 and table.length == 0 and kv.used == 0
    assert not kv.states.at(table)[0].any()  # recomputed from its first token


def test_a_sessions_next_turn_keeps_the_state_when_it_extends_the_conversation(kv):
    table = kv.new_table()
    state = run(kv, table, 20, 1.0)
    kv.park(table)
    assert kv.resume(table, 20) == 20 and kv.states.at(table) is state


def test_a_turn_that_rewrites_the_conversation_recomputes_it_from_the_start(kv):
    """A state cannot be rewound: a new prompt sharing 12 of the 20 tokens keeps none of them."""
    table = kv.new_table()
    run(kv, table, 20, 1.0)
    kv.park(table)
    assert kv.resume(table, 12) == 0
    assert table.length == 0 and len(kv.states) == 0 and kv.used == 0


def test_a_context_shift_recomputes_instead_of_dropping_the_middle(kv):
    table = kv.new_table()
    run(kv, table, 64, 1.0)
    kv.park(table)
    assert kv.shift(table, 1, 2) is False
    assert table.length == 0 and len(kv.states) == 0


def test_a_fork_copies_the_state(kv):
    table, child = kv.new_table(), kv.new_table()
    state = run(kv, table, 20, 1.0)
    assert kv.fork(table, child)
    copy = kv.states.at(child)
    assert all(torch.equal(a, b) for a, b in zip(copy, state, strict=True))
    run(kv, child, 1, 5.0)  # the child moves on alone
    assert kv.states.at(table) is state and kv.states.length(child) == 21


def test_past_the_budget_idle_sessions_states_go_least_recently_used_first(kv):
    kv.states.budget_bytes = 2 * kv.states.state_bytes()
    a, b, c = kv.new_table(), kv.new_table(), kv.new_table()
    for t in (a, b):
        run(kv, t, 20, 1.0)
        kv.park(t)
    assert kv.resume(a, 20) == 20  # a's turn: a is the most recently used now
    kv.park(a)
    run(kv, c, 20, 1.0)  # a third state: over the budget once c parks
    kv.park(c)
    assert kv.states.length(b) is None and b.length == 0  # b's next turn recomputes the conversation
    assert kv.states.length(a) == kv.states.length(c) == 20
    assert kv.resume(b, 20) == 0
