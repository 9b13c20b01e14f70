"""How the engine thread hands calls to its callers' event loops (a Request's events, its release).

`call(loop, fn, *args)` is `loop.call_soon_threadsafe(fn, *args)`, but inside batched_delivery (the
engine wraps each step in it) the calls are held and handed to each loop as one callback when the step
ends, in order: call_soon_threadsafe wakes the loop through its self-pipe, a system call of ~10 us,
and one a token was a third of the host's time in a 256-stream step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

log = logging.getLogger("kvgen.engine")
_held = threading.local()  # .calls: loop -> [(fn, args)] while this thread is inside batched_delivery


def call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on loop, now or (inside batched_delivery on this thread) when the step ends; nothing
    when the loop is closed (nobody is listening any more)."""
    calls = getattr(_held, "calls", None)
    if calls is not None:
        calls.setdefault(loop, []).append((fn, args))
        return
    _send(loop, fn, *args)


@contextlib.contextmanager
def batched_delivery():
    """Within it, this thread's calls are held, and handed to each loop as one callback when it ends."""
    calls: dict[asyncio.AbstractEventLoop, list] = {}
    _held.calls = calls
    try:
        yield
    finally:
        _held.calls = None
        for loop, batch in calls.items():
            _send(loop, _run_all, batch)


def _send(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        pass


def _run_all(batch: list) -> None:
    for fn, args in batch:
        try:
            fn(*args)
        except Exception:  # one request's failure must not keep the others' events back
            log.exception("delivering an engine event failed")
