"""HTTP calls are counted and traced like RPCs: a duration histogram by route and status on the
metrics port, and a GenAI server span that continues the caller's traceparent, with the engine's
phase spans beneath it."""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvgen.service.tracing import Tracing
from tests.conftest import free_port

from .conftest import sdk

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def test_calls_are_counted_by_route_and_status(http_server, client, model):
    client.completions.create(model=model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_server.settings.metrics_port}/metrics").read().decode()
    for status in ("200", "400"):
        line = ('http_server_request_duration_seconds_count{http_request_method="POST",'
                f'http_response_status_code="{status}",http_route="/v1/completions"}}')
        assert line in text, status
    assert "kvgen_generation_tokens_total" in text  # the engine's own metrics count HTTP calls too


def test_a_call_is_traced_from_the_callers_traceparent(start_server, monkeypatch, model):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(Tracing, "from_env", classmethod(lambda cls: Tracing(provider)))
    srv = start_server(http_port=free_port())
    with sdk(srv) as c:
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True},
                                      extra_headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"})
    deadline = time.time() + 10
    while True:
        spans = [s for s in memory.get_finished_spans() if format(s.context.trace_id, "032x") == TRACE_ID]
        if any(s.name == "kvgen.decode" for s in spans) or time.time() > deadline:
            break
        time.sleep(0.02)
    (server_span,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert server_span.name == f"chat {model}"
    assert format(server_span.parent.span_id, "016x") == CALLER_SPAN and server_span.parent.is_remote
    a = server_span.attributes
    assert a["http.route"] == "/v1/chat/completions" and a["http.response.status_code"] == 200
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == model
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.response.finish_reasons"] == ("length",)
    phases = {s.name for s in spans if s.parent is not None and s.parent.span_id == server_span.context.span_id}
    assert {"kvgen.queue", "kvgen.prefill", "kvgen.decode"} <= phases
