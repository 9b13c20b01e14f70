"""KV tracing: a wrapper around a sequence's PagedKVCache that records what happens to its blocks.

The seed's TracingCacheProvider made real for distributed tracing. `TracingCache` delegates
every cache verb to the real cache and notes the ones that matter to an operator (block alloc
and free, append, truncate, preemption, blocks dropped behind a sliding window, prefix hit or
miss, and quantize / demote / promote / prefetch once the cache has them) in a `KVRecord`:
plain data with perf_counter times, no OpenTelemetry. kvgen.service.tracing installs the
wrapper when a traced request is submitted (Engine.on_submit) and turns the record into spans
and span events when the engine lets go of the sequence (Engine.on_release); an untraced
request never sees it.

Per-token work stays cheap: each engine step is one `advance` per sequence, decode steps are
summed rather than listed, and consecutive appends coalesce into one op until another op
(usually the next block's alloc) closes them: about one append per block, not per token or layer.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvgen.engine.kv.formats import KVFormat
from kvgen.engine.kv.paged import PagedKVCache

PLAIN_DTYPES = ("fp32", "fp16", "bf16")
# Cache verbs that don't exist yet (tiers, explicit quantization) are traced when they appear.
FUTURE_VERBS = frozenset({"quantize", "demote", "promote", "prefetch"})
MAX_BLOCK_IDS = 32  # block ids listed per event; the count is always exact
_OWN = frozenset({"inner", "info", "record", "_t_step", "_idle"})  # TracingCache's own attributes


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

    def step(self, t0: float, t1: float, start: int, tokens: int) -> None:
        """This sequence's share of one engine step: `tokens` K/V written from `start`. A prefill
        chunk's append is its own op; decode steps' appends coalesce."""
        if tokens > 1 or start < self.prompt_len:
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


class TracingCache:
    """A PagedKVCache that records into `record` while a request is attached.

    Detached (a session's cache between turns) it keeps its last few ops, which the next turn's
    record adopts: a truncate by the next prompt, an eviction to make room for others.
    """

    def __init__(self, inner: PagedKVCache, info: KVInfo):
        self.inner = inner
        self.info = info
        self.record: KVRecord | None = None
        self._t_step = 0.0
        self._idle: deque[tuple[str, float, dict]] = deque(maxlen=16)

    def attach(self, record: KVRecord) -> None:
        for name, t, kw in self._idle:
            record.op(name, t, **kw)
        self._idle.clear()
        self.record = record

    def detach(self) -> KVRecord | None:
        record, self.record = self.record, None
        if record is not None:
            record.flush()
        return record

    def _op(self, name: str, **kw) -> None:
        if self.record is not None:
            self.record.op(name, **kw)
        else:
            self._idle.append((name, time.perf_counter(), kw))

    # state, delegated

    @property
    def pool(self):
        return self.inner.pool

    @property
    def blocks(self) -> list[int]:
        return self.inner.blocks

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def seq_len(self) -> int:
        return self.inner.length

    @property
    def live_blocks(self) -> list[int]:
        return self.inner.live_blocks

    @property
    def kv_start(self) -> int:
        return self.inner.kv_start

    def held(self) -> list[int]:
        """Blocks this cache holds in the pool (dropped ones are -1 in `blocks`)."""
        return [b for b in self.inner.blocks if b >= 0]

    def blocks_needed(self, n_new: int) -> int:
        return self.inner.blocks_needed(n_new)

    def get(self, layer: int):
        return self.inner.get(layer)

    def __setattr__(self, name: str, value) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:  # state the engine (or a tier manager) sets on the cache belongs to the real one
            setattr(self.inner, name, value)

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in FUTURE_VERBS or not callable(attr):
            return attr

        def traced(*args, **kwargs):
            out = attr(*args, **kwargs)
            lists = (a for a in (out, *args) if isinstance(a, list) and all(isinstance(b, int) for b in a))
            blocks = next(lists, None)
            self._op(f"kv.{name}", blocks=blocks)
            return out

        return traced

    # traced verbs

    def reserve(self, n_new: int) -> None:
        had = len(self.inner.blocks)
        self.inner.reserve(n_new)
        if len(self.inner.blocks) > had:
            self._op("kv.alloc", blocks=self.inner.blocks[had:], tokens=n_new)

    def slots(self, start: int, n: int):
        self._t_step = time.perf_counter()  # the engine asks for slots as it builds the step
        return self.inner.slots(start, n)

    def advance(self, n: int) -> None:
        start = self.inner.length
        self.inner.advance(n)
        if self.record is not None:
            self.record.step(self._t_step or time.perf_counter(), time.perf_counter(), start, n)

    def update(self, layer: int, k, v) -> None:
        """Single-sequence path (the seed's verbs): one step per call on the last layer."""
        if layer == 0:
            self._t_step = time.perf_counter()
        had, start = len(self.inner.blocks), self.inner.length
        self.inner.update(layer, k, v)
        if len(self.inner.blocks) > had:
            self._op("kv.alloc", blocks=self.inner.blocks[had:], tokens=k.shape[0])
        if self.inner.length != start and self.record is not None:
            self.record.step(self._t_step, time.perf_counter(), start, self.inner.length - start)

    def drop_before(self, pos: int) -> list[int]:
        dropped = self.inner.drop_before(pos)
        if dropped:
            self._op("kv.drop", blocks=dropped, before=pos)
        return dropped

    def truncate(self, new_len: int) -> list[int]:
        old = self.inner.length
        freed = self.inner.truncate(new_len)
        if freed or old != self.inner.length:
            self._op("kv.truncate", blocks=freed, tokens_before=old, tokens_after=self.inner.length)
        return freed

    def reset(self) -> None:
        """While a request is attached only the scheduler resets its cache: a preemption.
        Detached, it is a session's cache being evicted or closed."""
        blocks, tokens = self.held(), self.inner.length
        self.inner.reset()
        if self.record is not None:
            self.record.preemptions += 1
            self._op("kv.preempt", blocks=blocks, tokens=tokens)
        elif blocks:
            self._op("kv.evict", blocks=blocks, tokens=tokens)

    def free(self) -> None:
        """The request is over and its blocks go back to the pool."""
        blocks, tokens = self.held(), self.inner.length
        self.inner.free()
        self._op("kv.free", blocks=blocks, tokens=tokens)


def trace_sequence(seq, info: KVInfo, parent=None) -> KVRecord:
    """Install a TracingCache on seq (and on its session, so the session's truncates and
    evictions between turns are seen) and start its record. Call before the engine runs it."""
    cache = seq.cache
    if not isinstance(cache, TracingCache):
        cache = TracingCache(cache, info)
        seq.cache = cache
        if seq.session is not None:
            seq.session.cache = cache
    record = KVRecord(info, seq.seq_id, len(seq.prompt_ids), parent)
    cache.attach(record)
    if seq.cached_tokens:
        held = [b for b in cache.blocks[: -(-seq.cached_tokens // info.block_size)] if b >= 0]
        record.op("kv.prefix_hit", blocks=held, tokens=seq.cached_tokens)
    elif seq.session is not None:
        record.op("kv.prefix_miss", tokens=0)
    return record


def release_sequence(seq) -> KVRecord | None:
    """The engine has let go of seq: detach and return its record (None if it wasn't traced)."""
    cache = seq.cache
    if not isinstance(cache, TracingCache) or cache.record is None:
        return None
    if seq.session is not None and cache.blocks:
        cache.record.op("kv.retain", blocks=cache.held(), tokens=cache.length)
    return cache.detach()
