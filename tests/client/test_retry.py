"""Retries of UNAVAILABLE for calls that never started, against real grpc.aio servers on loopback:
FlakyServer fails the first calls as told and counts what reached it; nothing is mocked."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from google.rpc import code_pb2

from kvgen.client import (
    NO_RETRY,
    AsyncClient,
    Client,
    FinishReason,
    ResourceExhausted,
    Retry,
    Unavailable,
    session_lost,
)
from tests.client.conftest import FlakyServer, unavailable
from tests.conftest import free_port

FAST = Retry(attempts=4, initial_backoff=0.01, max_backoff=0.05)


def test_a_unary_call_is_retried_until_it_gets_through(flaky):
    flaky.script.fail = 2
    with Client(flaky.target, retry=FAST) as c:
        done = c.generate("hi")
    assert done.text == "ok" and done.finish_reason == FinishReason.LENGTH
    assert len(flaky.script.seen) == 3


def test_attempts_are_bounded(flaky):
    flaky.script.fail = 100
    with Client(flaky.target, retry=FAST) as c, pytest.raises(Unavailable) as e:
        c.generate("hi")
    assert len(flaky.script.seen) == 4 and e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert session_lost(e.value) and isinstance(e.value, grpc.RpcError)
    flaky.script.seen.clear()
    with Client(flaky.target, retry=NO_RETRY) as c, pytest.raises(Unavailable):
        c.generate("hi")
    assert len(flaky.script.seen) == 1


def test_retry_info_is_honoured_and_the_deadline_bounds_the_waits(flaky):
    flaky.script.fail, flaky.script.status = 1, unavailable(retry_after=0.3)
    with Client(flaky.target, retry=FAST) as c:
        t = time.monotonic()
        assert c.generate("hi").text == "ok"
        assert time.monotonic() - t >= 0.3  # the server's delay, not FAST's 10 ms
        flaky.script.seen.clear()
        flaky.script.fail, flaky.script.status = 100, unavailable(retry_after=5.0)
        t = time.monotonic()
        with pytest.raises(Unavailable) as e:
            c.generate("hi", timeout=1.0)  # a 5 s wait would end past the deadline: no retry
    assert time.monotonic() - t < 1.0 and len(flaky.script.seen) == 1 and e.value.retry_delay == 5.0


def test_other_codes_are_never_retried(flaky):
    flaky.script.fail, flaky.script.status = 1, unavailable(retry_after=0.25, code=code_pb2.RESOURCE_EXHAUSTED)
    with Client(flaky.target, retry=FAST) as c, pytest.raises(ResourceExhausted) as e:
        c.generate("hi")
    assert len(flaky.script.seen) == 1 and e.value.retry_delay == 0.25  # for the caller to decide


def test_a_stream_is_retried_only_before_its_first_message(flaky):
    flaky.script.fail = 2  # refused before any message: retried
    with Client(flaky.target, retry=FAST) as c:
        deltas = list(c.stream("hi"))
        assert [d.text for d in deltas] == ["t0", "t1", "t2", ""] and deltas[-1].usage.completion_tokens == 3
        assert len(flaky.script.seen) == 3
        flaky.script.seen.clear()
        flaky.script.fail, flaky.script.sent = 100, 1  # a token delivered, then UNAVAILABLE: raised
        stream = c.stream("hi")
        assert next(stream).text == "t0"
        with pytest.raises(Unavailable):
            next(stream)
    assert len(flaky.script.seen) == 1


def test_the_async_client_retries_the_same_way(flaky):
    async def main():
        async with AsyncClient(flaky.target, retry=FAST) as c:
            flaky.script.fail = 2
            assert (await c.generate("hi")).text == "ok"
            n_unary = len(flaky.script.seen)
            flaky.script.seen.clear()
            deltas = [d async for d in c.stream("hi")]  # two refusals, then the stream
            n_stream = len(flaky.script.seen)
            flaky.script.seen.clear()
            flaky.script.fail, flaky.script.sent = 100, 2
            got = []
            with pytest.raises(Unavailable):
                async for d in c.stream("hi"):
                    got.append(d.text)
            return n_unary, n_stream, deltas, got

    n_unary, n_stream, deltas, got = asyncio.run(main())
    assert (n_unary, n_stream, len(deltas), got) == (3, 3, 4, ["t0", "t1"])
    assert len(flaky.script.seen) == 1


def test_a_call_made_before_the_server_listens_gets_through():
    """The first tries find nothing on the port (connection refused: UNAVAILABLE); the server
    comes up 0.5 s later. (Enough tries to outlast the channel's own reconnect backoff, which
    grows from 0.1 s: a try between two reconnects fails at once.)"""
    server = FlakyServer(free_port())
    try:
        threading.Timer(0.5, server.start).start()
        with Client(server.target, retry=Retry(attempts=10, initial_backoff=0.1, max_backoff=0.5)) as c:
            t = time.monotonic()
            assert c.open_session("early").session_id == "early"
        assert time.monotonic() - t >= 0.4 and len(server.script.seen) == 1
    finally:
        server.stop()


def test_metadata_goes_with_every_try(flaky):
    flaky.script.fail = 1
    with Client(flaky.target, api_key="k-1", retry=FAST) as c:
        c.generate("hi", session_id="s-9")
        with c.session("s-10") as s:
            assert s.id == "s-10"
    first, second, opened = flaky.script.seen[:3]
    assert first["authorization"] == second["authorization"] == opened["authorization"] == "Bearer k-1"
    assert (first["x-session-id"], second["x-session-id"], opened["x-session-id"]) == ("s-9", "s-9", "s-10")


def test_backoff_grows_with_jitter_and_is_capped():
    p = Retry(initial_backoff=0.2, max_backoff=1.0, multiplier=2.0, jitter=0.5)
    for n, full in ((1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (9, 1.0)):
        waits = [p.backoff(n) for _ in range(200)]
        assert all(full * 0.5 <= w <= full for w in waits) and max(waits) - min(waits) > 0
    assert p.backoff(1, server_delay=3.0) == 3.0
    with pytest.raises(ValueError):
        Retry(attempts=0)
