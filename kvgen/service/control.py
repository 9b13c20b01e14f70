"""The control plane's Abort: requests running on this server, found by request_id from any
channel, ended with CANCELLED.

A request is tracked from submission until its caller lets go of it, under the API key that
sent it (a digest; "" without keys), so one tenant can never end another's requests: to the
other tenant such an id is just unknown. Request ids are the client's to choose, so one id may
name several requests; Abort ends them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from kvgen.engine.request import Request
from kvgen.errors import InvalidRequest
from kvgen.service.convert import MAX_ID_CHARS
from kvgen.service.errors import clip

MAX_ABORT_IDS = 1024  # request ids in one Abort
RELEASE_WAIT_S = 10.0  # an Abort answers once the engine let go of the blocks, or after this


class InFlight:
    def __init__(self):
        self._running: dict[tuple[str, str], list[Request]] = {}
        self._aborted: set[Request] = set()

    @contextmanager
    def track(self, key: str, request_id: str, request: Request) -> Iterator[None]:
        """While the caller reads request, Abort can find it by (key, request_id)."""
        slot = (key, request_id)
        self._running.setdefault(slot, []).append(request)
        try:
            yield
        finally:
            same = self._running.get(slot, [])
            if request in same:
                same.remove(request)
            if not same:
                self._running.pop(slot, None)
            self._aborted.discard(request)

    def was_aborted(self, request: Request) -> bool:
        return request in self._aborted

    async def abort(self, key: str, request_ids: list[str]) -> tuple[list[str], list[str]]:
        """Cancel the caller's running requests with these ids; returns (aborted, unknown) once
        the aborted ones' KV blocks are back in the pool (the engine frees them at its next step)."""
        aborted, unknown, ended = [], [], []
        for rid in dict.fromkeys(request_ids):  # each id once, in the order given
            live = [r for r in self._running.get((key, rid), ()) if not r.finished]
            if not live:
                unknown.append(rid)
                continue
            for r in live:
                self._aborted.add(r)
                r.cancel()
            ended += live
            aborted.append(rid)
        if ended:
            await asyncio.wait_for(asyncio.gather(*(r.released() for r in ended)), RELEASE_WAIT_S)
        return aborted, unknown


def check_abort(req, settings=None) -> None:
    """An AbortRequest names at least one id, at most MAX_ABORT_IDS, none over MAX_ID_CHARS."""
    ids = list(req.request_ids)
    if not ids:
        raise InvalidRequest([("request_ids", "name at least one request id")])
    if len(ids) > MAX_ABORT_IDS:
        raise InvalidRequest([("request_ids", f"{len(ids)} ids; at most {MAX_ABORT_IDS} are accepted")])
    bad = [(f"request_ids[{i}]", f"{clip(r)!r} is {len(r)} characters; at most {MAX_ID_CHARS}")
           for i, r in enumerate(ids) if len(r) > MAX_ID_CHARS]
    if bad:
        raise InvalidRequest(bad[:8])
