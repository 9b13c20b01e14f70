"""The control plane and the mesh's conventions on one real server: client-chosen session ids
(and the x-session-id metadata that must agree with them), Abort from another channel, GetLoad
against the Prometheus gauges, and the trailers that name the replica and report its load."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvgen.client import REPLICA_TRAILER, SESSION_HEADER, Client, replica, request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


def _bad_fields(e: grpc.RpcError) -> list[str]:
    for k, v in e.trailing_metadata() or ():
        if k == "grpc-status-details-bin":
            for d in status_pb2.Status.FromString(v).details:
                bad = error_details_pb2.BadRequest()
                if d.Unpack(bad):
                    return [f.field for f in bad.field_violations]
    return []


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(replica_id="replica-a")


@pytest.fixture
def stub(srv):
    with srv.channel() as ch:
        yield pb_grpc.GeneratorStub(ch)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_a_client_chooses_its_session_id(stub):
    assert stub.CreateSession(pb.CreateSessionRequest(session_id="conv-1")).session_id == "conv-1"
    r = stub.Generate(request("hello", session_id="conv-1", max_new_tokens=3, ignore_eos=True),
                      metadata=((SESSION_HEADER, "conv-1"),))
    assert len(r.token_ids) == 3
    e = _refused(lambda: stub.CreateSession(pb.CreateSessionRequest(session_id="conv-1")))  # already open
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and _bad_fields(e) == ["session_id"]
    for bad in ("has space", "x" * 129, "é"):
        e = _refused(lambda b=bad: stub.CreateSession(pb.CreateSessionRequest(session_id=b)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and _bad_fields(e) == ["session_id"], bad
    # the metadata alone names the session (grpcurl -H 'x-session-id: ...')
    assert stub.CreateSession(pb.CreateSessionRequest(), metadata=((SESSION_HEADER, "conv-2"),)).session_id == "conv-2"
    assert stub.CreateSession(pb.CreateSessionRequest()).session_id  # neither: the server picks
    stub.CloseSession(pb.CloseSessionRequest(session_id="conv-1"))
    stub.CloseSession(pb.CloseSessionRequest(session_id="conv-2"))


def test_metadata_that_disagrees_with_the_body_is_refused(stub):
    """A mesh routes by the metadata: a body naming another session would be served elsewhere."""
    e = _refused(lambda: stub.CreateSession(pb.CreateSessionRequest(session_id="a-1"),
                                            metadata=((SESSION_HEADER, "b-1"),)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and _bad_fields(e) == ["session_id"]
    sid = stub.CreateSession(pb.CreateSessionRequest(session_id="a-2")).session_id
    e = _refused(lambda: stub.Generate(request("hi", session_id=sid, max_new_tokens=2),
                                       metadata=((SESSION_HEADER, "other"),)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and _bad_fields(e) == ["session_id"]
    # a stateless call may carry any routing key
    assert stub.Generate(request("hi", max_new_tokens=2), metadata=((SESSION_HEADER, "pin"),)).token_ids
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_the_python_client_sends_the_session_id_as_metadata(srv):
    c = Client(srv.target)
    sid = c.create_session()  # chosen by the client, so CreateSession itself is routed by it
    assert len(sid) == 32 and sid in srv.gen.sessions
    assert c.create_session("mine-1") == "mine-1"
    assert len(c.generate("hello", session_id=sid, max_new_tokens=2, ignore_eos=True).token_ids) == 2
    c.close_session(sid)
    c.close_session("mine-1")
    c.close()


def test_abort_from_a_second_channel_ends_a_stream_with_cancelled(srv, stub):
    call = stub.GenerateStream(request("once upon a time", request_id="long-1", max_new_tokens=1800,
                                       ignore_eos=True), timeout=60)
    assert next(call).token_ids  # running
    other = Client(srv.target)
    out = other.abort(["long-1", "never-seen"])
    assert list(out.aborted) == ["long-1"] and list(out.unknown) == ["never-seen"]
    # the reply comes once the blocks are back: nothing runs, nothing is held
    load = other.load()
    assert (load.running_requests, load.kv_blocks_used) == (0, 0)
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED and "Abort" in e.value.details()
    assert list(other.abort(["long-1"]).unknown) == ["long-1"]  # ended already
    e = _refused(lambda: other.stub.Abort(pb.AbortRequest()))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    other.close()


def test_abort_ends_a_unary_call_and_a_session_turn(srv, stub):
    sid = stub.CreateSession(pb.CreateSessionRequest(session_id="abort-me")).session_id
    got = {}

    def run(name, req):
        try:
            stub.Generate(req, timeout=60)
        except grpc.RpcError as e:
            got[name] = e.code()

    threads = [threading.Thread(target=run, args=("unary", request("x", request_id="u-1", max_new_tokens=1800,
                                                                      ignore_eos=True))),
               threading.Thread(target=run, args=("turn", request("y", request_id="t-1", session_id=sid,
                                                                     max_new_tokens=1800, ignore_eos=True)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while srv.server.servicer.load.snapshot().running_requests < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    c = Client(srv.target)
    assert sorted(c.abort(["u-1", "t-1"]).aborted) == ["t-1", "u-1"]
    for t in threads:
        t.join(30)
    assert got == {"unary": grpc.StatusCode.CANCELLED, "turn": grpc.StatusCode.CANCELLED}
    # the session lives on: its next turn runs
    assert stub.Generate(request("z", session_id=sid, max_new_tokens=2, ignore_eos=True)).token_ids
    c.close_session(sid)
    c.close()


def test_abort_reaches_only_the_callers_own_requests(start_server):
    srv = start_server(api_key="key-a,key-b")
    with srv.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        call = stub.GenerateStream(request("hi", request_id="mine", max_new_tokens=1800, ignore_eos=True),
                                   metadata=(("authorization", "Bearer key-a"),), timeout=60)
        assert next(call).token_ids
        out = stub.Abort(pb.AbortRequest(request_ids=["mine"]), metadata=(("authorization", "Bearer key-b"),))
        assert list(out.unknown) == ["mine"]
        out = stub.Abort(pb.AbortRequest(request_ids=["mine"]), metadata=(("authorization", "Bearer key-a"),))
        assert list(out.aborted) == ["mine"]
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED


def _scrape(port: int) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_get_load_equals_the_prometheus_gauges(srv, stub):
    port = srv.settings.metrics_port
    prompt = "the quick brown fox jumps over the lazy dog " * 4  # several full blocks: a prefix-cache hit
    for _ in range(3):
        stub.Generate(request(prompt, max_new_tokens=8, ignore_eos=True))
    sid = stub.CreateSession(pb.CreateSessionRequest(session_id="held")).session_id
    stub.Generate(request(prompt, session_id=sid, max_new_tokens=4, ignore_eos=True))  # keeps its blocks

    load, m = stub.GetLoad(pb.GetLoadRequest()), _scrape(port)
    assert load.replica == "replica-a" and load.accepting
    assert load.kv_blocks_used > 0 and load.prefix_cache.hits > 0
    assert load.running_requests == m["kvgen_requests_running"] == 0
    assert load.waiting_requests == m["kvgen_requests_waiting"]
    assert load.kv_blocks_used == m["kvgen_kv_blocks_used"]
    assert load.kv_blocks_total == m["kvgen_kv_blocks_total"]
    assert load.kv_cache_usage == pytest.approx(m["kvgen_kv_cache_usage_ratio"])
    assert load.sessions_open == m["kvgen_sessions_open"]
    p = load.prefix_cache
    assert (p.hits, p.misses, p.hit_tokens, p.evictions) == (
        m["kvgen_prefix_cache_hits_total"], m["kvgen_prefix_cache_misses_total"],
        m["kvgen_prefix_cache_hit_tokens_total"], m["kvgen_prefix_cache_evictions_total"])
    assert (p.blocks_in_pool, p.blocks_in_tiers) == (m['kvgen_prefix_cache_blocks{where="pool"}'],
                                                     m['kvgen_prefix_cache_blocks{where="tiers"}'])
    assert load.tokens_per_second > 0 and load.requests_per_second > 0
    # rates over a sliding window: equal up to the moment between the two reads
    assert load.tokens_per_second == pytest.approx(m["kvgen_generation_tokens_per_second"], rel=0.2)
    assert load.requests_per_second == pytest.approx(m["kvgen_requests_finished_per_second"], rel=0.2)

    call = stub.GenerateStream(request("go", max_new_tokens=1800, ignore_eos=True), timeout=60)
    next(call)
    load, m = stub.GetLoad(pb.GetLoadRequest()), _scrape(port)
    assert load.running_requests == m["kvgen_requests_running"] == 1
    call.cancel()
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_every_success_names_the_replica_and_reports_its_load(stub):
    stub.Generate(request("hi", max_new_tokens=2))  # a finished request: the report has a rate
    _, call = stub.Generate.with_call(request("hi", max_new_tokens=2))
    trailers = dict(call.trailing_metadata())
    assert replica(call) == trailers[REPLICA_TRAILER] == "replica-a"
    orca = trailers["endpoint-load-metrics"]
    assert orca.startswith("TEXT ")
    fields = dict(kv.split(":") for kv in orca[5:].split(", "))
    assert 0 < float(fields["application_utilization"]) <= 1
    assert {"rps_fractional", "named_metrics.running", "named_metrics.waiting"} <= set(fields)
    stream = stub.GenerateStream(request("hi", max_new_tokens=2))
    list(stream)
    assert replica(stream) == "replica-a"
