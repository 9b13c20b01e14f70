"""The prefix cache's events (engine/kv/events.py) as SubscribeKvEvents' KvEventBatch stream.

One batch per event, numbered by the engine's PrefixEventLog. A subscriber whose cursor is not
the log's current number (a new one, start 0, on a cache that already holds blocks; or one
whose history this server does not keep) first gets the live blocks as a one-chunk snapshot
(an AllBlocksCleared, then every block, parents first) numbered at the log's sequence, so the
live events that follow continue it with no gap and no duplicate."""

from __future__ import annotations

import asyncio
import time

from smg_grpc_proto.generated import common_pb2

from kvgen.engine.kv.events import BlocksRemoved, BlocksStored, PrefixEvent, PrefixEventLog

MAX_QUEUED = 65536  # events a slow subscriber may leave unread before its stream is ended


def _stored(ev: BlocksStored, block_size: int) -> common_pb2.KvBlocksStored:
    out = common_pb2.KvBlocksStored(
        blocks=[common_pb2.KvBlock(block_hash=b.hash, token_ids=b.tokens, block_size=block_size)
                for b in ev.blocks])
    if ev.parent is not None:
        out.parent_block_hash = ev.parent
    if ev.salt:
        out.cache_salt = ev.salt
    return out


def to_event(event_id: int, ev: PrefixEvent, block_size: int) -> common_pb2.KvCacheEvent:
    if isinstance(ev, BlocksStored):
        return common_pb2.KvCacheEvent(event_id=event_id, stored=_stored(ev, block_size))
    if isinstance(ev, BlocksRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(block_hashes=ev.hashes))
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


async def stream(log: PrefixEventLog, block_size: int, start: int):
    """KvEventBatch messages from the log until the caller goes away."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    overflow = asyncio.Event()

    def put(item) -> None:
        if queue.qsize() >= MAX_QUEUED:
            overflow.set()
        else:
            queue.put_nowait(item)

    def reader(sequence: int, ev: PrefixEvent) -> None:  # the engine thread
        loop.call_soon_threadsafe(put, (sequence, ev))

    snap = log.subscribe(reader)
    try:
        if snap.sequence and start != snap.sequence:
            events = [common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())]
            events += [to_event(0, ev, block_size) for ev in snap.blocks]
            yield common_pb2.KvEventBatch(
                sequence_number=snap.sequence, timestamp=time.time(), events=events,
                snapshot=common_pb2.KvSnapshotChunk(index=0, count=1, blocks=len(snap.blocks)))
        while True:
            sequence, ev = await queue.get()
            if overflow.is_set():
                return  # the subscriber resubscribes and gets a snapshot
            yield common_pb2.KvEventBatch(sequence_number=sequence, timestamp=time.time(),
                                          events=[to_event(sequence, ev, block_size)])
    finally:
        log.unsubscribe(reader)
