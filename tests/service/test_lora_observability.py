"""A LoRA adapter on a request's spans and metrics, over gRPC and over the OpenAI HTTP API (issue #44:
"adapter on spans and metrics"): the request span and its kvgen.queue / kvgen.prefill / kvgen.decode
spans carry kvgen.lora_adapter (a session's turns too, named by the session, not the call; a refused
adapter's span names what was asked for, over either transport), a base-model request's spans carry
none, gen_ai.response.model is the adapter that answered (vLLM's convention: the adapter is the model)
and the base model's name without one, and kvgen_lora_requests_finished counts each transport's
requests by adapter.

A tiny-model server (tests/service/conftest.py's, with its random PEFT adapter) traced into an
in-memory exporter."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvgen.service.tracing import LORA_ADAPTER as ATTR
from kvgen.service.tracing import Tracing
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import free_port
from tests.service.conftest import LORA_ADAPTER, write_tiny_adapter
from tests.service.http.conftest import sdk
from tests.service.test_tracing import named, spans_of, traceparent

PHASES = ("kvgen.queue", "kvgen.prefill", "kvgen.decode")


@pytest.fixture(scope="module")
def traced(start_server, tmp_path_factory):
    """A server with the tiny adapter loaded and the HTTP API on, its spans kept in .memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    path = write_tiny_adapter(tmp_path_factory.mktemp("lora"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tracing, "from_env", classmethod(lambda cls: Tracing(provider)))
        srv = start_server(engine={"lora_adapters": f"{LORA_ADAPTER}={path}"}, http_port=free_port())
    srv.memory = memory
    return srv


def _request(adapter: str = "", **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hello there", adapter=adapter, sampling=pb.SamplingParams(
        temperature=0, max_new_tokens=4, ignore_eos=True), **kw)


def _finished(srv, adapter: str, want: float | None = None, timeout: float = 10) -> float:
    """kvgen_lora_requests_finished_total for adapter, as the metrics port shows it (once it is `want`:
    a request is counted when the engine lets it go, just after its answer)."""
    deadline = time.time() + timeout
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.settings.metrics_port}/metrics",
                                      timeout=30).read().decode()
        m = re.search(rf'^kvgen_lora_requests_finished_total{{adapter="{re.escape(adapter)}"}} (\S+)$', text, re.M)
        value = float(m.group(1)) if m else 0.0
        if want is None or value == want or time.time() > deadline:
            return value
        time.sleep(0.02)


def _request_tree(srv, trace_id: str, requests: int):
    """The trace's spans once every request's decode span and the spans its phases hang from have ended
    (an HTTP stream's server span ends after its last chunk left, which the client may read first):
    {request span: its phase spans}."""
    def done(spans) -> bool:
        ended = {s.context.span_id for s in spans}
        return (len(named(spans, "kvgen.decode")) == requests
                and all(s.parent.span_id in ended for s in spans if s.name in PHASES))

    spans = spans_of(srv.memory, trace_id, done)
    phases = [s for s in spans if s.name in PHASES]
    parents = {s.parent.span_id for s in phases}
    return {s: [p for p in phases if p.parent.span_id == s.context.span_id]
            for s in spans if s.context.span_id in parents}


def _assert_named(tree: dict, adapter: str | None) -> None:
    for span, phases in tree.items():
        assert sorted(p.name for p in phases) == sorted(PHASES), span.name
        for s in (span, *phases):
            assert s.attributes.get(ATTR) == adapter, (s.name, dict(s.attributes))


def test_grpc_generate_and_batch_entries_name_their_adapter(traced):
    before = _finished(traced, LORA_ADAPTER)
    with traced.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        stub.Generate(_request(LORA_ADAPTER), metadata=traceparent("a1" * 16))
        stub.Generate(_request(), metadata=traceparent("a2" * 16))
        stub.BatchGenerate(pb.BatchGenerateRequest(requests=[_request(LORA_ADAPTER), _request()]),
                           metadata=traceparent("a3" * 16))
    base = traced.gen.cfg.name
    (single,) = _request_tree(traced, "a1" * 16, 1).items()
    assert single[0].kind == SpanKind.SERVER
    _assert_named(dict([single]), LORA_ADAPTER)
    _assert_answered_by(single[0], LORA_ADAPTER, base)
    plain = _request_tree(traced, "a2" * 16, 1)
    _assert_named(plain, None)  # the base model's: no adapter named
    _assert_answered_by(next(iter(plain)), base, base)
    entries = _request_tree(traced, "a3" * 16, 2)  # one INTERNAL span per entry
    assert all(s.kind == SpanKind.INTERNAL for s in entries)
    _assert_named({s: p for s, p in entries.items() if s.attributes.get(ATTR)}, LORA_ADAPTER)
    assert len([s for s in entries if s.attributes.get(ATTR)]) == 1
    for s in entries:  # each entry answered by its own model
        _assert_answered_by(s, LORA_ADAPTER if s.attributes.get(ATTR) else base, base)
    assert _finished(traced, LORA_ADAPTER, before + 2) == before + 2


def _assert_answered_by(span, model: str, base: str) -> None:
    """gen_ai.response.model is the model that answered (an adapter's name: vLLM's convention), the span
    named for the operation and the model asked for (gRPC's request names the base model and the adapter)."""
    assert span.attributes["gen_ai.response.model"] == model, dict(span.attributes)
    assert span.attributes["gen_ai.request.model"] == base


def test_a_grpc_stream_with_an_adapter_is_answered_by_the_adapter(traced):
    with traced.channel() as ch:
        list(pb_grpc.GeneratorStub(ch).GenerateStream(_request(LORA_ADAPTER), metadata=traceparent("a4" * 16)))
    (span, phases), = _request_tree(traced, "a4" * 16, 1).items()
    _assert_named({span: phases}, LORA_ADAPTER)
    _assert_answered_by(span, LORA_ADAPTER, traced.gen.cfg.name)


def test_a_session_turn_names_the_sessions_adapter(traced):
    with traced.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        sid = stub.CreateSession(pb.CreateSessionRequest(adapter=LORA_ADAPTER)).session_id
        try:  # the turn does not name the adapter: the session does
            stub.Generate(_request(session_id=sid), metadata=traceparent("b1" * 16))
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    tree = _request_tree(traced, "b1" * 16, 1)
    _assert_named(tree, LORA_ADAPTER)
    (span,) = tree
    _assert_answered_by(span, LORA_ADAPTER, traced.gen.cfg.name)  # the session's adapter answered


def test_a_refused_adapter_is_named_on_the_refused_span(traced):
    with traced.channel() as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GeneratorStub(ch).Generate(_request("nope"), metadata=traceparent("c1" * 16))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    (span,) = spans_of(traced.memory, "c1" * 16, lambda s: len(s) == 1)
    assert span.attributes[ATTR] == "nope" and span.attributes["error.type"] == "NOT_FOUND"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_http_calls_name_their_adapter(traced, stream):
    before = _finished(traced, LORA_ADAPTER)
    trace_id = ("d2" if stream else "d1") * 16
    with sdk(traced) as c:
        r = c.chat.completions.create(model=LORA_ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0, stream=stream, extra_body={"ignore_eos": True},
                                      extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        if stream:
            list(r)
    (server_span, phases), = _request_tree(traced, trace_id, 1).items()
    assert server_span.kind == SpanKind.SERVER and server_span.attributes["http.route"] == "/v1/chat/completions"
    _assert_named({server_span: phases}, LORA_ADAPTER)
    # the answer's `model` is the adapter (vLLM's convention), and so is the span's response model
    assert server_span.attributes["gen_ai.response.model"] == LORA_ADAPTER
    assert server_span.attributes["gen_ai.request.model"] == traced.gen.cfg.name
    assert _finished(traced, LORA_ADAPTER, before + 1) == before + 1


def test_an_unknown_adapter_over_http_is_named_on_the_refused_span(traced):
    """404 naming it, and the HTTP server span (the only one: nothing reached the engine) names the
    adapter asked for, as gRPC's refused span does."""
    with sdk(traced) as c, pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="nope", prompt="hi", max_tokens=1,
                             extra_headers={"traceparent": f"00-{'e1' * 16}-00f067aa0ba902b7-01"})
    assert "'nope'" in str(e.value) and e.value.body["code"] == "model_not_found"
    (span,) = spans_of(traced.memory, "e1" * 16, lambda s: len(s) == 1)
    assert span.kind == SpanKind.SERVER and span.attributes["http.route"] == "/v1/completions"
    assert span.attributes[ATTR] == "nope" and span.attributes["http.response.status_code"] == 404
    assert "gen_ai.response.model" not in span.attributes  # nothing answered


def test_an_http_session_turn_is_answered_by_the_sessions_adapter(traced):
    """A turn naming the base model ("kvgen") in a session opened with the adapter runs with the adapter:
    the answer's `model`, the span's response model and every span's adapter say so."""
    with sdk(traced) as c:
        sid = c.post("/sessions", body={"model": LORA_ADAPTER}, cast_to=object)["session_id"]
        try:
            r = c.completions.create(model="kvgen", prompt="hi", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True},
                                     extra_headers={"x-session-id": sid,
                                                    "traceparent": f"00-{'e2' * 16}-00f067aa0ba902b7-01"})
        finally:
            c.delete(f"/sessions/{sid}", cast_to=object)
    assert r.model == LORA_ADAPTER
    (span, phases), = _request_tree(traced, "e2" * 16, 1).items()
    _assert_named({span: phases}, LORA_ADAPTER)
    assert span.attributes["gen_ai.response.model"] == LORA_ADAPTER
    assert span.attributes["gen_ai.conversation.id"] == sid
