"""OpenTelemetry tracing, configured by the standard OTEL_* environment variables.

Off unless OTEL_TRACES_EXPORTER names an exporter: `otlp` (OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL
grpc, the default, or http/protobuf if that exporter package is installed), `console`, or any
other installed `opentelemetry_traces_exporter` entry point; `none` or unset means no tracing
at all (OpenTelemetry's own default of otlp is not applied). Everything else is the SDK's own
reading of the environment: OTEL_EXPORTER_OTLP_ENDPOINT / _HEADERS / ..., OTEL_SERVICE_NAME
(default "kvgen"), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG] (default
parentbased_always_on, so a caller's sampling decision holds), OTEL_BSP_*, OTEL_PROPAGATORS and
OTEL_PYTHON_GRPC_EXCLUDED_SERVICES. Health and reflection calls are never traced.

One Generate or GenerateStream call (the server span continues the caller's traceparent):

    chat {model}                 SERVER; rpc.* and gen_ai.* attributes (the gRPC interceptor's span)
    ├── kvgen.queue              arrival -> admitted to the running batch
    ├── kvgen.prefill            admitted -> first token
    │   └── kvgen.prefill.chunk  one per engine step that wrote this prompt's K/V
    └── kvgen.decode             first token -> KV released; its steps summed in attributes

"chat" for messages, "text_completion" for a prompt or token ids. BatchGenerate keeps its RPC
span and gets one such request span (INTERNAL) per entry. KV operations (kvgen.engine.trace)
are span events on the phase span during which they happened: kv.alloc, kv.append, kv.free,
kv.preempt, kv.truncate, kv.drop (behind a sliding window), kv.prefix_hit / kv.prefix_miss,
kv.retain, kv.evict, kv.quantize.
The phase spans are built once, with the sequence's own timestamps, when the engine releases it.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from importlib.metadata import PackageNotFoundError, entry_points, version

from google.rpc import code_pb2
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvgen.engine.kv.record import KVInfo, KVRecord, KVRecorder
from kvgen.engine.sequence import FinishReason, Sequence
from kvgen.service.errors import abort, to_status
from kvgen.service.metrics import FINISH_REASONS

log = logging.getLogger("kvgen.tracing")
PROVIDER = "kvgen"  # gen_ai.provider.name: the engine serving the model
_OTLP = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
LORA_ADAPTER = "kvgen.lora_adapter"  # the request's LoRA adapter, on its request and phase spans
_UNTRACED = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
             "grpc.reflection.v1.ServerReflection")


def _version() -> str:
    try:
        return version("kvgen")
    except PackageNotFoundError:  # run from a checkout that isn't installed
        return "0"


def exporters_from_env(env=os.environ) -> list[SpanExporter]:
    """The exporters OTEL_TRACES_EXPORTER asks for; [] when tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    exporters = []
    for name in (n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")):
        if name in ("", "none"):
            continue
        if name == "otlp":
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
            if protocol not in _OTLP:
                raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: expected grpc or http/protobuf")
            name = _OTLP[protocol]
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            package = "opentelemetry-exporter-" + name.replace("_", "-")
            raise ValueError(f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed "
                             f"(pip install {package})")
        exporters.append(next(iter(found)).load()())
    return exporters


def _resource() -> Resource:
    r = Resource.create({"service.version": _version()})
    if r.attributes.get("service.name", "").startswith("unknown_service"):
        r = r.merge(Resource({"service.name": "kvgen"}))
    return r


def _interceptor_filter(env=os.environ):
    excluded = [s.strip() for s in env.get("OTEL_PYTHON_GRPC_EXCLUDED_SERVICES", "").split(",") if s.strip()]
    return filters.negate(filters.any_of(*(filters.service_name(s) for s in (*_UNTRACED, *excluded))))


class Tracing:
    """The server's tracer provider, its gRPC interceptor and the engine hooks that trace requests."""

    def __init__(self, provider: TracerProvider, owned: bool = False):
        self.provider = provider
        self.owned = owned  # built from the environment: shut it down with the server
        self.tracer = provider.get_tracer("kvgen", _version())
        self.recorder: KVRecorder | None = None  # set by bind()

    @classmethod
    def from_env(cls) -> Tracing | None:
        exporters = exporters_from_env()
        if not exporters:
            return None
        provider = TracerProvider(resource=_resource())  # the sampler comes from OTEL_TRACES_SAMPLER
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, owned=True)

    def interceptor(self):
        return aio_server_interceptor(tracer_provider=self.provider, filter_=_interceptor_filter())

    def request_span(self, child: bool):
        """The span a generation request annotates: the RPC's own, or a child for one entry of a
        batch (named and attributed by `start_request`)."""
        if child and trace.get_current_span().is_recording():
            return self.tracer.start_as_current_span("text_completion", kind=SpanKind.INTERNAL)
        return nullcontext(trace.get_current_span())

    # engine hooks

    def bind(self, gen) -> None:
        """Listen to gen's KV manager and engine steps (the server calls it once the model is loaded)."""
        self.recorder = KVRecorder(KVInfo.of(gen.pool.fmt))
        gen.scheduler.kv.listen(self.recorder.on_event)

    def on_submit(self, seq: Sequence) -> None:
        """Caller's thread, before the engine sees seq: trace its KV if the caller's span is sampled, and
        name its LoRA adapter there (a session's turn has it from the session, not from the call)."""
        span = trace.get_current_span()
        if self.recorder is not None and span.is_recording():
            if seq.adapter is not None:
                span.set_attribute(LORA_ADAPTER, seq.adapter.name)
            self.recorder.attach(seq, otel_context.get_current())

    def on_step(self, batch, seconds: float) -> None:
        if self.recorder is not None:
            self.recorder.on_step(batch, seconds)

    def on_release(self, seq: Sequence) -> None:
        """Engine thread, seq's KV let go: its phase spans and KV events, parented to the request span."""
        record = self.recorder.detach(seq) if self.recorder is not None else None
        if record is not None:
            self._export(seq, record)

    def _export(self, seq: Sequence, rec: KVRecord) -> None:
        offset = time.time_ns() - time.perf_counter_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        end = seq.finished_at or time.perf_counter()
        admitted, first = seq.admitted_at, seq.first_token_at
        ctx, tracer = rec.parent, self.tracer
        seq_attrs = {"kvgen.seq.id": seq.seq_id}
        if seq.adapter is not None:  # each phase span says which adapter's weights its steps ran
            seq_attrs[LORA_ADAPTER] = seq.adapter.name
        queue = tracer.start_span("kvgen.queue", ctx, start_time=ns(seq.arrival), attributes=seq_attrs)
        prefill = decode = None
        if admitted is not None:
            prefill = tracer.start_span("kvgen.prefill", ctx, start_time=ns(admitted), attributes={
                **seq_attrs, "kvgen.prompt_tokens": rec.prompt_len, "kvgen.cached_tokens": seq.cached_tokens,
                "kvgen.prefill.chunks": sum(not c.recompute for c in rec.chunks),
                "kvgen.prefill.tokens": sum(c.tokens for c in rec.chunks if not c.recompute)})
        if first is not None:
            decode = tracer.start_span("kvgen.decode", ctx, start_time=ns(first), attributes={
                **seq_attrs, "kvgen.decode.steps": rec.decode_steps,
                "kvgen.decode.step_seconds": rec.decode_seconds,
                "kvgen.output_tokens": len(seq.output_ids), "kvgen.preemptions": rec.preemptions,
                "kvgen.spec.drafted_tokens": seq.drafted, "kvgen.spec.accepted_tokens": seq.accepted,
                "kvgen.spec.verifications": seq.verifications})

        def phase(t: float):
            if decode is not None and t >= first:
                return decode
            if prefill is not None and t >= admitted:
                return prefill
            return queue

        for c in rec.chunks:
            span = tracer.start_span("kvgen.prefill.chunk", trace.set_span_in_context(phase(c.t0)),
                                     start_time=ns(c.t0), attributes={
                **seq_attrs, "kvgen.chunk.start": c.start, "kvgen.chunk.tokens": c.tokens,
                "kvgen.chunk.recompute": c.recompute})
            span.end(ns(c.t1))
        for op in rec.ops:
            phase(op.t).add_event(op.name, op.attrs, timestamp=ns(op.t))
        reason = seq.finish_reason
        last = decode or prefill or queue
        if reason is not None:
            last.set_attribute("kvgen.finish_reason", FINISH_REASONS[reason])
        if reason == FinishReason.ABORTED:
            last.set_status(Status(StatusCode.ERROR, "the engine step failed"))
        queue.end(ns(admitted if admitted is not None else end))
        if prefill is not None:
            prefill.end(ns(first if first is not None else end))
        if decode is not None:
            decode.end(ns(end))

    def shutdown(self) -> None:
        self.provider.force_flush()
        if self.owned:
            self.provider.shutdown()


# GenAI attributes of a request span (set by the servicer; no-ops on a span that isn't recording)

def operation_of(req) -> str:
    return "chat" if len(req.messages) else "text_completion"


def start_request(span, req, params, model: str, request_id: str, stream: bool, session_id: str = "") -> None:
    op = operation_of(req)
    span.update_name(f"{op} {model}")
    attrs = {
        "gen_ai.operation.name": op, "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_new_tokens, "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k,
        "gen_ai.request.stream": stream, "gen_ai.response.id": request_id,
    }
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if params.stop_strings:
        attrs["gen_ai.request.stop_sequences"] = list(params.stop_strings)
    if session_id:
        attrs["gen_ai.conversation.id"] = session_id
    if req.adapter:  # the adapter asked for (set before it is looked up: a refusal's span names it too)
        attrs[LORA_ADAPTER] = req.adapter
    span.set_attributes(attrs)


def end_request(span, ev, model: str) -> None:
    """The final event: usage, finish reason, time to first chunk."""
    attrs = {"gen_ai.response.model": model,
             "gen_ai.response.finish_reasons": [FINISH_REASONS[ev.finish_reason]]}
    if ev.usage:
        attrs.update({"gen_ai.usage.input_tokens": ev.usage.prompt_tokens,
                      "gen_ai.usage.output_tokens": ev.usage.completion_tokens,
                      "gen_ai.usage.cache_read.input_tokens": ev.usage.cached_tokens})
    if ev.timings:
        attrs["gen_ai.response.time_to_first_chunk"] = ev.timings["time_to_first_token_ms"] / 1e3
    span.set_attributes(attrs)


def record_error(span, e: BaseException, rpc: bool = False, code: str | None = None) -> None:
    """error.type (the gRPC status name) and an error status; rpc: also the RPC's status code,
    which the interceptor can't see through abort_with_status."""
    if code is None:
        code = code_pb2.Code.Name(to_status(e).code) if isinstance(e, Exception) else "CANCELLED"
    span.set_attribute("error.type", code)
    if code == "CANCELLED":
        span.set_attribute("gen_ai.response.finish_reasons", ["cancelled"])
    if rpc:
        span.set_attribute("rpc.grpc.status_code", code_pb2.Code.Value(code))
    span.set_status(Status(StatusCode.ERROR, str(e) or code))


async def abort_rpc(context, e: Exception):
    """errors.abort() with the status also on the RPC's span (the interceptor can't see abort_with_status)."""
    span = trace.get_current_span()
    if span.is_recording():
        record_error(span, e, rpc=True)
    await abort(context, e)
