"""Liveness: the health name "kvgen.liveness" says whether this process still works, apart from
readiness ("" and the service's name, NOT_SERVING while loading and draining). A watchdog on
the event loop turns it NOT_SERVING when the engine thread has made no progress on pending work
for LIVENESS_STALL_S, and logs a stack dump of every thread once per stall, which is what an
operator needs to see why. If the event loop itself is wedged, the probe goes unanswered, which
a liveness probe reads as a failure too."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback

from grpc_health.v1 import health_pb2

LIVENESS = "kvgen.liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

log = logging.getLogger("kvgen.liveness")


def thread_stacks() -> str:
    """Every thread's current stack, named: a picture of where a stalled process is stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """Polls stalled_s() (seconds without progress while work is pending; 0 when idle) and keeps
    the liveness status in step with it."""

    def __init__(self, health, stalled_s, stall_limit_s: float, poll_s: float = 1.0):
        self.health = health  # grpc_health's aio HealthServicer
        self.stalled_s = stalled_s
        self.stall_limit_s = stall_limit_s
        self.poll_s = min(poll_s, stall_limit_s / 2)  # so a stall is seen within 1.5 x the limit
        self.stalled = False

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)

    async def check(self) -> None:
        stalled_for = self.stalled_s()
        if stalled_for > self.stall_limit_s and not self.stalled:
            self.stalled = True
            await self.health.set(LIVENESS, NOT_SERVING)
            log.error("engine stalled: no progress on pending work for %.1fs (limit %.1fs); liveness "
                      "NOT_SERVING. Threads:\n%s", stalled_for, self.stall_limit_s, thread_stacks())
        elif stalled_for <= self.stall_limit_s and self.stalled:
            self.stalled = False
            await self.health.set(LIVENESS, SERVING)
            log.warning("engine progressing again; liveness SERVING")
