"""KV compression per request over the wire (GenerateRequest.kv_compress, kv_compress_window,
kv_compress_ratio; CreateSessionRequest's; the OpenAI API's extra body fields of the same names):
the field is honoured, a bad value or compression on a server that cannot do it is INVALID_ARGUMENT
(HTTP 400) naming the field, a session keeps its choice, and GetModelInfo says the server's default
and why a request could not turn it on. Tiny-model servers on loopback (tests/service/conftest.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from kvgen.client import Client
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as rpc
from tests.conftest import free_port
from tests.service.wire import bad_request

PROMPT = [3 + (i * 7) % 290 for i in range(200)]  # 200 token ids: with a window of 0, 3 chunks compressed
SAMPLING = pb.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain(start_server):
    return start_server(engine=dict(kv_dtype="fp32"), http_port=free_port())


@pytest.fixture(scope="module")
def quantized(start_server):
    return start_server(engine=dict(kv_dtype="q4"), http_port=free_port())


def _stub(server) -> rpc.GeneratorStub:
    return rpc.GeneratorStub(server.channel())


def _tops(resp: pb.GenerateResponse) -> list[list[float]]:
    return [[t.logprob for t in lp.top] for lp in resp.logprobs]


def _compressed_tables(server) -> list:
    seen = []
    server.gen.scheduler.kv.listen(lambda ev: seen.append(ev.table) if ev.name == "kv.compress" else None)
    return seen


def test_the_field_is_honoured(plain):
    stub = _stub(plain)
    seen = _compressed_tables(plain)
    exact = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, cache_salt="a"), timeout=60)
    assert not seen  # the server's default: off
    mean = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, cache_salt="b",
                                            kv_compress="mean", kv_compress_window=0), timeout=60)
    assert seen  # this request's table was compressed
    table = seen[-1]
    assert table.compressor.key == ("mean", 0, 0.5)  # (its rows may be back in the pool by now)
    heavy = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, cache_salt="c",
                                             kv_compress="sink-heavy", kv_compress_window=0, kv_compress_ratio=0.25),
                          timeout=60)
    assert seen[-1].compressor.key == ("sink-heavy", 0, 0.25)
    assert _tops(mean) != _tops(exact) and _tops(heavy) != _tops(mean)
    again = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, cache_salt="d",
                                             kv_compress="off"), timeout=60)
    assert _tops(again) == _tops(exact)  # off: exact (each salt computes the prompt alike)


def test_bad_values_are_invalid_argument_naming_the_field(plain):
    stub = _stub(plain)
    for fields, field in ((dict(kv_compress="h2o"), "kv_compress"),
                          (dict(kv_compress="mean", kv_compress_ratio=0.3), "kv_compress_ratio"),
                          (dict(kv_compress="mean", kv_compress_window=-5), "kv_compress_window")):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT[:10], sampling=SAMPLING, **fields), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in bad_request(e.value)] == [field]
    # a batch entry fails alone
    out = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[
        pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, kv_compress="mean", kv_compress_window=0),
        pb.GenerateRequest(prompt_token_ids=PROMPT[:10], sampling=SAMPLING, kv_compress="h2o")]), timeout=60)
    assert out.results[0].WhichOneof("result") == "response" and len(out.results[0].response.token_ids) == 8
    assert out.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_server_that_cannot_compress_refuses_and_says_why(quantized):
    stub = _stub(quantized)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.kv_dtype == "q4" and info.kv_compress == "off" and "q4" in info.kv_compress_unsupported
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, kv_compress="sink-heavy"),
                      timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(field, why)] = bad_request(e.value)
    assert field == "kv_compress" and "KV_DTYPE" in why and "q4" in why
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSession(pb.CreateSessionRequest(kv_compress="mean"), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=SAMPLING, kv_compress="off"), timeout=60)
    assert len(ok.token_ids) == 8


def test_model_info_reports_the_server_default(start_server):
    server = start_server(engine=dict(kv_dtype="fp32", kv_compress="sink-heavy", kv_compress_window=128,
                                      kv_compress_ratio=0.25))
    info = _stub(server).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.kv_compress, info.kv_compress_window, info.kv_compress_ratio) == ("sink-heavy", 128, 0.25)
    assert info.kv_compress_unsupported == ""
    with server.channel() as ch:  # the Python client's ModelInfo carries them
        mine = Client(channel=ch).model_info(timeout=30)
    assert (mine.kv_compress, mine.kv_compress_window, mine.kv_compress_ratio) == ("sink-heavy", 128, 0.25)


def test_a_session_keeps_its_choice(plain):
    stub = _stub(plain)
    sid = stub.CreateSession(pb.CreateSessionRequest(kv_compress="mean", kv_compress_window=0), timeout=30).session_id
    try:
        session = plain.gen.get_session(sid)
        assert session.cache.compressor.key == ("mean", 0, 0.5)
        first = stub.Generate(pb.GenerateRequest(session_id=sid, prompt_token_ids=PROMPT, sampling=SAMPLING),
                              timeout=60)
        assert session.cache.removed > 0  # parked compressed
        same = stub.Generate(pb.GenerateRequest(session_id=sid, prompt_token_ids=PROMPT[:5], sampling=SAMPLING,
                                                kv_compress="mean", kv_compress_window=0), timeout=60)
        assert same.usage.cached_tokens == first.usage.prompt_tokens + 7  # the history's rows, all reused
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(session_id=sid, prompt_token_ids=PROMPT[:5], sampling=SAMPLING,
                                             kv_compress="off"), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in bad_request(e.value)] == ["kv_compress"]
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=30)


def _call(server, method: str, path: str, body: dict | None = None, headers: dict | None = None
          ) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.server.http.port}/v1{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_the_openai_api_takes_it_as_an_extra_body_field(plain, quantized):
    model = plain.gen.cfg.name
    body = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    seen = _compressed_tables(plain)
    status, exact = _call(plain, "POST", "/completions", {**body, "user": "x"})
    assert status == 200, exact
    n = len(seen)
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{plain.server.http.port}/v1", api_key="unused", max_retries=0)
    try:  # the SDK's way to send a server's own fields
        mean = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                      user="y", extra_body={"ignore_eos": True, "kv_compress": "mean",
                                                            "kv_compress_window": 0})
    finally:
        sdk.close()
    assert len(seen) > n and seen[-1].compressor.key == ("mean", 0, 0.5)
    assert exact["choices"][0]["logprobs"]["top_logprobs"] != mean.choices[0].logprobs.top_logprobs
    for extra, param in (({"kv_compress": "h2o"}, "kv_compress"), ({"kv_compress": 1}, "kv_compress"),
                         ({"kv_compress": "mean", "kv_compress_ratio": 2}, "kv_compress_ratio")):
        status, r = _call(plain, "POST", "/completions", {**body, **extra})
        assert status == 400 and r["error"]["param"] == param, r
    status, r = _call(quantized, "POST", "/chat/completions",
                      dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, kv_compress="mean"))
    assert status == 400 and r["error"]["param"] == "kv_compress" and "q4" in r["error"]["message"], r
    # a session opened with a choice keeps it; a turn naming another is refused
    status, s = _call(plain, "POST", "/sessions", {"kv_compress": "sink-heavy", "kv_compress_window": 0})
    assert status == 200, s
    sid = s["session_id"]
    assert plain.gen.get_session(sid).cache.compressor.key == ("sink-heavy", 0, 0.5)
    status, r = _call(plain, "POST", "/completions", {**body, "kv_compress": "mean"}, {"x-session-id": sid})
    assert status == 400 and r["error"]["param"] == "kv_compress", r
    status, r = _call(plain, "POST", "/completions", body, {"x-session-id": sid})
    assert status == 200, r
    assert plain.gen.get_session(sid).cache.removed > 0
    assert _call(plain, "POST", "/sessions", {"kv_compress": "nope"})[0] == 400
    assert _call(plain, "DELETE", f"/sessions/{sid}")[0] == 200
