"""Run the async API for synchronous callers (scripts, tests, benchmarks): one event loop on a
thread of its own, started on first use. Its thread only tokenizes and waits, never runs torch
ops, so it adds no OpenMP pool (threads.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator


class Bridge:
    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="kvgen-bridge", daemon=True).start()
            return self._loop

    def run(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator) -> Iterator:
        """A synchronous iterator over an async one; leaving early closes it (which cancels)."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(agen.aclose())

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
