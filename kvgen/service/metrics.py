"""Prometheus metrics on METRICS_PORT (/metrics), named as the OpenTelemetry GenAI conventions
(gen_ai_server_*, with their bucket boundaries), vLLM and grpc-prometheus name them. The HTTP port
serves the same registry at /metrics (http/worker_routes.py).

The gauges the Gateway API Inference Extension's endpoint picker reads (its model-server protocol,
docs/proposals/003-model-server-protocol) are there under vLLM's names too, as aliases of kvgen's
own, so an endpoint picker configured for vLLM reads kvgen as it is: vllm:num_requests_waiting,
vllm:num_requests_running, vllm:kv_cache_usage_perc (a fraction, as vLLM's) and the info gauge
vllm:cache_config_info{block_size, num_gpu_blocks}, which its prefix-cache scorer sizes itself by.

Request metrics are observed once per request, on the engine thread, when the engine releases
it (Engine.on_release); gauges are read at scrape time; RPC outcomes come from an interceptor.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvgen.engine.kv.tiers import Tier
from kvgen.engine.sequence import FinishReason, Sequence

# gen_ai.response.finish_reasons values, and the finish_reason label
FINISH_REASONS = {FinishReason.STOP_TOKEN: "stop", FinishReason.STOP_STRING: "stop",
                  FinishReason.LENGTH: "length", FinishReason.CANCELLED: "cancelled",
                  FinishReason.ABORTED: "error"}
# Bucket boundaries the GenAI semantic conventions advise for these histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
MODEL_LABEL = "gen_ai_request_model"  # gen_ai.request.model, as an OTel Prometheus exporter names it


class Metrics:
    def __init__(self, gen=None, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        # per request
        self.ttft = Histogram("gen_ai_server_time_to_first_token", "Time to generate the first token",
                              [MODEL_LABEL], unit="seconds", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("gen_ai_server_time_per_output_token", "Mean time per token after the first",
                              [MODEL_LABEL], unit="seconds", buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("gen_ai_server_request_duration", "Time from arrival to the last token",
                                  [MODEL_LABEL], unit="seconds", buckets=DURATION_BUCKETS, registry=r)
        self.queue = Histogram("kvgen_request_queue_time", "Time waiting before admission to the batch",
                               unit="seconds", buckets=TTFT_BUCKETS, registry=r)
        self.prefill = Histogram("kvgen_request_prefill_time", "Time from admission to the first token",
                                 unit="seconds", buckets=TTFT_BUCKETS, registry=r)
        self.decode = Histogram("kvgen_request_decode_time", "Time from the first token to the last",
                                unit="seconds", buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvgen_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kvgen_cached_prompt_tokens", "Prompt tokens whose KV was cached",
                                     registry=r)
        self.generation_tokens = Counter("kvgen_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("kvgen_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.lora_finished = Counter("kvgen_lora_requests_finished", "Requests finished, by LoRA adapter",
                                     ["adapter"], registry=r)
        for reason in sorted(set(FINISH_REASONS.values())):
            self.finished.labels(reason)
        # speculative decoding, per request that drafted
        self.drafted = Counter("kvgen_spec_draft_tokens", "Tokens drafted for speculative decoding", registry=r)
        self.accepted = Counter("kvgen_spec_accepted_tokens", "Drafted tokens the model accepted", registry=r)
        self.acceptance = Histogram("kvgen_spec_acceptance_rate", "Accepted / drafted tokens of a request",
                                    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.accepted_length = Histogram("kvgen_spec_accepted_length",
                                         "Mean drafted tokens accepted per verification, per request",
                                         buckets=(0.5, 1, 1.5, 2, 3, 4, 5, 6, 8), registry=r)
        # per RPC
        self.handled = Counter("grpc_server_handled", "RPCs completed on the server, by status code",
                               ["grpc_service", "grpc_method", "grpc_type", "grpc_code"], registry=r)
        # A counter only goes up: mirror the scheduler's count after each step.
        self._preempt = Counter("kvgen_preemptions", "Sequences preempted for lack of KV blocks", registry=r)
        self._sched = None
        self._seen_preemptions = 0
        self._model = {}
        if gen is not None:
            self.bind(gen)

    def bind(self, gen) -> None:
        """Gauges over gen's pool, scheduler and sessions, read at scrape time."""
        r, pool, sched = self.registry, gen.pool, gen.scheduler
        kv = sched.kv
        Gauge("kvgen_kv_blocks_used", "KV blocks held by requests and sessions (blocks only the prefix cache "
              "holds count as free)", registry=r).set_function(lambda: kv.used)
        Gauge("kvgen_kv_blocks_total", "KV blocks in the pool",
              registry=r).set_function(lambda: pool.capacity)
        Gauge("kvgen_kv_cache_usage_ratio", "Fraction of KV blocks allocated",
              registry=r).set_function(lambda: kv.used / pool.capacity)
        Gauge("kvgen_requests_running", "Requests in the running batch",
              registry=r).set_function(lambda: len(sched.running))
        Gauge("kvgen_requests_waiting", "Requests waiting for admission",
              registry=r).set_function(lambda: len(sched.waiting))
        Gauge("kvgen_sessions_open", "Open sessions", registry=r).set_function(lambda: len(gen.sessions))
        Gauge("kvgen_kv_exact_blocks_used", "Newest blocks of sequences held exact (quantized KV formats)",
              registry=r).set_function(lambda: pool.exact_blocks_used)
        Gauge("kvgen_kv_exact_blocks_total", "Slots for exact newest blocks (0: plain KV format)",
              registry=r).set_function(lambda: pool.exact_blocks_total)
        tier_bytes = Gauge("kvgen_kv_tier_bytes", "Bytes of idle sessions' KV blocks moved out of the pool, by tier",
                           ["tier"], registry=r)
        tier_bytes.labels("warm").set_function(lambda: kv.tier_bytes(Tier.WARM))
        tier_bytes.labels("cold").set_function(lambda: kv.tier_bytes(Tier.COLD))
        self._bind_vllm_aliases(gen)
        if kv.prefix is not None:
            r.register(_PrefixCollector(kv.prefix))
        self._sched = sched
        self._model = {h: h.labels(gen.cfg.name) for h in (self.ttft, self.tpot, self.duration)}

    def _bind_vllm_aliases(self, gen) -> None:
        """vLLM's names for the same counts, labelled by model_name as vLLM labels them."""
        r, pool, sched = self.registry, gen.pool, gen.scheduler
        kv, model = sched.kv, gen.cfg.name
        for name, doc, read in (
                ("vllm:num_requests_waiting", "kvgen_requests_waiting, by vLLM's name", lambda: len(sched.waiting)),
                ("vllm:num_requests_running", "kvgen_requests_running, by vLLM's name", lambda: len(sched.running)),
                ("vllm:kv_cache_usage_perc", "kvgen_kv_cache_usage_ratio, by vLLM's name (1 is all of it)",
                 lambda: kv.used / pool.capacity)):
            Gauge(name, doc, ["model_name"], registry=r).labels(model).set_function(read)
        Gauge("vllm:cache_config_info", "The KV pool's shape, as vLLM's cache config info",
              ["model_name", "block_size", "num_gpu_blocks"],
              registry=r).labels(model, str(pool.block_size), str(pool.capacity)).set(1)
        r.register(_LoraCollector(gen))

    def bind_load(self, load) -> None:
        """The rates GetLoad reports (service/server_load.py), from the same window, read at scrape time."""
        Gauge("kvgen_generation_tokens_per_second", "Tokens generated per second over the last seconds",
              registry=self.registry).set_function(load.tokens_per_second)
        Gauge("kvgen_requests_finished_per_second", "Requests finished per second over the last seconds",
              registry=self.registry).set_function(load.requests_per_second)

    def sync(self, *_) -> None:
        """After each engine step (Engine.on_step)."""
        delta = self._sched.preemptions - self._seen_preemptions
        if delta > 0:
            self._preempt.inc(delta)
            self._seen_preemptions += delta

    def observe(self, seq: Sequence) -> None:
        """Once per request, when the engine releases it (Engine.on_release)."""
        end = seq.finished_at or time.perf_counter()
        m = self._model
        m[self.duration].observe(end - seq.arrival)
        if seq.admitted_at is not None:
            self.queue.observe(seq.admitted_at - seq.arrival)
        first = seq.first_token_at
        if first is not None:
            m[self.ttft].observe(first - seq.arrival)
            self.prefill.observe(first - (seq.admitted_at or seq.arrival))
            self.decode.observe(end - first)
            if len(seq.output_ids) > 1:
                m[self.tpot].observe((end - first) / (len(seq.output_ids) - 1))
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.cached_tokens.inc(seq.cached_tokens)
        self.generation_tokens.inc(len(seq.output_ids))
        if seq.finish_reason is not None:
            self.finished.labels(FINISH_REASONS[seq.finish_reason]).inc()
        if seq.adapter is not None:
            self.lora_finished.labels(seq.adapter.name).inc()
        if seq.drafted:
            self.drafted.inc(seq.drafted)
            self.accepted.inc(seq.accepted)
            self.acceptance.observe(seq.accepted / seq.drafted)
            self.accepted_length.observe(seq.accepted / seq.verifications)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _HandledInterceptor(self.handled)

    def serve(self, port: int, host: str = "0.0.0.0"):
        return start_http_server(port, addr=host, registry=self.registry)


class _LoraCollector:
    """vLLM's vllm:lora_requests_info, read at scrape time: the adapters of the running and the waiting
    requests (comma-separated label values) and MAX_LORAS, valued the scrape's time as vLLM's is; an
    endpoint picker (Gateway API Inference Extension) sends a request to a replica that holds its adapter."""

    def __init__(self, gen):
        self.gen = gen

    def collect(self):
        sched = self.gen.scheduler

        def names(seqs) -> str:
            return ",".join(sorted({seq.adapter.name for seq in list(seqs) if seq.adapter is not None}))

        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (vLLM's)",
                              labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        g.add_metric([names(sched.running), str(self.gen.options.max_loras), names(sched.waiting)], time.time())
        yield g


class _PrefixCollector:
    """The prefix cache's counts, read at scrape time (the engine thread keeps them)."""

    def __init__(self, prefix):
        self.prefix = prefix

    def collect(self):
        s = self.prefix.stats
        for name, doc, value in (
                ("kvgen_prefix_cache_hits", "Requests that reused prefix-cache blocks", s.hits),
                ("kvgen_prefix_cache_misses", "Requests that found none of their prompt cached", s.misses),
                ("kvgen_prefix_cache_hit_tokens", "Prompt tokens reused from the prefix cache", s.hit_tokens),
                ("kvgen_prefix_cache_evictions", "Prefix-cache blocks moved out of the pool or dropped", s.evictions)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("kvgen_prefix_cache_blocks", "Blocks the prefix cache holds, by where they are",
                              labels=["where"])
        g.add_metric(["pool"], self.prefix.blocks_held)
        g.add_metric(["tiers"], self.prefix.blocks_tiered)
        yield g


class _HandledInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC's final status code, as grpc-prometheus does."""

    def __init__(self, counter: Counter):
        self.counter = counter

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").partition("/")
        kind = ("unary" if not handler.request_streaming and not handler.response_streaming else
                "server_stream" if not handler.request_streaming else
                "client_stream" if not handler.response_streaming else "bidi_stream")
        count = self.counter

        def done(context, error: BaseException | None) -> None:
            if isinstance(error, asyncio.CancelledError):
                left = context.time_remaining()
                code = "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
            else:
                status = context.code()
                code = status.name if isinstance(status, grpc.StatusCode) else (
                    "OK" if error is None else "UNKNOWN")
            count.labels(service, method, kind, code).inc()

        if handler.response_streaming:
            behavior = handler.unary_stream or handler.stream_stream

            async def stream(request, context):
                try:
                    out = behavior(request, context)
                    if hasattr(out, "__aiter__"):
                        async for response in out:
                            yield response
                    else:  # a coroutine that writes through context.write (health Watch)
                        await out
                except BaseException as e:
                    done(context, e)
                    raise
                done(context, None)

            make = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                    else grpc.stream_stream_rpc_method_handler)
            return make(stream, handler.request_deserializer, handler.response_serializer)

        behavior = handler.unary_unary or handler.stream_unary

        async def unary(request, context):
            try:
                response = await behavior(request, context)
            except BaseException as e:
                done(context, e)
                raise
            done(context, None)
            return response

        make = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                else grpc.stream_unary_rpc_method_handler)
        return make(unary, handler.request_deserializer, handler.response_serializer)
