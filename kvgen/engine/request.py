"""One request in flight, as its caller sees it: iterate its events, cancel it, wait until the
engine has let go of its KV blocks.

A Request lives on the event loop that submitted it. The engine thread hands it events with
`loop.call_soon_threadsafe` (delivery.py: a step's events at once), so nothing here ever blocks
the loop: a consumer that stops early only cancels (a flag the engine reads between steps), and
whoever needs the blocks back (a session's next turn) awaits `released()`. Nothing is held while
a client reads.
"""

from __future__ import annotations

import asyncio
from collections import deque

from kvgen.engine import delivery
from kvgen.engine.sequence import Event, Sequence
from kvgen.errors import ClientTooSlow

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


class Request:
    def __init__(self, max_buffered: int, loop: asyncio.AbstractEventLoop | None = None):
        self.seq: Sequence | None = None  # set by the Generator when it submits the request
        self.text = ""  # every text delta so far, read or not (a session's reply)
        self.finished = False  # the last event has arrived (read or not)
        self._cancel = None  # fn(): set with seq
        self._loop = loop or asyncio.get_running_loop()
        self._events: deque[Event] = deque()
        self._max_buffered = max_buffered
        self._overflowed = False
        self._ended = False  # the consumer has been handed the last event
        self._wakeup: asyncio.Future | None = None
        self._released = asyncio.Event()

    def bind(self, seq: Sequence, cancel) -> None:
        self.seq, self._cancel = seq, cancel

    # the caller's side, on the loop

    def __aiter__(self) -> Request:
        return self

    async def __anext__(self) -> Event:
        while not self._events:
            if self._overflowed:
                raise ClientTooSlow(f"more than {self._max_buffered} events went unread; the request was ended")
            if self._ended:
                raise StopAsyncIteration
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        ev = self._events.popleft()
        if ev.finish_reason is not None:
            self._ended = True
            if ev.error is not None:  # the engine step failed
                raise ev.error
        return ev

    async def result(self) -> Event:
        """Every event, added up."""
        out = Event()
        async for ev in self:
            out.add(ev)
        return out

    def cancel(self) -> None:
        """Stop generating (no-op once finished). Returns at once; see released()."""
        if not self.finished and self._cancel is not None:
            self._cancel()

    async def released(self) -> None:
        """Wait until the engine has let go of the request's KV blocks."""
        await self._released.wait()

    # the engine's side: called on the engine thread

    def deliver(self, ev: Event) -> None:
        self._call(self._push, ev)

    def on_release(self) -> None:
        self._call(self._released.set)

    def _call(self, fn, *args) -> None:
        delivery.call(self._loop, fn, *args)  # (held until the end of the engine's step: delivery.py)

    def _push(self, ev: Event) -> None:
        self.text += ev.text
        if ev.finish_reason is not None:
            self.finished = True
            self._cancel = None  # (a closure over the sequence and the Generator: nothing to cancel now)
        if self._overflowed:
            return
        if len(self._events) >= self._max_buffered and ev.finish_reason is None:
            # A reader this slow would make the server hold its whole output: end the request
            # (the engine goes on for everyone else) and tell the reader why.
            self._overflowed = True
            self._events.clear()
            self.cancel()
        else:
            self._events.append(ev)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
