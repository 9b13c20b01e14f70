"""What the prefix cache tells listeners: full blocks it starts to hold, blocks it lets go of,
and a wholesale clear, each block named by a chain hash of its tokens (a router that keeps a
prefix index per replica rebuilds it from these, the way vLLM's KV events feed one).

A block's hash covers its parent's hash and its own tokens, so equal hashes mean equal whole
prefixes; a tree's first block hashes its `cache_salt` in instead of a parent. Only full blocks
are told of: a finished request's partly filled tail (prefix.py) is never shared whole.

Listeners run on the engine thread, inside the prefix cache's own bookkeeping: they must be
quick and must not call back into the engine. PrefixEventLog is one that numbers the events
and keeps the blocks they leave live, so a reader that joins late starts from a snapshot.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvgen.engine")


def block_hash(parent: int | None, salt: str, tokens: tuple[int, ...]) -> int:
    """A signed 64-bit hash of the block's tokens after its parent (None: a tree's first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", parent) if parent is not None else b"salt:" + salt.encode())
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    hash: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A chain of new blocks, each the next one's parent; the first's parent is `parent` (None:
    the tree's root)."""

    salt: str
    parent: int | None
    blocks: list[StoredBlock]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    hashes: list[int]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    pass


PrefixEvent = BlocksStored | BlocksRemoved | CacheCleared
PrefixListener = Callable[[PrefixEvent], None]


def publish(listeners: list[PrefixListener], event: PrefixEvent) -> None:
    """Hand event to each listener; one that fails is logged, never allowed to break the cache."""
    for fn in listeners:
        try:
            fn(event)
        except Exception:
            log.exception("prefix cache listener %s failed", getattr(fn, "__qualname__", fn))


@dataclass(slots=True)
class _Live:
    parent: int | None
    salt: str
    tokens: tuple[int, ...]


@dataclass(slots=True)
class Snapshot:
    """The live blocks after event `sequence`, parents before children."""

    sequence: int
    blocks: list[BlocksStored] = field(default_factory=list)


class PrefixEventLog:
    """A prefix-cache listener that numbers events from 1 and keeps the live blocks; readers
    subscribe with a callback that gets (sequence, event) for every later event, on the engine
    thread, in order. subscribe() returns the snapshot the callback continues from, with no gap
    and no duplicate."""

    def __init__(self):
        self._lock = threading.Lock()
        self.sequence = 0
        self._live: dict[int, _Live] = {}  # by hash; insertion order keeps parents first
        self._readers: list[Callable[[int, PrefixEvent], None]] = []

    def __call__(self, event: PrefixEvent) -> None:
        with self._lock:  # held while readers are told, so none sees events out of order
            self.sequence += 1
            if isinstance(event, BlocksStored):
                parent = event.parent
                for b in event.blocks:
                    self._live[b.hash] = _Live(parent, event.salt, b.tokens)
                    parent = b.hash
            elif isinstance(event, BlocksRemoved):
                for h in event.hashes:
                    self._live.pop(h, None)
            else:
                self._live.clear()
            for reader in list(self._readers):
                try:
                    reader(self.sequence, event)
                except Exception:
                    log.exception("prefix event reader failed")

    def live_hashes(self) -> set[int]:
        with self._lock:
            return set(self._live)

    def subscribe(self, reader: Callable[[int, PrefixEvent], None]) -> Snapshot:
        with self._lock:
            self._readers.append(reader)
            return Snapshot(self.sequence, [BlocksStored(b.salt, b.parent, [StoredBlock(h, b.tokens)])
                                            for h, b in self._live.items()])

    def unsubscribe(self, reader) -> None:
        with self._lock:
            if reader in self._readers:
                self._readers.remove(reader)
