"""Nothing blocks the server's event loop: with asyncio's debug mode on and a 100 ms threshold,
the service's traffic of every kind (unary, streams, cancels, deadlines, batches, session turns,
a cancelled turn and the turn after it) never holds the loop."""

from __future__ import annotations

import gc
import time

import grpc
import pytest

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

from .loopwatch import slow_callbacks


def _until(ok, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def _handled(server) -> float:
    """RPCs the server has finished with, cleanup included (its interceptor counts each at the end)."""
    return sum(s.value for m in server.server.metrics.handled.collect() for s in m.samples
               if s.name.endswith("_total"))


def _settled(server, before: float, rpcs: int) -> None:
    """Until the server is done with `rpcs` more calls than `before` and the engine with their requests."""
    _until(lambda: _handled(server) >= before + rpcs, f"{rpcs} calls handled")
    _until(lambda: server.gen.engine.idle and server.gen.scheduler.kv.used == 0, "the engine idle")


@pytest.fixture(scope="module")
def watched(start_server):
    """A tiny-model server whose loop runs in debug mode; the test says what traffic it gets."""
    return start_server()


def test_the_watch_sees_a_blocking_callback(watched):
    """The helper itself: a callback that sleeps on the loop is reported."""
    with slow_callbacks(watched.loop) as slow:
        watched.loop.call_soon_threadsafe(time.sleep, 0.25)
        _until(lambda: slow, "asyncio's report of the blocking callback")
    assert len(slow) == 1 and "took 0.2" in slow[0], slow


def test_plain_traffic_never_blocks_the_loop(watched):
    # earlier tests' garbage (the serial tier runs smg's replicas, transformers models...) collected
    # now, not in a collector pass that lands on the loop's first callback and is timed as ours
    gc.collect()
    before = _handled(watched)
    with slow_callbacks(watched.loop) as slow, watched.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        stub.Generate(request("Hello there", max_new_tokens=8, temperature=0.0), timeout=30)
        list(stub.GenerateStream(request([{"role": "user", "content": "Hi"}], max_new_tokens=8), timeout=30))
        stub.BatchGenerate(pb.BatchGenerateRequest(requests=[request("a b c", max_new_tokens=4)] * 4), timeout=30)
        call = stub.GenerateStream(request("Once", max_new_tokens=2000, ignore_eos=True), timeout=30)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(stub.GenerateStream(request("Once", max_new_tokens=2000, ignore_eos=True), timeout=0.2))
        with pytest.raises(grpc.RpcError):
            stub.Generate(request("x", temperature=float("inf")), timeout=10)
        _settled(watched, before, 7)  # the cancelled calls' cleanup runs on the loop too
    assert not slow, slow


def test_session_turns_never_block_the_loop(watched):
    before = _handled(watched)
    with slow_callbacks(watched.loop) as slow, watched.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest(), timeout=10).session_id
        turn = lambda text, **kw: request([{"role": "user", "content": text}], session_id=sid, **kw)  # noqa: E731
        stub.Generate(turn("Hello", max_new_tokens=4), timeout=30)
        for _ in range(3):  # a turn cancelled mid-stream, then the next turn at once
            call = stub.GenerateStream(turn("Go on", max_new_tokens=500, ignore_eos=True), timeout=30)
            next(call)
            call.cancel()
            stub.Generate(turn("And?", max_new_tokens=4), timeout=30)
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        _settled(watched, before, 9)  # the cancelled turns' cleanup too
    assert not slow, slow
