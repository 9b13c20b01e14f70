"""Catch anything that holds the server's event loop: asyncio's debug mode reports every callback
or task step that runs longer than slow_callback_duration ("Executing <Handle ...> took 0.2
seconds"); a blocked loop stalls every client of the server at once.

    with slow_callbacks(server.loop) as slow:   # server: a tests.conftest.ServerThread
        ...traffic...
    assert not slow, slow
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager

THRESHOLD_S = 0.1


class _Collect(logging.Handler):
    def __init__(self, found: list[str]):
        super().__init__(logging.WARNING)
        self.found = found

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Executing"):
            self.found.append(record.getMessage())


def _on_loop(loop: asyncio.AbstractEventLoop, fn) -> None:
    async def call():
        fn()

    asyncio.run_coroutine_threadsafe(call(), loop).result(10)


@contextmanager
def slow_callbacks(loop: asyncio.AbstractEventLoop, threshold_s: float = THRESHOLD_S):
    """Turn on loop's debug mode with a slow-callback threshold; yields the list that collects
    asyncio's reports (one string each) while the block runs."""
    found: list[str] = []
    handler = _Collect(found)
    logger = logging.getLogger("asyncio")
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)

    def enable():
        loop.set_debug(True)
        loop.slow_callback_duration = threshold_s

    _on_loop(loop, enable)
    try:
        yield found
    finally:
        _on_loop(loop, lambda: loop.set_debug(False))
        logger.removeHandler(handler)
        logger.setLevel(level)
