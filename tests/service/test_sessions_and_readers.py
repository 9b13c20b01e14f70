"""What no client can take from the others: open sessions are bounded per server and per API
key, a session is private to the key that opened it, and a stream's reader that stops reading
has its request ended instead of the server holding its output."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvgen.client import request
from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.sequence import FinishReason
from kvgen.errors import ClientTooSlow
from kvgen.service.errors import to_status
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


def _md(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


def _retry_after(e: grpc.RpcError) -> float:
    for k, v in e.trailing_metadata():
        if k == "grpc-status-details-bin":
            for d in status_pb2.Status.FromString(v).details:
                info = error_details_pb2.RetryInfo()
                if d.Unpack(info):
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return 0.0


def test_sessions_are_bounded_per_server(start_server):
    srv = start_server(engine={"max_sessions": 2})
    with srv.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        ids = [stub.CreateSession(pb.CreateSessionRequest()).session_id for _ in range(2)]
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateSession(pb.CreateSessionRequest())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _retry_after(e.value) > 0
        stub.CloseSession(pb.CloseSessionRequest(session_id=ids[0]))
        assert stub.CreateSession(pb.CreateSessionRequest()).session_id  # room again


def test_sessions_are_bounded_and_private_per_api_key(start_server):
    srv = start_server(engine={"max_sessions_per_key": 2}, api_key="key-a,key-b")
    with srv.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        mine = [stub.CreateSession(pb.CreateSessionRequest(), metadata=_md("key-a")).session_id for _ in range(2)]
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateSession(pb.CreateSessionRequest(), metadata=_md("key-a"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        theirs = stub.CreateSession(pb.CreateSessionRequest(), metadata=_md("key-b")).session_id  # its own quota
        # another tenant's session is not there for you, to use or to close
        for call in (lambda: stub.Generate(request("hi", session_id=mine[0], max_new_tokens=2), metadata=_md("key-b")),
                     lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=mine[0]), metadata=_md("key-b"))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        r = stub.Generate(request("hi", session_id=mine[0], max_new_tokens=2, temperature=0.0), metadata=_md("key-a"))
        assert r.usage.completion_tokens == 2
        for sid, key in ((mine[0], "key-a"), (mine[1], "key-a"), (theirs, "key-b")):
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=_md(key))
        assert srv.gen.scheduler.kv.used == 0 and not srv.gen.sessions


@pytest.mark.serial  # its reader that keeps up must keep up with a 1 ms step: no other worker's load
def test_a_reader_that_stops_reading_has_its_request_ended(tiny_pair):
    gen = Generator(*tiny_pair, EngineOptions(kv_cache_mb=16, stream_buffer=4))
    try:
        params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)

        async def unread():
            req = await gen.request("Once upon a time", params)
            await req.released()  # nobody read: the engine ended it once the buffer was full
            with pytest.raises(ClientTooSlow):
                async for _ in req:
                    pass
            return req.seq

        seq = gen.bridge.run(unread())
        assert seq.finish_reason == FinishReason.CANCELLED and len(seq.output_ids) < 200
        assert gen.scheduler.kv.used == 0
    finally:
        gen.close()
    # a reader that keeps up is never cut, however long the answer: 200 events through a 32-event
    # buffer (a 4-event one is 4 ms of this tiny model's steps, less than a loaded machine's
    # scheduling hiccup for the reader's thread)
    gen = Generator(*tiny_pair, EngineOptions(kv_cache_mb=16, stream_buffer=32))
    try:
        assert len(gen.generate("Once upon a time", params).token_ids) == 200
    finally:
        gen.close()
    assert to_status(ClientTooSlow("slow")).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
