"""LoRA adapters over the wire: GenerateRequest.adapter (alone, per BatchGenerate entry, per session at
CreateSession), the OpenAI `model` field and /v1/models (vLLM's convention), NOT_FOUND / 404 for an
adapter not loaded, GetModelInfo / GetLoad's adapters and vLLM's vllm:lora_requests_info gauge.

The server runs tests/engine/test_lora.py's tiny Llama and PEFT adapters; what an adapter should give
is the engine's own output for it, which that file checks against transformers + PEFT."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from kvgen.engine.generator import Generator, load_model
from kvgen.engine.options import EngineOptions
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import ServerThread, free_port
from tests.engine.test_lora import ADAPTERS, PROMPTS, STEPS, _run, base  # noqa: F401  (base: a fixture)


@pytest.fixture(scope="module")
def server(base):  # noqa: F811
    folder, _, adapters = base
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    gen = Generator(*load_model(str(folder), "fp32"), EngineOptions(lora_adapters=spec, max_loras=4))
    s = ServerThread(gen, http_port=free_port())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(server):
    """Each adapter's greedy tokens for PROMPTS[0] ("": the base model), from the engine itself."""
    gen = server.gen
    ids = gen.tokenize(PROMPTS[0])
    out = {name: _run(gen, [(ids, name)])[0].token_ids for name in ["", *ADAPTERS]}
    assert len({tuple(t) for t in out.values()}) == len(out)  # every adapter tells itself apart
    return out


def _request(adapter: str = "", **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPTS[0], adapter=adapter, sampling=pb.SamplingParams(
        temperature=0, max_new_tokens=STEPS, ignore_eos=True), **kw)


def test_the_adapter_field_selects_the_adapter(server, expected):
    with server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        for name in ["", *ADAPTERS]:
            assert list(stub.Generate(_request(name)).token_ids) == expected[name], name
        batch = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[_request(n) for n in ["", *ADAPTERS]]))
        assert [list(r.response.token_ids) for r in batch.results] == [expected[n] for n in ["", *ADAPTERS]]


def test_an_unknown_adapter_is_not_found_naming_it(server, expected):
    with server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(_request("nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()
        batch = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[_request("nope"), _request("attn")]))
        assert batch.results[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]  # that entry alone fails
        assert list(batch.results[1].response.token_ids) == expected["attn"]
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateSession(pb.CreateSessionRequest(adapter="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_session_runs_every_turn_with_its_adapter(server, expected):
    with server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest(adapter="mlp")).session_id
        try:
            assert list(stub.Generate(_request(session_id=sid)).token_ids) == expected["mlp"]
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(_request("attn", session_id=sid))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_get_model_info_and_get_load_list_the_adapters(server, expected):
    with server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert [(a.name, a.rank, list(a.target_modules)) for a in info.adapters] == [
            (name, r, sorted(targets)) for name, (targets, r, _, _) in ADAPTERS.items()]
        load = stub.GetLoad(pb.GetLoadRequest())
        assert [a.name for a in load.adapters] == list(ADAPTERS)
        assert all(a.requests >= 1 for a in load.adapters)  # `expected` ran each once at least


def _http(server, path: str, body: dict | None = None):
    url = f"http://127.0.0.1:{server.server.http.port}{path}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_openai_model_names_the_adapter_and_v1_models_lists_them(server, expected):
    base_name = server.gen.cfg.name
    models = _http(server, "/v1/models")["data"]
    assert [m["id"] for m in models] == [base_name, *ADAPTERS]
    assert all(m["parent"] == base_name for m in models[1:])
    tok = server.gen.tokenizer
    for name in ["", *ADAPTERS]:
        answer = _http(server, "/v1/completions", {"model": name or base_name, "prompt": PROMPTS[0],
                                                   "max_tokens": STEPS, "temperature": 0, "ignore_eos": True})
        assert answer["model"] == (name or base_name)
        assert answer["choices"][0]["text"] == tok.decode(expected[name]), name
    with pytest.raises(urllib.error.HTTPError) as e:
        _http(server, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert e.value.code == 404 and "'nope'" in json.loads(e.value.read())["error"]["message"]


def test_vllm_lora_requests_info_shows_the_running_adapters(server, expected):
    metrics = f"http://127.0.0.1:{server.settings.metrics_port}/metrics"
    with server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        long = pb.GenerateRequest(prompt=PROMPTS[0], adapter="ko", sampling=pb.SamplingParams(
            temperature=0, max_new_tokens=450, ignore_eos=True))
        stream = stub.GenerateStream(long)
        next(stream)  # running now, until it is cancelled
        try:
            text = urllib.request.urlopen(metrics, timeout=30).read().decode()
        finally:
            stream.cancel()
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'running_lora_adapters="ko"' in line and 'max_lora="4"' in line and 'waiting_lora_adapters=""' in line


# ---------------------------------------------------------------- loading and unloading at run time

USER, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def keyed(base):  # noqa: F811
    """A server with API keys, one of them admin, and no adapter loaded at start."""
    folder, _, _ = base
    gen = Generator(*load_model(str(folder), "fp32"), EngineOptions(max_loras=1))
    s = ServerThread(gen, http_port=free_port(), api_key=f"{USER},{ADMIN}", admin_api_keys=ADMIN)
    yield s
    s.stop()


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_load_and_unload_adapter_over_grpc_admin_only(keyed, base, expected):  # noqa: F811
    _, _, adapters = base
    with keyed.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        load = pb.LoadAdapterRequest(name="mlp", path=str(adapters["mlp"]))
        assert _code(lambda: stub.LoadAdapter(load)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.LoadAdapter(load, metadata=_auth(USER))) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: stub.Generate(_request("mlp"), metadata=_auth(USER))) == grpc.StatusCode.NOT_FOUND
        bad = pb.LoadAdapterRequest(name="x", path="/nonexistent/adapter")  # refused, its slot given back
        assert _code(lambda: stub.LoadAdapter(bad, metadata=_auth(ADMIN))) == grpc.StatusCode.INVALID_ARGUMENT
        got = stub.LoadAdapter(load, metadata=_auth(ADMIN)).adapter
        assert (got.name, got.rank) == ("mlp", ADAPTERS["mlp"][1])
        # a user's request runs it as the server that loaded it at start does
        assert list(stub.Generate(_request("mlp"), metadata=_auth(USER)).token_ids) == expected["mlp"]
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=_auth(USER))
        assert [a.name for a in info.adapters] == ["mlp"]
        assert _code(lambda: stub.LoadAdapter(load, metadata=_auth(ADMIN))) == grpc.StatusCode.ALREADY_EXISTS
        more = pb.LoadAdapterRequest(name="attn", path=str(adapters["attn"]))
        assert _code(lambda: stub.LoadAdapter(more, metadata=_auth(ADMIN))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        unload = pb.UnloadAdapterRequest(name="mlp")
        assert _code(lambda: stub.UnloadAdapter(unload, metadata=_auth(USER))) == grpc.StatusCode.PERMISSION_DENIED
        stub.UnloadAdapter(unload, metadata=_auth(ADMIN))
        assert _code(lambda: stub.Generate(_request("mlp"), metadata=_auth(USER))) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: stub.UnloadAdapter(unload, metadata=_auth(ADMIN))) == grpc.StatusCode.NOT_FOUND
        # the slot is free again, and the base model never stopped serving
        assert list(stub.Generate(_request(), metadata=_auth(USER)).token_ids) == expected[""]


def _post(server, path: str, body: dict, key: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{server.server.http.port}{path}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_vllms_load_and_unload_lora_adapter_routes(keyed, base, expected):  # noqa: F811
    _, _, adapters = base
    body = {"lora_name": "attn", "lora_path": str(adapters["attn"])}
    assert _post(keyed, "/v1/load_lora_adapter", body, USER)[0] == 403
    status, text = _post(keyed, "/v1/load_lora_adapter", body, ADMIN)
    assert status == 200 and text.startswith("Success")
    assert _post(keyed, "/v1/load_lora_adapter", body, ADMIN)[0] == 400  # loaded already (vLLM: 400)
    status, text = _post(keyed, "/v1/completions", {"model": "attn", "prompt": PROMPTS[0], "max_tokens": STEPS,
                                                    "temperature": 0, "ignore_eos": True}, USER)
    assert status == 200 and json.loads(text)["choices"][0]["text"] == keyed.gen.tokenizer.decode(expected["attn"])
    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "attn"}, USER)[0] == 403
    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "attn"}, ADMIN)[0] == 200
    status, text = _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "attn"}, ADMIN)
    assert status == 404 and "'attn'" in json.loads(text)["error"]["message"]
    assert _post(keyed, "/v1/completions", {"model": "attn", "prompt": "hi", "max_tokens": 1}, USER)[0] == 404
