"""What a router reads of an HTTP worker (kvgen/service/http/worker_routes.py): GET /health is 200
only while the engine serves (503 loading, draining, stalled), /metrics on the HTTP port is the
metrics port's registry (with the vLLM-named gauges the Gateway API Inference Extension reads),
/v1/loads is smg's load schema; /health and /metrics need no API key."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.service.http.app import HttpApi
from kvgen.service.settings import Settings
from tests.conftest import ServerThread, free_port

from .conftest import sdk


def _get(port: int, path: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _health(port: int) -> tuple[int, str]:
    status, body = _get(port, "/health")
    return status, json.loads(body)["status"]


def _samples(text: str) -> dict[tuple, float]:
    """(name, (label, value), ...) -> value, of a Prometheus text page (labels in name order)."""
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_is_503_while_the_model_loads(tiny_pair):
    async def run() -> list[tuple[int, str]]:
        api = HttpApi(Settings(host="127.0.0.1", http_port=free_port()))
        await api.start()
        seen = [await asyncio.to_thread(_health, api.port)]  # started, no engine yet: what a loading server is
        gen = Generator(*tiny_pair, EngineOptions(kv_cache_mb=16))
        try:
            api.bind(gen)
            seen.append(await asyncio.to_thread(_health, api.port))  # bound, but the server has not said ready
            api.serving = True
            seen.append(await asyncio.to_thread(_health, api.port))
        finally:
            await api.stop()
            gen.close()
        return seen

    assert asyncio.run(run()) == [(503, "loading"), (503, "draining"), (200, "serving")]


def test_health_turns_503_as_a_drain_begins_while_calls_are_still_served(tiny_pair):
    srv = ServerThread(Generator(*tiny_pair, EngineOptions(kv_cache_mb=16)), http_port=free_port(),
                       drain_delay_s=3.0)  # stopped here
    port, model = srv.server.http.port, srv.gen.cfg.name
    assert _health(port) == (200, "serving")
    drained = threading.Thread(target=srv.stop)
    drained.start()
    deadline = time.monotonic() + 5
    while _health(port)[0] == 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _health(port) == (503, "draining")
    # within DRAIN_DELAY_S a call a router sent before it saw the 503 is still answered
    with sdk(srv) as c:
        out = c.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and drained.is_alive()
    drained.join(30)
    assert not drained.is_alive()


def test_health_is_503_while_the_engine_makes_no_progress(tiny_pair):
    srv = ServerThread(Generator(*tiny_pair, EngineOptions(kv_cache_mb=16)), http_port=free_port(),
                       liveness_stall_s=0.5)
    try:
        port, engine = srv.server.http.port, srv.gen.engine
        go, held = threading.Event(), threading.Event()
        go.set()
        listeners = engine.on_step

        def on_step(batch, seconds):  # the engine thread waits here while `go` is clear: a wedged step
            if listeners:
                listeners(batch, seconds)
            if not go.is_set():
                held.set()
                go.wait(30)

        engine.on_step = on_step
        go.clear()
        done = threading.Thread(target=lambda: sdk(srv).completions.create(
            model=srv.gen.cfg.name, prompt="Once upon a time", max_tokens=8, temperature=0))
        done.start()
        assert held.wait(10)
        deadline = time.monotonic() + 5
        while _health(port)[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _health(port) == (503, "stalled")
        go.set()
        done.join(30)
        assert _health(port) == (200, "serving")
    finally:
        go.set()
        srv.stop()


@pytest.fixture(scope="module")
def keyed(start_server) -> ServerThread:
    return start_server(http_port=free_port(), api_key="k1")


def test_health_and_metrics_need_no_key_the_rest_does(keyed):
    port = keyed.server.http.port
    assert _get(port, "/health")[0] == 200
    assert _get(port, "/metrics")[0] == 200
    assert _get(port, "/v1/loads")[0] == 401 and _get(port, "/v1/models")[0] == 401
    assert _get(port, "/v1/loads", key="k1")[0] == 200


def test_metrics_on_the_http_port_are_the_metrics_ports(keyed):
    http_page = _get(keyed.server.http.port, "/metrics")[1].decode()
    with urllib.request.urlopen(f"http://127.0.0.1:{keyed.settings.metrics_port}/metrics", timeout=10) as r:
        port_page = r.read().decode()
    names = {k[0] for k in _samples(port_page)}
    assert names == {k[0] for k in _samples(http_page)}
    assert "kvgen_generation_tokens_total" in names and "gen_ai_server_time_to_first_token_seconds_bucket" in names


def test_the_vllm_named_gauges_follow_kvgens_own_while_a_stream_runs(keyed):
    """The model-server protocol's gauges under vLLM's names, and smg's /v1/loads, agree with
    kvgen's own while a request holds the batch and its KV blocks."""
    port, gen = keyed.server.http.port, keyed.gen
    pool, model = gen.pool, gen.cfg.name
    with sdk(keyed, api_key="k1") as c:
        stream = c.completions.create(model=model, prompt="Once upon a time", stream=True, max_tokens=1900,
                                      temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        m = _samples(_get(port, "/metrics")[1].decode())
        loads = json.loads(_get(port, "/v1/loads", key="k1")[1])
        stream.close()
    label = ("model_name", model)
    assert m[("vllm:num_requests_running", label)] == m[("kvgen_requests_running",)] == 1
    assert m[("vllm:num_requests_waiting", label)] == m[("kvgen_requests_waiting",)] == 0
    used = m[("kvgen_kv_blocks_used",)]
    assert used > 0 and m[("vllm:kv_cache_usage_perc", label)] == pytest.approx(used / pool.capacity)
    info = ("vllm:cache_config_info", ("block_size", str(pool.block_size)), label,
            ("num_gpu_blocks", str(pool.capacity)))
    assert m[info] == 1
    assert loads["dp_rank_count"] == 1
    (load,) = loads["loads"]
    assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
    assert load["max_total_num_tokens"] == pool.capacity * pool.block_size
    assert 0 < load["num_used_tokens"] <= 1900 + 16 + pool.block_size
    assert load["token_usage"] == pytest.approx(load["num_used_tokens"] / load["max_total_num_tokens"])
