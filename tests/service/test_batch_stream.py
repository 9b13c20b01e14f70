"""BatchGenerateStream over a real channel: every entry runs together and streams its own messages,
tagged by its position; a bad entry fails alone with its google.rpc.Status; cancelling the call or
its deadline ends every entry and gives every KV block back; each entry's greedy tokens are what
GenerateStream gives for it alone."""

from __future__ import annotations

import time
from collections import defaultdict

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

from .wire import bad_request

LONG = 1900  # tokens an entry would run for: still generating when the call is cancelled


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(max_batch_entries=6)


@pytest.fixture(scope="module")
def stub(srv):
    with srv.channel() as ch:
        yield pb_grpc.GeneratorStub(ch)


def _by_entry(msgs) -> dict[int, list[pb.BatchGenerateStreamResponse]]:
    out = defaultdict(list)
    for m in msgs:
        out[m.index].append(m)
    return out


def _alone(stub, req: pb.GenerateRequest) -> list[pb.GenerateStreamResponse]:
    return list(stub.GenerateStream(req, timeout=60))


def _finished(srv, reason: str) -> float:
    """Requests the server has finished with this reason ("cancelled", "length", ...), from its metrics."""
    return sum(s.value for m in srv.server.metrics.finished.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["finish_reason"] == reason)


def _until(ok) -> None:
    deadline = time.monotonic() + 10
    while not ok():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _settled(srv, cancelled: float = 0) -> None:
    """Until the engine runs nothing, every KV block is back (they return on the engine's next step
    after a cancel) and `cancelled` requests were counted as such, or fail."""
    _until(lambda: srv.gen.engine.idle and srv.gen.scheduler.kv.used == 0 and _finished(srv, "cancelled") >= cancelled)


def test_mixed_entries_stream_together_and_a_bad_one_fails_alone(srv, stub):
    greedy = dict(temperature=0.0, ignore_eos=True)
    entries = [
        request("Once upon a time", request_id="good-0", max_new_tokens=16, **greedy),
        request("two", max_new_tokens=0),  # max_new_tokens < 1
        request([{"role": "user", "content": "Hi!"}], max_new_tokens=12, **greedy),
        request([1, 2, 99999], max_new_tokens=4),  # a token id past the vocabulary
        request("samples", max_new_tokens=5, n=2, seed=7, ignore_eos=True),
    ]
    msgs = list(stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries), timeout=60))
    got = _by_entry(msgs)
    assert sorted(got) == [0, 1, 2, 3, 4]

    for i, field in ((1, "sampling.max_new_tokens"), (3, "prompt_token_ids")):
        [only] = got[i]  # a bad entry's one message: its error
        assert only.WhichOneof("result") == "error" and only.error.code == code_pb2.INVALID_ARGUMENT
        br = error_details_pb2.BadRequest()
        assert only.error.details[0].Unpack(br) and br.field_violations[0].field == field
    assert "99999" in got[3][0].error.message

    for i in (0, 2, 4):
        assert all(m.WhichOneof("result") == "response" for m in got[i])
    # each good entry streams exactly what GenerateStream gives for it alone
    for i in (0, 2):
        streamed = [m.response for m in got[i]]
        alone = _alone(stub, entries[i])
        assert [t for m in streamed for t in m.token_ids] == [t for m in alone for t in m.token_ids]
        assert "".join(m.text for m in streamed) == "".join(m.text for m in alone)
        assert len(streamed) > 1 and [bool(m.finish_reason) for m in streamed][-1]
        assert not any(m.finish_reason for m in streamed[:-1])
        assert streamed[-1].finish_reason == alone[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert streamed[-1].usage.completion_tokens == entries[i].sampling.max_new_tokens
    assert {m.response.request_id for m in got[0]} == {"good-0"}
    assert len({m.response.request_id for m in got[2]}) == 1 and got[2][0].response.request_id
    # n = 2: the entry interleaves its samples, each ending with its own finish_reason
    samples = _by_entry([pb.BatchGenerateStreamResponse(index=m.response.index) for m in got[4]])
    assert sorted(samples) == [0, 1]
    ends = [m.response for m in got[4] if m.response.finish_reason]
    assert sorted(m.index for m in ends) == [0, 1] and all(m.usage.completion_tokens == 5 for m in ends)
    # the entries ran together: their messages interleave rather than come one entry after another
    order = [m.index for m in msgs if m.index in (0, 2)]
    assert order != sorted(order)
    _settled(srv)


def test_cancelling_the_call_ends_every_entry(srv, stub):
    entries = [request(f"a long story {i}", max_new_tokens=LONG, ignore_eos=True) for i in range(3)]
    call = stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries), timeout=60)
    seen = set()
    for m in call:
        assert m.WhichOneof("result") == "response" and m.response.token_ids
        seen.add(m.index)
        if seen == {0, 1, 2}:
            break
    assert len(srv.gen.scheduler.running) == 3 and srv.gen.scheduler.kv.used > 0  # all three generating
    cancelled, length = _finished(srv, "cancelled"), _finished(srv, "length")
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    _settled(srv, cancelled + 3)  # every entry was cancelled, none ran on to its length
    assert _finished(srv, "length") == length


def test_the_deadline_ends_every_entry(srv, stub):
    entries = [request(f"a long story {i}", max_new_tokens=LONG, ignore_eos=True) for i in range(3)]
    # a first call (the server's first compiles) may take longer than the deadline: not this one
    length = _finished(srv, "length")
    list(stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=[request("warm", max_new_tokens=2)]), timeout=60))
    _until(lambda: _finished(srv, "length") == length + 1)
    seen = []
    cancelled, length = _finished(srv, "cancelled"), _finished(srv, "length")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        for m in stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries), timeout=1.0):
            seen.append(m)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    assert {m.index for m in seen} == {0, 1, 2}  # every entry had started
    assert sum(len(m.response.token_ids) for m in seen) < 3 * LONG
    _settled(srv, cancelled + 3)
    assert _finished(srv, "length") == length


def test_an_entry_aborted_by_id_ends_alone(srv, stub):
    entries = [request("short", max_new_tokens=40, ignore_eos=True, temperature=0.0),
               request("the long one", request_id="batch-long", max_new_tokens=LONG, ignore_eos=True)]
    call = stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries), timeout=60)
    msgs = [next(call)]
    while 1 not in {m.index for m in msgs}:
        msgs.append(next(call))
    assert list(stub.Abort(pb.AbortRequest(request_ids=["batch-long"]), timeout=10).aborted) == ["batch-long"]
    msgs += list(call)  # the call itself ends OK
    got = _by_entry(msgs)
    assert got[1][-1].WhichOneof("result") == "error" and got[1][-1].error.code == code_pb2.CANCELLED
    assert sum(len(m.response.token_ids) for m in got[1]) < LONG
    assert got[0][-1].response.finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.response.token_ids) for m in got[0]) == 40
    _settled(srv)


def test_the_entry_limit_is_the_batch_limit(srv, stub):
    entries = [request("x", max_new_tokens=1)] * 7
    with pytest.raises(grpc.RpcError) as e:
        list(stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request(e.value) == [("requests", "7 entries; at most 6 are accepted")]
    ok = list(stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries[:6]), timeout=30))
    assert sorted({m.index for m in ok}) == list(range(6))
    assert all(m.WhichOneof("result") == "response" for m in ok)


def test_an_empty_batch_is_an_empty_stream(stub):
    assert list(stub.BatchGenerateStream(pb.BatchGenerateRequest(), timeout=10)) == []


def test_the_embedded_model_streams_each_entry_as_alone(server):
    """The real model: greedy entries of a batch give GenerateStream's tokens for each alone."""
    prompts = ["The capital of France is", "Once upon a time", [{"role": "user", "content": "Name a colour."}]]
    entries = [request(p, max_new_tokens=12, temperature=0.0) for p in prompts]
    with server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        got = _by_entry(stub.BatchGenerateStream(pb.BatchGenerateRequest(requests=entries), timeout=120))
        for i, e in enumerate(entries):
            alone = _alone(stub, e)
            assert [t for m in got[i] for t in m.response.token_ids] == [t for m in alone for t in m.token_ids]
            assert got[i][-1].response.finish_reason == alone[-1].finish_reason
