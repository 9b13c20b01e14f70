"""A client that goes away cancels its generation (streamed or not), and its KV blocks go back to
the pool; on drain, a stream in flight finishes and new connections are refused."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from kvgen.engine.generator import EngineOptions, Generator
from tests.conftest import ServerThread, free_port

from .conftest import sdk, wait_released

LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def _cancelled(srv) -> float:
    return srv.server.metrics.finished.labels("cancelled")._value.get()


def _until_generating(srv, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while not srv.gen.scheduler.kv.used and time.time() < deadline:
        time.sleep(0.005)
    assert srv.gen.scheduler.kv.used > 0


def test_closing_a_stream_cancels_it(http_server, model):
    before = _cancelled(http_server)
    with sdk(http_server) as c:
        stream = c.completions.create(model=model, prompt="Once upon a time", stream=True, max_tokens=1900,
                                      temperature=0, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].text is not None and http_server.gen.scheduler.kv.used > 0
        stream.close()
    wait_released(http_server)
    assert _cancelled(http_server) == before + 1


def test_n_streamed_choices_are_all_cancelled(http_server, model):
    before = _cancelled(http_server)
    with sdk(http_server) as c:
        stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=3,
                                           stream=True, max_tokens=1900, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
    wait_released(http_server)
    assert _cancelled(http_server) == before + 3


def test_a_client_that_hangs_up_on_a_whole_reply_cancels_it(http_server, model):
    before = _cancelled(http_server)
    body = json.dumps({"model": model, "prompt": "Once upon a time", **LONG}).encode()
    with socket.create_connection(("127.0.0.1", http_server.server.http.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _until_generating(http_server)
    wait_released(http_server)
    assert _cancelled(http_server) == before + 1


@pytest.mark.timeout(120)
def test_drain_lets_a_stream_finish_and_refuses_new_connections(tiny_pair):
    srv = ServerThread(Generator(*tiny_pair, EngineOptions(kv_cache_mb=16)), http_port=free_port())  # stopped here
    port, name, engine = srv.server.http.port, srv.gen.cfg.name, srv.gen.engine
    # the engine waits in its steps while `go` is clear: the stream is held mid-flight as the drain begins
    go, held, at = threading.Event(), threading.Event(), []
    go.set()
    listeners = engine.on_step

    def on_step(batch, seconds):
        if listeners:
            listeners(batch, seconds)
        if not go.is_set():
            at.extend(len(seq.output_ids) for seq, _ in batch)  # tokens the stream had, this step not yet sampled
            held.set()
            go.wait(30)

    engine.on_step = on_step
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": name, "prompt": "Once upon a time", "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 600, "ignore_eos": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: {") and json.loads(first[6:])["choices"][0]["finish_reason"] is None
    go.clear()
    assert held.wait(10) and len(at) == 1 and at[0] < 600  # the stream is running, with tokens to go
    drained = threading.Thread(target=srv.stop)  # drain (grace 5 s), then the loop ends
    drained.start()
    deadline = time.monotonic() + 10
    while not srv.server.http.routes.draining and time.monotonic() < deadline:
        time.sleep(0.005)
    assert srv.server.http.routes.draining and drained.is_alive()  # the drain began, the stream still open
    go.set()
    rest = resp.read().decode()  # the stream runs to its end
    conn.close()
    events = [line[6:] for line in (first.decode() + rest).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 600
    drained.join(30)
    with pytest.raises(ConnectionError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
