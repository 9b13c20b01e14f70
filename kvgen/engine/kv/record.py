"""A request's KV story for tracing: what happened to its blocks and when, as plain data.

The KV manager tells its listeners what it does to a table (kv/manager.KVEvent: alloc, free,
preempt, retain, truncate, promote, demote, drop, prefix hit or miss); a KVRecorder routes the
events of a traced request's table into that request's KVRecord, and the engine's steps into its
prefill chunks and decode counts. kvgen.service.tracing attaches a record when a traced request
is submitted and turns it into spans and span events when the engine lets go of the request;
an untraced request costs one dict lookup per event.

Per-token work stays cheap: decode steps are summed rather than listed, and consecutive appends
coalesce into one op until another op (usually the next block's alloc) closes them: about one
append per block, not per token or layer.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from kvgen.engine.kv.formats import KVFormat
from kvgen.engine.kv.manager import KVEvent

PLAIN_DTYPES = ("fp32", "fp16", "bf16")
MAX_BLOCK_IDS = 32  # block ids listed per event; the count is always exact
IDLE_OPS = 16  # events kept per idle session table, for its next turn's record


@dataclass(frozen=True, slots=True)
class KVInfo:
    """What every event says about the pool: computed once per pool, not per request."""

    layers: int
    dtype: str
    block_size: int
    block_bytes: int

    @classmethod
    def of(cls, fmt: KVFormat) -> KVInfo:
        return cls(fmt.num_layers, fmt.name, fmt.block_size, fmt.bytes_per_block())

    @property
    def quantized(self) -> bool:
        return self.dtype not in PLAIN_DTYPES


@dataclass(slots=True)
class KVOp:
    name: str  # "kv.alloc", "kv.append", "kv.free", ...
    t: float  # perf_counter
    attrs: dict


@dataclass(slots=True)
class Chunk:
    """One prefill (or recompute) step of this sequence: [t0, t1] covers building the batch and
    the forward pass."""

    t0: float
    t1: float
    start: int  # first position written
    tokens: int
    recompute: bool


@dataclass
class KVRecord:
    """One request's KV operations and engine steps. Written by the engine thread while attached."""

    info: KVInfo
    seq_id: int
    prompt_len: int
    parent: object = None  # whoever traces keeps its context here (an OpenTelemetry Context)
    ops: list[KVOp] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    decode_steps: int = 0
    decode_seconds: float = 0.0  # summed over decode steps
    preemptions: int = 0
    _append: list | None = None  # [t0, t1, start, tokens] of appends not yet closed

    def op(self, name: str, t: float | None = None, blocks: list[int] | None = None, **attrs) -> None:
        self.flush()
        info = self.info
        a = {"kvgen.seq.id": self.seq_id, "kvgen.kv.layers": info.layers, "kvgen.kv.dtype": info.dtype}
        if blocks is not None:
            a["kvgen.kv.blocks"] = len(blocks)
            a["kvgen.kv.bytes"] = len(blocks) * self.info.block_bytes
            a["kvgen.kv.block_ids"] = blocks[:MAX_BLOCK_IDS]
        for k, v in attrs.items():
            a[f"kvgen.kv.{k}"] = v
        self.ops.append(KVOp(name, time.perf_counter() if t is None else t, a))

    def flush(self) -> None:
        """Close the pending append (and its quantize, for quantized formats) into ops."""
        pending, self._append = self._append, None
        if pending is None:
            return
        _, t1, start, tokens = pending
        nbytes = tokens * self.info.block_bytes // self.info.block_size
        for name in ("kv.append", "kv.quantize") if self.info.quantized else ("kv.append",):
            self.op(name, t1, tokens=tokens, start=start, bytes=nbytes)

    def step(self, t0: float, t1: float, start: int, tokens: int, drafted: bool = False) -> None:
        """This sequence's share of one engine step: `tokens` K/V written from `start` (drafted:
        a decode step that also checked a speculative draft). A prefill chunk's append is its
        own op; decode steps' appends coalesce."""
        if (tokens > 1 and not drafted) or start < self.prompt_len:
            self.chunks.append(Chunk(t0, t1, start, tokens, self.preemptions > 0))
            self.flush()
            self._append = [t1, t1, start, tokens]
            self.flush()
            return
        self.decode_steps += 1
        self.decode_seconds += t1 - t0
        if self._append is None:
            self._append = [t1, t1, start, tokens]
        else:
            self._append[1] = t1
            self._append[3] += tokens


class KVRecorder:
    """Routes KV events and engine steps into the records of traced requests. attach() runs on
    the submitting thread before the engine sees the request; everything else on the engine
    thread. Events on a session's table between turns (a demotion to make room, say) are kept
    and handed to the next turn's record."""

    def __init__(self, info: KVInfo):
        self.info = info
        self._records: dict[int, KVRecord] = {}  # id(table) -> the record of the request using it
        self._idle: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # table -> deque of events

    def attach(self, seq, parent=None) -> KVRecord:
        record = KVRecord(self.info, seq.seq_id, len(seq.prompt_ids), parent)
        for ev in self._idle.pop(seq.cache, ()):
            record.op(ev.name, ev.t, ev.blocks, **ev.attrs)
        self._records[id(seq.cache)] = record
        return record

    def detach(self, seq) -> KVRecord | None:
        """The engine let go of seq: its record, complete (None if it wasn't traced)."""
        record = self._records.pop(id(seq.cache), None)
        if record is not None:
            record.flush()
            if seq.keep_kv:  # a session's table: what happens to it until the next turn is kept
                self._idle[seq.cache] = deque(maxlen=IDLE_OPS)
        return record

    def on_event(self, ev: KVEvent) -> None:
        record = self._records.get(id(ev.table))
        if record is None:
            idle = self._idle.get(ev.table)
            if idle is not None:
                idle.append(ev)
            return
        if ev.name == "kv.preempt":
            record.preemptions += 1
        record.op(ev.name, ev.t, ev.blocks, **ev.attrs)

    def on_step(self, batch, seconds: float) -> None:
        """After a forward pass: each traced sequence's share of it (its K/V just advanced)."""
        if not self._records:
            return
        t1 = time.perf_counter()
        for seq, n in batch:
            record = self._records.get(id(seq.cache))
            if record is not None:
                record.step(t1 - seconds, t1, seq.cache.length - n, n, bool(seq.draft))
