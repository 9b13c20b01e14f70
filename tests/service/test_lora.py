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
from tests.engine.test_lora import ADAPTERS, PROMPTS, STEPS, _run, base, mamba2_adapter  # noqa: F401  (fixtures)
from tests.engine.test_mamba2 import files  # noqa: F401  (a fixture: the tiny Mamba-2)


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


# ---- loading and unloading at run time: LoadAdapter / UnloadAdapter and vLLM's HTTP routes, admin-only ----

TENANT, ADMIN = "tenant-key", "admin-key"


def _keyed_server(model: str, max_loras: int) -> ServerThread:
    """A server over `model` with API keys (one of them an admin's), no adapter loaded at start."""
    gen = Generator(*load_model(model, "fp32"), EngineOptions(max_loras=max_loras))
    return ServerThread(gen, http_port=free_port(), api_key=f"{TENANT},{ADMIN}", admin_api_keys=ADMIN)


@pytest.fixture(scope="module")
def keyed(base):  # noqa: F811
    """A keyed server, room for two adapters."""
    s = _keyed_server(str(base[0]), 2)
    yield s
    s.stop()


def _meta(key: str):
    return (("authorization", f"Bearer {key}"),)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_load_and_unload_adapter_over_grpc(base, keyed, tmp_path):  # noqa: F811
    from tests.engine.test_lora import convert_lora

    ko_gguf = convert_lora(base[2]["ko"], base[0], tmp_path / "ko.gguf")
    ids = keyed.gen.tokenize(PROMPTS[0])
    with keyed.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        load = lambda name, path, key=ADMIN: stub.LoadAdapter(  # noqa: E731
            pb.LoadAdapterRequest(name=name, path=str(path)), metadata=_meta(key))
        unload = lambda name, timeout=0.0: stub.UnloadAdapter(  # noqa: E731
            pb.UnloadAdapterRequest(name=name, timeout_seconds=timeout), metadata=_meta(ADMIN))
        assert _code(lambda: load("ko", ko_gguf, TENANT))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: load("ko", ko_gguf, "wrong"))[0] == grpc.StatusCode.UNAUTHENTICATED
        reply = load("ko", ko_gguf)
        assert (reply.adapter.name, reply.adapter.rank) == ("ko", 16)
        assert sorted(reply.adapter.target_modules) == ["k_proj", "o_proj"]
        got = list(stub.Generate(_request("ko"), metadata=_meta(TENANT)).token_ids)  # a tenant may use it
        assert got == _run(keyed.gen, [(ids, "ko")])[0].token_ids
        assert got != list(stub.Generate(_request(""), metadata=_meta(TENANT)).token_ids)
        code, details = _code(lambda: load("ko", base[2]["attn"]))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "'ko'" in details
        code, details = _code(lambda: load("bad", tmp_path / "missing"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a folder" in details
        assert _code(lambda: load("a,b", ko_gguf))[0] == grpc.StatusCode.INVALID_ARGUMENT  # the gate
        load("attn", base[2]["attn"])
        code, details = _code(lambda: load("mlp", base[2]["mlp"]))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "MAX_LORAS=2" in details
        long = pb.GenerateRequest(prompt=PROMPTS[0], adapter="ko", sampling=pb.SamplingParams(
            temperature=0, max_new_tokens=400, ignore_eos=True))
        stream = stub.GenerateStream(long, metadata=_meta(TENANT))
        next(stream)  # running with "ko"
        code, details = _code(lambda: unload("ko", 0.3))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "stays loaded" in details
        stream.cancel()
        unload("ko", 30)  # waits until the cancelled stream's request is let go
        code, details = _code(lambda: stub.Generate(_request("ko"), metadata=_meta(TENANT)))
        assert code == grpc.StatusCode.NOT_FOUND and "'ko'" in details
        assert _code(lambda: unload("ko"))[0] == grpc.StatusCode.NOT_FOUND
        assert [a.name for a in stub.GetLoad(pb.GetLoadRequest(), metadata=_meta(TENANT)).adapters] == ["attn"]
        unload("attn")
    assert keyed.gen.adapters.names() == []


def _post(server, path: str, body: dict, key: str | None):
    url = f"http://127.0.0.1:{server.server.http.port}{path}"
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]


def test_vllm_load_and_unload_lora_adapter_over_http(base, keyed):  # noqa: F811
    load = {"lora_name": "every", "lora_path": str(base[2]["every"])}
    assert _post(keyed, "/v1/load_lora_adapter", load, None)[0] == 401
    assert _post(keyed, "/v1/load_lora_adapter", load, TENANT)[0] == 403
    assert _post(keyed, "/v1/load_lora_adapter", load, ADMIN) == (
        200, "Success: LoRA adapter 'every' added successfully.")
    status, message = _post(keyed, "/v1/load_lora_adapter", load, ADMIN)
    assert status == 400 and "loaded already" in message
    status, message = _post(keyed, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nope"}, ADMIN)
    assert status == 400 and "'x'" in message
    status, answer = _post(keyed, "/v1/completions", {"model": "every", "prompt": PROMPTS[0], "max_tokens": STEPS,
                                                       "temperature": 0, "ignore_eos": True}, TENANT)
    ids = keyed.gen.tokenize(PROMPTS[0])
    assert status == 200
    assert json.loads(answer)["choices"][0]["text"] == keyed.gen.tokenizer.decode(
        _run(keyed.gen, [(ids, "every")])[0].token_ids)
    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "every"}, TENANT)[0] == 403
    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "every"}, ADMIN) == (
        200, "Success: LoRA adapter 'every' removed successfully.")
    status, message = _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "every"}, ADMIN)
    assert status == 404 and "'every'" in message
    status, message = _post(keyed, "/v1/completions", {"model": "every", "prompt": "hi", "max_tokens": 1}, TENANT)
    assert status == 404 and "'every'" in message


def test_the_python_clients_load_use_and_unload_an_adapter(base, keyed):  # noqa: F811
    import asyncio

    from kvgen.client import AsyncClient, Client, PermissionDenied
    from kvgen.client import NotFound as ClientNotFound

    ids = keyed.gen.tokenize(PROMPTS[0])
    with Client(keyed.target, api_key=ADMIN) as admin, Client(keyed.target, api_key=TENANT) as tenant:
        with pytest.raises(PermissionDenied):
            tenant.load_adapter("attn", str(base[2]["attn"]))
        info = admin.load_adapter("attn", str(base[2]["attn"]))
        assert (info.name, info.rank, info.target_modules) == ("attn", 4, ("q_proj", "v_proj"))
        got = tenant.generate(PROMPTS[0], adapter="attn", temperature=0, max_new_tokens=STEPS, ignore_eos=True)
        assert list(got.token_ids) == _run(keyed.gen, [(ids, "attn")])[0].token_ids
        admin.unload_adapter("attn", wait=5)
        with pytest.raises(ClientNotFound):
            tenant.generate(PROMPTS[0], adapter="attn", max_new_tokens=1)

    async def aio():
        async with AsyncClient(keyed.target, api_key=ADMIN) as admin:
            info = await admin.load_adapter("ko", str(base[2]["ko"]))
            got = await admin.generate(PROMPTS[0], adapter="ko", temperature=0, max_new_tokens=STEPS, ignore_eos=True)
            return info, got

    info, got = asyncio.run(aio())
    assert info.name == "ko" and list(got.token_ids) == _run(keyed.gen, [(ids, "ko")])[0].token_ids
    asyncio.run(_unload_async(keyed.target, "ko"))
    assert keyed.gen.adapters.names() == []


async def _unload_async(target: str, name: str) -> None:
    from kvgen.client import AsyncClient

    async with AsyncClient(target, api_key=ADMIN) as admin:
        await admin.unload_adapter(name)


# ---- a Mamba-2 base (tests/engine/test_mamba2.py's tiny model): every load refused, naming the family ----


@pytest.fixture(scope="module")
def mamba2_server(files):  # noqa: F811
    """A keyed server over the tiny Mamba-2, room for one adapter."""
    s = _keyed_server(str(files[0]), 1)
    yield s
    s.stop()


def test_loading_an_adapter_on_a_mamba2_server_fails_its_precondition_and_it_serves_on(files, mamba2_adapter,  # noqa: F811
                                                                                        mamba2_server):
    """LoadAdapter: FAILED_PRECONDITION, vLLM's POST /v1/load_lora_adapter: 400 (code failed_precondition), each
    naming the adapter and the family, again on a second try (no name or MAX_LORAS slot kept); GetLoad lists no
    adapter, and a tenant's greedy Generate then equals transformers'."""
    from tests.engine.test_mamba2 import PROMPTS as MAMBA_PROMPTS
    from tests.engine.test_mamba2 import STEPS as MAMBA_STEPS
    from tests.engine.test_mamba2 import expected

    said = f"LoRA adapter 'a' ({mamba2_adapter}): the base model is a mamba2 model, which takes no LoRA adapters"
    with mamba2_server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        for _ in range(2):
            code, details = _code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(mamba2_adapter)),
                                                           metadata=_meta(ADMIN)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(said), details
        assert _code(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(mamba2_adapter)),
                                              metadata=_meta(TENANT)))[0] == grpc.StatusCode.PERMISSION_DENIED
        for _ in range(2):
            url = f"http://127.0.0.1:{mamba2_server.server.http.port}/v1/load_lora_adapter"
            req = urllib.request.Request(url, data=json.dumps({"lora_name": "a", "lora_path": str(mamba2_adapter)})
                                         .encode(), headers={"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {ADMIN}"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            error = json.loads(e.value.read())["error"]
            assert e.value.code == 400 and error["code"] == "failed_precondition", error
            assert error["message"].startswith(said), error
        assert list(stub.GetLoad(pb.GetLoadRequest(), metadata=_meta(TENANT)).adapters) == []
        ids = mamba2_server.gen.tokenize(MAMBA_PROMPTS[0])
        reply = stub.Generate(pb.GenerateRequest(prompt=MAMBA_PROMPTS[0], sampling=pb.SamplingParams(
            temperature=0, max_new_tokens=MAMBA_STEPS, ignore_eos=True)), metadata=_meta(TENANT))
    assert list(reply.token_ids) == expected(files[2], ids)
    assert mamba2_server.gen.adapters.names() == [] and not mamba2_server.gen.adapters._busy


def test_lora_adapters_on_a_mamba2_model_stop_the_server_at_start_in_one_line(files, mamba2_adapter):  # noqa: F811
    """The server process with MODEL the tiny Mamba-2 and LORA_ADAPTERS naming an adapter: one ERROR line naming
    the setting, the adapter and the family, exit status 2, no traceback (as tests/service/test_unsupported_model.py
    for a family kvgen does not run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "MODEL": str(files[0]), "LORA_ADAPTERS": f"a={mamba2_adapter}", "PORT": str(free_port()),
           "HTTP_PORT": str(free_port()), "METRICS_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-m", "kvgen.service.server"], cwd=Path(__file__).resolve().parents[2],
                         env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert out.returncode == 2, out.stdout
    errors = [line for line in out.stdout.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and out.stdout.rstrip().endswith(errors[0]), out.stdout
    assert "not starting: LORA_ADAPTERS: LoRA adapter 'a'" in errors[0] and "a mamba2 model" in errors[0], errors[0]
    assert "Traceback" not in out.stdout and "Event loop is closed" not in out.stdout, out.stdout
