"""Requests are bounded before any work: message sizes, prompt bytes, batch entries, stop strings,
logprobs, ids; sampling values finite; echoed inputs clipped."""

from __future__ import annotations

import time

import grpc
import pytest

from kvgen.client import request
from kvgen.errors import InvalidRequest, NotFound
from kvgen.service import convert
from kvgen.service.errors import clip, to_status
from kvgen.service.settings import Settings
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

from .wire import bad_request

BIG_PROMPT = "word " * 720_000  # 3.6 MB: under the 4 MiB message limit, far over MAX_PROMPT_BYTES


@pytest.fixture(scope="module")
def stub(tiny_server):
    with tiny_server.channel() as ch:
        yield pb_grpc.GeneratorStub(ch)


def refused(call, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        out = call(req, timeout=30)
        if not isinstance(out, pb.GenerateResponse | pb.BatchGenerateResponse | pb.CloseSessionResponse):
            list(out)
    return e.value


@pytest.mark.parametrize("req, field", [
    (request("hi", temperature=float("inf")), "sampling.temperature"),
    (request("hi", temperature=float("nan")), "sampling.temperature"),
    (request("hi", repetition_penalty=float("inf")), "sampling.repetition_penalty"),
    (request("hi", logprobs=21), "sampling.logprobs"),
    (request("hi", stop_strings=[f"s{i}" for i in range(17)]), "sampling.stop_strings"),
    (request("hi", stop_strings=["x" * 257]), "sampling.stop_strings"),
    (request("hi", stop_token_ids=list(range(65))), "sampling.stop_token_ids"),
    (request("hi", request_id="r" * 129), "request_id"),
    (request("hi", session_id="has space"), "session_id"),
    (request("hi", session_id="s" * 129), "session_id"),
    (request(BIG_PROMPT), "prompt"),
    (request([{"role": "user", "content": "y" * 100_000}] * 3), "messages"),
])
def test_out_of_bounds_is_invalid_argument(stub, req, field):
    for call in (stub.Generate, stub.GenerateStream):
        err = refused(call, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert field in [f for f, _ in bad_request(err)], err.details()
        assert len(err.details()) <= 1100


def test_big_prompt_is_refused_before_tokenizing(stub, tiny_server):
    """3.6 MB of prompt would take seconds to tokenize; the size check takes microseconds."""
    req = request(BIG_PROMPT)
    t0 = time.perf_counter()
    for _ in range(100):
        with pytest.raises(Exception) as e:
            convert.prompt_of(req, Settings())
        assert "bytes" in str(e.value)
    assert (time.perf_counter() - t0) / 100 < 0.005
    t0 = time.perf_counter()
    assert refused(stub.Generate, req).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert time.perf_counter() - t0 < 1.0  # the round trip of 3.6 MB, no tokenizing
    assert tiny_server.gen.engine.idle


def test_oversized_message_is_resource_exhausted(stub):
    err = refused(stub.Generate, request("x" * (4 << 20)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.details().lower(), err.details()


def test_batch_entry_limit(stub, tiny_server):
    limit = tiny_server.settings.max_batch_entries
    entries = [request("hi", max_new_tokens=1) for _ in range(limit + 1)]
    err = refused(stub.BatchGenerate, pb.BatchGenerateRequest(requests=entries))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_request(err)] == ["requests"]
    ok = stub.BatchGenerate(pb.BatchGenerateRequest(requests=entries[:limit]), timeout=60)
    assert [r.WhichOneof("result") for r in ok.results] == ["response"] * limit


def test_close_session_ids(stub):
    for sid in ("", "s" * 65536, "bad id!"):
        err = refused(stub.CloseSession, pb.CloseSessionRequest(session_id=sid))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in bad_request(err)] == ["session_id"]
        assert len(err.details()) < 300
    err = refused(stub.CloseSession, pb.CloseSessionRequest(session_id="no-such-session"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_huge_session_id_is_not_echoed(stub):
    err = refused(stub.Generate, request("hi", session_id="s" * 65536, max_new_tokens=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.details()) < 300
    assert "s" * 65 not in err.details()


def test_clip():
    assert clip("short") == "short"
    assert clip("x" * 100, 10) == "x" * 10 + "...(90 more)"
    # whatever the servicer echoes, a status stays far below the clients' 16 KiB metadata limit
    assert len(to_status(NotFound(f"no session {'s' * 65536!r}")).message) < 1100
    bad = to_status(InvalidRequest([("stop_strings", "y" * 10_000)] * 1000))
    assert len(bad.SerializeToString()) < 16 * 1024


def test_oversized_response_is_resource_exhausted(start_server):
    small = start_server(max_send_bytes=256)
    with small.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        err = refused(stub.Generate, request("hi", max_new_tokens=8, logprobs=20, ignore_eos=True))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size == 300


def test_aged_connections_are_closed(start_server):
    """MAX_CONNECTION_AGE_S: the server ends a connection (GOAWAY) once it is that old, so a mesh
    spreads clients again; the client reconnects on its next call."""
    aged = start_server(max_connection_age_s=0.3, max_connection_age_grace_s=0.2)
    states = []  # connectivity changes, delivered on grpc's own thread

    def idle_after_ready() -> bool:
        seen = list(states)
        return grpc.ChannelConnectivity.READY in seen and \
            grpc.ChannelConnectivity.IDLE in seen[seen.index(grpc.ChannelConnectivity.READY):]

    with aged.channel() as ch:
        ch.subscribe(states.append, try_to_connect=False)
        stub = pb_grpc.GeneratorStub(ch)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        deadline = time.time() + 10
        while time.time() < deadline and not idle_after_ready():
            time.sleep(0.05)
        assert idle_after_ready(), states
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size == 300
