"""deploy/envoy: the config validates on the wheel's Envoy, and two real replicas behind a real
Envoy on loopback route, retry, drain and transcode as docs/deployment.md says. Replicas say which of
them answered in the x-kvgen-replica trailer."""

from __future__ import annotations

import http.client
import json
import signal
import struct
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.mesh import build_descriptor_set, envoy_binary
from kvgen.client import SESSION_HEADER, Client, replica, request, session_lost
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 10  # no call in these tests may take this long: a dead replica is an error, not a wait
STORY = 2000  # tokens a stream runs for: still generating when its replica's drain begins


def _validate(config: Path) -> str:
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_the_configs_validate_without_deprecation_warnings(tmp_path):
    descriptor = str(build_descriptor_set(tmp_path / "kvgen.pb"))
    local = (ROOT / "deploy/envoy/envoy.yaml").read_text().replace("deploy/envoy/kvgen.pb", descriptor)
    k8s = (ROOT / "deploy/k8s/envoy.yaml").read_text().replace("/etc/envoy/kvgen.pb", descriptor)
    for name, text in (("local", local), ("k8s", k8s)):
        (tmp_path / f"{name}.yaml").write_text(text)
        log = _validate(tmp_path / f"{name}.yaml")
        assert "deprecated" not in log.lower() and "[warning]" not in log, log


def test_the_config_says_what_the_mesh_needs():
    cfg = yaml.safe_load((ROOT / "deploy/envoy/envoy.yaml").read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    sessions = routes["sessions"]
    assert sessions["match"]["headers"][0] == {"name": SESSION_HEADER, "present_match": True}
    assert sessions["route"]["hash_policy"] == [{"header": {"header_name": SESSION_HEADER}}]
    for r in routes.values():
        assert r["route"]["timeout"] == "0s"  # the client's grpc-timeout governs
        assert r["route"]["max_stream_duration"] == {"grpc_timeout_header_max": "0s"}
        retry = r["route"]["retry_policy"]
        assert set(retry["retry_on"].split(",")) >= {"unavailable", "refused-stream", "reset"}
        assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters == ["envoy.filters.http.grpc_web", "envoy.filters.http.grpc_json_transcoder",
                       "envoy.filters.http.router"]
    assert hcm["http_filters"][1]["typed_config"]["auto_mapping"] is True
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    policy = {n: c["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"]
              for n, c in clusters.items()}
    assert policy == {"kvgen": "envoy.load_balancing_policies.least_request",
                      "kvgen_sessions": "envoy.load_balancing_policies.ring_hash",
                      "kvgen_weighted": "envoy.load_balancing_policies.client_side_weighted_round_robin"}
    for c in clusters.values():
        assert c["health_checks"][0]["grpc_health_check"] == {"service_name": "kvgen.v1.Generator"}
        assert c["outlier_detection"]["max_ejection_percent"] <= 50


# --- the loopback mesh: r0 and r1 behind Envoy ---


def _md(sid: str) -> tuple[tuple[str, str]]:
    return ((SESSION_HEADER, sid),)


def _open_sessions(c: Client, prefix: str, n: int) -> dict[str, str]:
    """Sessions prefix-00 .. opened through the mesh (routed by their id): session id -> replica."""
    holder = {}
    for i in range(n):
        sid = f"{prefix}-{i:02d}"
        _, call = c.stub.CreateSession.with_call(pb.CreateSessionRequest(session_id=sid), metadata=_md(sid),
                                                 timeout=HANG_S)
        holder[sid] = replica(call)
    return holder


def test_every_turn_of_a_session_lands_on_the_replica_that_holds_it(mesh):
    c = Client(mesh.target)
    holder = _open_sessions(c, "sticky", 40)
    assert set(holder.values()) == {"r0", "r1"}  # the ring spreads sessions over both
    for sid, where in holder.items():
        r, call = c.stub.Generate.with_call(request("hello there", session_id=sid, max_new_tokens=4, ignore_eos=True),
                                            metadata=_md(sid), timeout=HANG_S)
        assert replica(call) == where and len(r.token_ids) == 4
        stream = c.stub.GenerateStream(request(" and again", session_id=sid, max_new_tokens=4, ignore_eos=True),
                                       metadata=_md(sid), timeout=HANG_S)
        msgs = list(stream)
        assert replica(stream) == where
        assert msgs[-1].usage.cached_tokens > 0  # the replica had the session's cache: it holds it
        r = c.generate(" third", session_id=sid, max_new_tokens=2, timeout=HANG_S)  # the client adds the metadata
        assert len(r.token_ids) == 2
    # each replica holds exactly the sessions the trailers said
    for rep in mesh.replicas:
        with Client(rep.target) as direct:
            assert direct.load().sessions_open == sum(w == rep.name for w in holder.values())
    for sid in holder:
        c.close_session(sid)
    c.close()


def test_stateless_calls_go_to_both_replicas(mesh):
    with Client(mesh.target) as c:
        seen = set()
        for _ in range(30):
            _, call = c.stub.Generate.with_call(request("hi", max_new_tokens=2), timeout=HANG_S)
            seen.add(replica(call))
        assert seen == {"r0", "r1"}


def _http(mesh, path: str, body: bytes, content_type: str) -> tuple[int, dict, bytes]:
    host, port = mesh.target.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_S)  # HTTP/1.1, as a browser or curl
    try:
        conn.request("POST", path, body, {"content-type": content_type, "x-grpc-web": "1"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _grpc_web(mesh, method: str, msg, reply_type) -> tuple[list, dict]:
    """A gRPC-Web call (application/grpc-web+proto): length-prefixed frames, trailers in a frame
    flagged 0x80."""
    data = msg.SerializeToString()
    status, _, raw = _http(mesh, f"/kvgen.v1.Generator/{method}", b"\x00" + struct.pack(">I", len(data)) + data,
                           "application/grpc-web+proto")
    assert status == 200
    replies, trailers, i = [], {}, 0
    while i < len(raw):
        flag, n = raw[i], struct.unpack(">I", raw[i + 1:i + 5])[0]
        frame = raw[i + 5:i + 5 + n]
        if flag & 0x80:
            for line in frame.decode().split("\r\n"):
                if line:
                    k, _, v = line.partition(":")
                    trailers[k.strip().lower()] = v.strip()
        else:
            replies.append(reply_type.FromString(frame))
        i += 5 + n
    return replies, trailers


def test_grpc_web_and_json_return_the_same_tokens_as_grpc(mesh):
    req = request("the quick brown fox", max_new_tokens=12, ignore_eos=True, temperature=0.0)
    with Client(mesh.target) as c:
        want = list(c.stub.Generate(req, timeout=HANG_S).token_ids)
        streamed = [t for m in c.stub.GenerateStream(req, timeout=HANG_S) for t in m.token_ids]
    assert len(want) == 12 and streamed == want

    replies, trailers = _grpc_web(mesh, "Generate", req, pb.GenerateResponse)
    assert trailers["grpc-status"] == "0" and trailers["x-kvgen-replica"] in ("r0", "r1")
    assert list(replies[0].token_ids) == want
    replies, trailers = _grpc_web(mesh, "GenerateStream", req, pb.GenerateStreamResponse)
    assert [t for m in replies for t in m.token_ids] == want and len(replies) > 1

    body = json.dumps({"prompt": "the quick brown fox",
                       "sampling": {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0}}).encode()
    status, headers, raw = _http(mesh, "/kvgen.v1.Generator/Generate", body, "application/json")
    assert status == 200 and headers["content-type"].startswith("application/json")
    assert json.loads(raw)["token_ids"] == want
    status, _, raw = _http(mesh, "/kvgen.v1.Generator/GenerateStream", body, "application/json")
    assert status == 200 and [t for m in json.loads(raw) for t in m["token_ids"]] == want
    # an error is an HTTP status with the google.rpc.Status as JSON
    status, _, raw = _http(mesh, "/kvgen.v1.Generator/Generate", b"{}", "application/json")
    err = json.loads(raw)
    assert status == 400 and err["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert err["details"][0]["field_violations"][0]["field"] == "prompt"  # the BadRequest, as JSON


def test_batch_stream_over_grpc_grpc_web_and_json(mesh):
    """BatchGenerateStream through the mesh: every transport gives each entry its tokens, tagged by
    the entry, and the bad entry its google.rpc.Status (as JSON: the BadRequest, readable)."""
    entries = [request("the quick brown fox", max_new_tokens=8, ignore_eos=True, temperature=0.0),
               request("hi", max_new_tokens=0),
               request("over the lazy dog", max_new_tokens=6, ignore_eos=True, temperature=0.0)]
    batch = pb.BatchGenerateRequest(requests=entries)
    with Client(mesh.target) as c:
        want = {i: list(c.stub.Generate(entries[i], timeout=HANG_S).token_ids) for i in (0, 2)}
        call = c.stub.BatchGenerateStream(batch, timeout=HANG_S)
        msgs = list(call)
        assert replica(call) in ("r0", "r1")
    assert len(want[0]) == 8 and len(want[2]) == 6

    def check(msgs) -> None:
        assert {i: [t for m in msgs if m.index == i for t in m.response.token_ids] for i in (0, 2)} == want
        [bad] = [m for m in msgs if m.index == 1]
        assert bad.WhichOneof("result") == "error" and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

    check(msgs)
    replies, trailers = _grpc_web(mesh, "BatchGenerateStream", batch, pb.BatchGenerateStreamResponse)
    assert trailers["grpc-status"] == "0"
    check(replies)

    body = json.dumps({"requests": [json_format.MessageToDict(e, preserving_proto_field_name=True)
                                    for e in entries]}).encode()
    status, headers, raw = _http(mesh, "/kvgen.v1.Generator/BatchGenerateStream", body, "application/json")
    assert status == 200 and headers["content-type"].startswith("application/json")
    out = json.loads(raw)
    assert {i: [t for m in out if m["index"] == i for t in m["response"]["token_ids"]] for i in (0, 2)} == want
    [bad] = [m for m in out if m["index"] == 1]
    assert bad["error"]["details"][0]["field_violations"][0]["field"] == "sampling.max_new_tokens"


def test_abort_through_the_mesh_from_a_second_channel(mesh):
    """A routing key pins a stateless request to one replica, so an Abort sent with the same key
    reaches it."""
    with Client(mesh.target) as c, Client(mesh.target) as other:
        call = c.stub.GenerateStream(request("go on", request_id="mesh-long", max_new_tokens=1800, ignore_eos=True),
                                     metadata=_md("pin-1"), timeout=60)
        assert next(call).token_ids
        out = other.abort(["mesh-long"], routing_key="pin-1")
        assert list(out.aborted) == ["mesh-long"]
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED


def _keys_on(c: Client, name: str, n: int) -> list[str]:
    """n routing keys that the ring sends to replica `name`."""
    keys, i = [], 0
    while len(keys) < n:
        key = f"key-{name}-{i}"
        _, call = c.stub.Generate.with_call(request("x", max_new_tokens=1), metadata=_md(key), timeout=HANG_S)
        if replica(call) == name:
            keys.append(key)
        i += 1
    return keys


def _traffic(target: str, stop: threading.Event, keys: list[str], outcomes: list) -> None:
    """Short stateless calls in a loop, half of them pinned by keys: (ok, code, seconds) each."""
    with Client(target) as c:
        i = 0
        while not stop.is_set():
            md = _md(keys[i % len(keys)]) if keys and i % 2 else ()
            t0 = time.monotonic()
            try:
                c.stub.Generate(request("ping", max_new_tokens=4, ignore_eos=True), metadata=md, timeout=HANG_S)
                outcomes.append((True, None, time.monotonic() - t0))
            except grpc.RpcError as e:
                outcomes.append((False, e.code(), time.monotonic() - t0))
            i += 1


def _until(ok, what: str, timeout: float = HANG_S) -> None:
    """Poll ok() until it holds; fail naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def _serving(r) -> bool:
    """Whether replica r says SERVING to a health check (Envoy's, which a drain turns NOT_SERVING)."""
    with grpc.insecure_channel(r.target) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_S)
    return got.status == health_pb2.HealthCheckResponse.SERVING


def _refuses(r) -> bool:
    """Whether replica r refuses new calls (past its drain's DRAIN_DELAY_S)."""
    with grpc.insecure_channel(r.target) as ch:
        try:
            pb_grpc.GeneratorStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=HANG_S)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
            return True
    return False


def _running(r) -> int:
    """Requests in replica r's running batch (its metrics, served until its drain ends)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{r.metrics_port}/metrics", timeout=HANG_S).read().decode()
    return int(float(next(line.split()[1] for line in page.splitlines() if line.startswith("kvgen_requests_running "))))


def _routed_around(mesh, r) -> bool:
    """Whether Envoy has taken replica r out of every cluster (health check failed, or ejected)."""
    flags = [f for (_, host), f in mesh.envoy.host_flags().items() if host == r.target]
    return bool(flags) and "healthy" not in flags


def test_sigterm_drains_a_replica_and_no_call_fails(mesh):
    """r1 finishes its streams while Envoy stops sending it calls; what it refuses meanwhile is
    retried on r0."""
    r1 = mesh.replica("r1")
    c = Client(mesh.target)
    keys = _keys_on(c, "r1", 3)
    got: dict[str, object] = {}
    started = threading.Barrier(len(keys) + 1, timeout=HANG_S)

    def long_stream(key: str) -> None:
        try:
            call = c.stub.GenerateStream(request("a long story", max_new_tokens=STORY, ignore_eos=True),
                                         metadata=_md(key), timeout=60)
            first = next(call)
            started.wait()
            msgs = [first, *call]
            got[key] = (replica(call), sum(len(m.token_ids) for m in msgs), msgs[-1].finish_reason)
        except grpc.RpcError as e:
            got[key] = e.code()

    streams = [threading.Thread(target=long_stream, args=(k,)) for k in keys]
    stop, outcomes = threading.Event(), []
    try:
        for t in streams:
            t.start()
        started.wait()  # every stream is running on r1
        traffic = threading.Thread(target=_traffic, args=(mesh.target, stop, keys, outcomes))
        traffic.start()
        _until(lambda: len(outcomes) >= 2, "traffic through Envoy")
        r1.signal(signal.SIGTERM)
        at_term = len(outcomes)
        _until(lambda: not _serving(r1), "r1 NOT_SERVING after SIGTERM")
        _until(lambda: _refuses(r1), "r1 refusing new calls", 30)  # DRAIN_DELAY_S on: the drain proper
        assert _running(r1) == len(keys) and not got  # the streams were still generating on r1
        _until(lambda: _routed_around(mesh, r1), "Envoy routing around r1")
        for t in streams:
            t.join(60)
        assert got == {k: ("r1", STORY, pb.FINISH_REASON_LENGTH) for k in keys}  # finished on the draining replica
        _until(lambda: len(outcomes) >= at_term + 5, "traffic after SIGTERM")
        stop.set()
        traffic.join(HANG_S)
        failed = [o for o in outcomes if not o[0]]
        assert not failed, failed  # traffic ran through the drain, and none of it failed
        assert r1.proc.wait(40) == 0
    finally:  # the next test gets both replicas whatever happened here
        stop.set()
        c.close()
        mesh.restart("r1")


def test_sigkill_one_replica_mid_traffic(mesh):
    """Stateless calls keep succeeding (retried on the survivor); the dead replica's sessions get a
    NOT_FOUND or UNAVAILABLE at once, which the client reads as "open it again"; nothing hangs."""
    c = Client(mesh.target)
    holder = _open_sessions(c, "doomed", 12)
    assert set(holder.values()) == {"r0", "r1"}
    r0 = mesh.replica("r0")
    stop, outcomes = threading.Event(), []
    workers = [threading.Thread(target=_traffic, args=(mesh.target, stop, [], outcomes)) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        _until(lambda: len(outcomes) >= 4, "traffic through Envoy")
        r0.signal(signal.SIGKILL)
        at_kill = len(outcomes)
        _until(lambda: _routed_around(mesh, r0), "Envoy routing around the dead r0")
        _until(lambda: len(outcomes) >= at_kill + 20, "traffic after the kill")
    finally:
        stop.set()
    for w in workers:
        w.join(HANG_S)
    failed = [o for o in outcomes if not o[0]]
    assert not failed, failed
    assert max(o[2] for o in outcomes) < HANG_S

    for sid, where in holder.items():
        t0 = time.monotonic()
        try:
            _, call = c.stub.Generate.with_call(request("still there?", session_id=sid, max_new_tokens=2),
                                                metadata=_md(sid), timeout=HANG_S)
            assert where == "r1" and replica(call) == "r1"  # the survivor's sessions go on
        except grpc.RpcError as e:
            assert where == "r0" and session_lost(e), (sid, e.code(), e.details())
            assert time.monotonic() - t0 < 5
            assert c.create_session(sid) == sid  # opened again, on the survivor
            _, call = c.stub.Generate.with_call(request("again", session_id=sid, max_new_tokens=2),
                                                metadata=_md(sid), timeout=HANG_S)
            assert replica(call) == "r1"
    c.close()
