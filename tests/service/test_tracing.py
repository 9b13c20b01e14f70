"""Tracing: OTEL_* configuration, the span tree of a traced request, KV events, and tracing off.

The traced server is configured only through the environment (OTLP/gRPC to a receiver this
module runs on loopback); an in-memory exporter added to its provider shows the same spans.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvgen.client import request
from kvgen.engine.generator import EngineOptions, Generator
from kvgen.service.tracing import Tracing, exporters_from_env
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import ServerThread

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle on the beach."


def traceparent(trace_id: str = TRACE_ID, sampled: bool = True) -> tuple[tuple[str, str]]:
    return (("traceparent", f"00-{trace_id}-{CALLER_SPAN}-{'01' if sampled else '00'}"),)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback that keeps what it is sent."""

    def __init__(self):
        self.spans = []  # (resource attributes, span)
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, req, context):
        for rs in req.resource_spans:
            res = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                self.spans.extend((res, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def in_trace(self, trace_id: str):
        return [(res, s) for res, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.stop(0)


@pytest.fixture(scope="module")
def traced(embedded, receiver):
    """A server whose tracing comes from OTEL_* (OTLP to the receiver), plus an in-memory copy."""
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "kvgen-test", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("OTEL_TRACES_SAMPLER", raising=False)
        # a small prefill budget: a prompt takes several chunks
        server = ServerThread(Generator(*embedded, EngineOptions(token_budget=8, kv_cache_mb=64)))
    assert server.server.tracing is not None
    memory = InMemorySpanExporter()
    server.server.tracing.provider.add_span_processor(SimpleSpanProcessor(memory))
    server.memory = memory
    yield server
    server.stop()


def spans_of(memory: InMemorySpanExporter, trace_id: str, until, timeout: float = 10):
    """This trace's finished spans, once until(spans) holds (the phase spans end on the engine thread)."""
    deadline = time.time() + timeout
    while True:
        spans = [s for s in memory.get_finished_spans() if format(s.context.trace_id, "032x") == trace_id]
        if until(spans) or time.time() > deadline:
            return spans
        time.sleep(0.02)


def named(spans, name):
    return [s for s in spans if s.name == name]


def events(span, name):
    return [e for e in span.events if e.name == name]


def test_stream_with_traceparent_is_traced_into_the_kv_cache(traced, receiver):
    gen = traced.gen
    model = gen.cfg.name
    with traced.channel() as ch:
        msgs = list(pb_grpc.GeneratorStub(ch).GenerateStream(
            request(PROMPT, max_new_tokens=20, ignore_eos=True, temperature=0.0, request_id="r-1"),
            metadata=traceparent()))
    usage = msgs[-1].usage
    spans = spans_of(traced.memory, TRACE_ID, lambda s: len(named(s, "kvgen.decode")) == 1 and len(s) >= 5)

    # the server span continues the caller's trace and is named and attributed per GenAI
    (rpc,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert rpc.name == f"text_completion {model}"
    assert format(rpc.parent.span_id, "016x") == CALLER_SPAN and rpc.parent.is_remote
    a = rpc.attributes
    assert a["rpc.method"] == "GenerateStream" and a["rpc.service"] == "kvgen.v1.Generator"
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "kvgen"
    assert a["gen_ai.request.model"] == model and a["gen_ai.request.max_tokens"] == 20
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.stream"] is True
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens > 8
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens == 20
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.response.id"] == "r-1"

    # queue -> prefill (in chunks) -> decode, children of the server span, in time order
    queue, prefill, decode = (named(spans, n)[0] for n in ("kvgen.queue", "kvgen.prefill", "kvgen.decode"))
    for s in (queue, prefill, decode):
        assert s.parent.span_id == rpc.context.span_id
    assert rpc.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
    assert prefill.end_time <= decode.start_time <= decode.end_time
    chunks = sorted(named(spans, "kvgen.prefill.chunk"), key=lambda s: s.start_time)
    assert len(chunks) == -(-usage.prompt_tokens // 8) and all(c.parent.span_id == prefill.context.span_id
                                                                for c in chunks)
    assert [c.attributes["kvgen.chunk.start"] for c in chunks] == list(range(0, usage.prompt_tokens, 8))
    assert sum(c.attributes["kvgen.chunk.tokens"] for c in chunks) == usage.prompt_tokens
    assert decode.attributes["kvgen.decode.steps"] == 19  # the first token came out of the prefill
    seq_id = decode.attributes["kvgen.seq.id"]

    # KV events: per block, not per token or layer; attributes as the pool has them
    allocs = [e for s in (queue, prefill, decode) for e in events(s, "kv.alloc")]  # admission reserves
    assert events(queue, "kv.alloc")
    (free,) = events(decode, "kv.free")
    bpb = gen.pool.fmt.bytes_per_block()
    for e in (*allocs, free):
        assert e.attributes["kvgen.kv.layers"] == 30 and e.attributes["kvgen.kv.dtype"] == "fp32"
        assert e.attributes["kvgen.seq.id"] == seq_id
        assert e.attributes["kvgen.kv.bytes"] == e.attributes["kvgen.kv.blocks"] * bpb
    written = usage.prompt_tokens + usage.completion_tokens - 1  # the last token's K/V is never computed
    blocks = -(-written // gen.pool.block_size)
    assert sum(e.attributes["kvgen.kv.blocks"] for e in allocs) == free.attributes["kvgen.kv.blocks"] == blocks
    appends = events(prefill, "kv.append") + events(decode, "kv.append")
    assert sum(e.attributes["kvgen.kv.tokens"] for e in appends) == written
    assert len(appends) <= len(chunks) + blocks  # coalesced: one per chunk or block, not per token
    assert not events(queue, "kv.preempt")

    # the same spans reached the OTLP receiver, from a resource named by OTEL_SERVICE_NAME
    ids = {s.context.span_id.to_bytes(8, "big") for s in spans}
    deadline = time.time() + 10
    while not ids <= {s.span_id for _, s in receiver.in_trace(TRACE_ID)} and time.time() < deadline:
        traced.server.tracing.provider.force_flush()
        time.sleep(0.05)
    got = receiver.in_trace(TRACE_ID)
    assert ids <= {s.span_id for _, s in got}
    assert {res["service.name"] for res, _ in got} == {"kvgen-test"}
    otlp_rpc = next(s for _, s in got if s.span_id == rpc.context.span_id.to_bytes(8, "big"))
    assert otlp_rpc.parent_span_id.hex() == CALLER_SPAN
    assert any(e.name == "kv.free" for _, s in got for e in s.events)


def test_batch_entries_and_sessions(traced):
    trace_id = "1" * 32
    with traced.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        reqs = [request("The sky is", max_new_tokens=2, ignore_eos=True),
                request([{"role": "user", "content": "Hi"}], max_new_tokens=2, ignore_eos=True)]
        stub.BatchGenerate(pb.BatchGenerateRequest(requests=reqs), metadata=traceparent(trace_id))
        sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
        session_trace = "2" * 32
        for i in range(2):
            r = stub.Generate(request(f"Turn {i}: hello", session_id=sid, max_new_tokens=3, temperature=0.0),
                              metadata=traceparent(session_trace))
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    model = traced.gen.cfg.name
    spans = spans_of(traced.memory, trace_id, lambda s: len(named(s, "kvgen.decode")) == 2)
    (rpc,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert rpc.name == "/kvgen.v1.Generator/BatchGenerate"
    entries = [s for s in spans if s.kind == SpanKind.INTERNAL and s.name.endswith(model)]
    assert sorted(s.name for s in entries) == [f"chat {model}", f"text_completion {model}"]
    for e in entries:
        assert e.parent.span_id == rpc.context.span_id
        assert e.attributes["gen_ai.usage.output_tokens"] == 2
        kids = {s.name for s in spans if s.parent and s.parent.span_id == e.context.span_id}
        assert kids == {"kvgen.queue", "kvgen.prefill", "kvgen.decode"}

    spans = spans_of(traced.memory, session_trace, lambda s: len(named(s, "kvgen.decode")) == 2)
    turns = sorted((s for s in spans if s.kind == SpanKind.SERVER), key=lambda s: s.start_time)
    assert [t.attributes["gen_ai.conversation.id"] for t in turns] == [sid, sid]
    assert turns[1].attributes["gen_ai.usage.cache_read.input_tokens"] == r.usage.cached_tokens > 0
    first, second = (sorted((s for s in spans if s.name == n), key=lambda s: s.start_time)
                     for n in ("kvgen.queue", "kvgen.decode"))
    assert events(first[0], "kv.prefix_miss") and not events(first[1], "kv.prefix_miss")
    (hit,) = events(first[1], "kv.prefix_hit")
    assert hit.attributes["kvgen.kv.tokens"] == r.usage.cached_tokens
    # a session keeps its blocks between turns instead of freeing them
    assert events(second[0], "kv.retain") and not events(second[0], "kv.free")


def test_refused_request_span_has_the_status(traced):
    trace_id = "5" * 32
    # refused by the model's own limit (the gate refuses what needs no model before any span is named)
    too_long = request("hi", max_new_tokens=traced.gen.cfg.context_length)
    with traced.channel() as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GeneratorStub(ch).GenerateStream(too_long, metadata=traceparent(trace_id)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc-status-details-bin" in dict(e.value.trailing_metadata())  # rich details survive the interceptor
    (rpc,) = spans_of(traced.memory, trace_id, lambda s: len(s) >= 1)
    assert rpc.name == f"text_completion {traced.gen.cfg.name}" and not rpc.status.is_ok
    assert rpc.attributes["error.type"] == "INVALID_ARGUMENT"
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_unsampled_caller_gets_no_spans(traced):
    trace_id = "3" * 32
    with traced.channel() as ch:
        pb_grpc.GeneratorStub(ch).Generate(request("Hello", max_new_tokens=2), metadata=traceparent(trace_id, False))
    time.sleep(0.2)
    assert spans_of(traced.memory, trace_id, lambda s: False, timeout=0) == []


def test_tracing_off_by_default(embedded, receiver, monkeypatch):
    for k in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    server = ServerThread(Generator(*embedded, EngineOptions(kv_cache_mb=16)))
    try:
        assert server.server.tracing is None and server.gen.engine.on_submit is None
        trace_id = "4" * 32
        with server.channel() as ch:
            r = pb_grpc.GeneratorStub(ch).Generate(request("Hello", max_new_tokens=2), metadata=traceparent(trace_id))
        assert r.usage.completion_tokens == 2
    finally:
        server.stop()
    time.sleep(0.2)
    assert receiver.in_trace(trace_id) == []


def test_exporters_from_env():
    assert exporters_from_env({}) == []
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) == []
    (c,) = exporters_from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert isinstance(c, ConsoleSpanExporter)
    kinds = [type(e) for e in exporters_from_env({"OTEL_TRACES_EXPORTER": "otlp,console"})]
    assert kinds == [OTLPSpanExporter, ConsoleSpanExporter]
    with pytest.raises(ValueError, match="no span exporter 'zipkin'"):
        exporters_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ValueError, match="http/json"):
        exporters_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_tracing_object_without_env_uses_the_given_provider():
    provider = TracerProvider()
    t = Tracing(provider)
    assert t.tracer is not None and not t.owned
