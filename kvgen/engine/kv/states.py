"""Recurrent states beside the paged KV: a state-space model (Mamba-2) carries, per sequence, a fixed-size
state (its conv inputs and its scan state, per layer) where an attention model keeps K/V rows. The KV manager
owns the store and keys it by the sequence's block table, so the state lives and dies with the table:
released, preempted or dropped with it, kept with a parked session's (the session's memory across turns),
copied with a forked one.

The table still counts positions (its blocks hold no K/V for such a model: they are what admission and
preemption reserve), and a state is only ever valid at one position: the table's length. A state cannot be
rewound, so a table cut back to fewer tokens than its state has seen loses the state and recomputes from
its start (KVManager.resume / shift ask `restorable`). Past the store's budget, idle sessions' states go
(least recently used first, with their tables' blocks): their next turn recomputes the conversation.
Prefix sharing, which would start a table from another request's blocks without a state, is off for these
models (generator.py says so at start).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.pool import BlockPool


@dataclass(slots=True)
class RecurrentState:
    tensors: list[torch.Tensor]  # the model's state_shapes(), one sequence's
    length: int  # the tokens it has seen: valid for a table of exactly this length

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class StateStore:
    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32,
                 budget_bytes: int | None = None):
        """budget_bytes: past it, idle sessions' states are let go (KVManager.park), least recently used first;
        None: no limit."""
        self.shapes, self.dtype, self.budget_bytes = shapes, dtype, budget_bytes
        # a table that nobody holds any more (a request's that finished outside the manager) takes its state
        # with it; the manager frees the rest explicitly
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def state_bytes(self) -> int:
        """One sequence's state."""
        return sum(torch.Size(s).numel() for s in self.shapes) * torch.finfo(self.dtype).bits // 8

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    @property
    def over_budget(self) -> bool:
        return self.budget_bytes is not None and self.nbytes > self.budget_bytes

    def __len__(self) -> int:
        return len(self._states)

    def at(self, table) -> list[torch.Tensor]:
        """The state at the table's length, to continue from: zeros for an empty table. A state that is not
        at the table's length is a broken invariant (the manager cuts a table only where `restorable` said)."""
        if table.length == 0:
            return [torch.zeros(s, dtype=self.dtype) for s in self.shapes]
        state = self._states.get(table)
        if state is None or state.length != table.length:
            seen = None if state is None else state.length
            raise RuntimeError(f"no recurrent state at position {table.length} (the store has one at {seen})")
        return state.tensors

    def put(self, table, tensors: list[torch.Tensor], length: int) -> None:
        """The state after `length` tokens (the table advances to it once the step is done)."""
        self._states[table] = RecurrentState(tensors, length)

    def length(self, table) -> int | None:
        state = self._states.get(table)
        return None if state is None else state.length

    def restorable(self, table, keep: int) -> int:
        """How many of `keep` tokens a table can keep: all of them where its state is at keep (a session's
        next turn extending the conversation), else none: a state cannot be rewound to an earlier token."""
        state = self._states.get(table)
        return keep if state is not None and state.length == keep else 0

    def free(self, table) -> None:
        self._states.pop(table, None)

    def fork(self, table, child) -> None:
        """child (a parallel sample sharing table's prompt) starts from a copy of table's state."""
        state = self._states.get(table)
        if state is not None:
            self._states[child] = RecurrentState([t.clone() for t in state.tensors], state.length)


# A state model's pool: its blocks hold nothing (one layer, one head of width 1: 128 bytes a block of 16), they
# count each sequence's positions for admission and preemption as an attention model's do. A sixteenth of the
# KV budget in such blocks (4M positions at the default 512 MB) leaves the memory to the states.
POSITION_POOL_SHARE = 16


def position_pool(block_size: int, budget_mb: float) -> BlockPool:
    fmt = make_format("fp32", 1, block_size, 1, 1)
    return BlockPool.from_budget(fmt, budget_mb / POSITION_POOL_SHARE)
