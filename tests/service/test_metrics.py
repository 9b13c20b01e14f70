"""Prometheus /metrics: request histograms and counters move with real requests; usage in every response."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgen.client import request
from kvgen.service.metrics import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from kvgen.v1 import generate_pb2 as pb

HISTOGRAMS = ("gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_per_output_token_seconds",
              "gen_ai_server_request_duration_seconds", "kvgen_request_queue_time_seconds",
              "kvgen_request_prefill_time_seconds", "kvgen_request_decode_time_seconds")


def scrape(server) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from the server's /metrics."""
    url = f"http://127.0.0.1:{server.settings.metrics_port}/metrics"
    page = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(page) for s in fam.samples}


def value(m: dict, name: str, **labels) -> float:
    """A sample's value, summed over the labels not given."""
    return sum(v for (n, ls), v in m.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def wait_for(server, check, timeout: float = 10) -> dict:
    """Scrape until check(metrics) holds (request metrics land when the engine lets go of the request)."""
    deadline = time.time() + timeout
    while True:
        m = scrape(server)
        if check(m) or time.time() > deadline:
            return m
        time.sleep(0.02)


def test_histograms_and_counters_move(server, stub):
    before = scrape(server)
    model = server.gen.cfg.name
    unary = stub.Generate(request("The capital of France is", max_new_tokens=5, ignore_eos=True, temperature=0.0))
    streamed = list(stub.GenerateStream(request("Once upon a time", max_new_tokens=4, ignore_eos=True)))
    stopped = stub.Generate(request("The capital of France is", max_new_tokens=20, stop_strings=[" Paris"],
                                    temperature=0.0))
    with pytest.raises(grpc.RpcError):
        stub.Generate(request("hi", max_new_tokens=0))
    usages = [unary.usage, streamed[-1].usage, stopped.usage]

    def delta(m, name, **labels):
        return value(m, name, **labels) - value(before, name, **labels)

    ok = dict(grpc_service="kvgen.v1.Generator", grpc_code="OK")
    # The server records an RPC's code after the client has its answer: wait for all of them.
    after = wait_for(server, lambda m: delta(m, "gen_ai_server_request_duration_seconds_count") >= 3
                     and delta(m, "grpc_server_handled_total", grpc_method="Generate", grpc_type="unary", **ok) >= 2
                     and delta(m, "grpc_server_handled_total", grpc_method="GenerateStream",
                               grpc_type="server_stream", **ok) >= 1
                     and delta(m, "grpc_server_handled_total", grpc_method="Generate",
                               grpc_code="INVALID_ARGUMENT") >= 1)
    for h in HISTOGRAMS:  # the stop-string request ends at its first token: no time per output token
        assert delta(after, f"{h}_count") == (2 if "per_output" in h else 3), h
        assert delta(after, f"{h}_sum") > 0, h
    ttft = {dict(ls)["le"] for (n, ls) in after if n == "gen_ai_server_time_to_first_token_seconds_bucket"}
    assert ttft == {str(float(b)) for b in TTFT_BUCKETS} | {"+Inf"}
    assert {dict(ls)["gen_ai_request_model"] for (n, ls) in after
            if n == "gen_ai_server_time_per_output_token_seconds_count"} == {model}
    tpot = {dict(ls)["le"] for (n, ls) in after if n == "gen_ai_server_time_per_output_token_seconds_bucket"}
    assert tpot == {str(float(b)) for b in TPOT_BUCKETS} | {"+Inf"}
    e2e = {dict(ls)["le"] for (n, ls) in after if n == "gen_ai_server_request_duration_seconds_bucket"}
    assert e2e == {str(float(b)) for b in DURATION_BUCKETS} | {"+Inf"}

    assert delta(after, "kvgen_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(after, "kvgen_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 10
    assert delta(after, "kvgen_requests_finished_total", finish_reason="length") == 2
    assert delta(after, "kvgen_requests_finished_total", finish_reason="stop") == 1
    assert delta(after, "grpc_server_handled_total", grpc_method="Generate", grpc_type="unary", **ok) == 2
    assert delta(after, "grpc_server_handled_total", grpc_method="GenerateStream", grpc_type="server_stream",
                 **ok) == 1
    assert delta(after, "grpc_server_handled_total", grpc_method="Generate", grpc_code="INVALID_ARGUMENT") == 1
    for gauge in ("kvgen_kv_blocks_used", "kvgen_kv_blocks_total", "kvgen_kv_cache_usage_ratio",
                  "kvgen_requests_running", "kvgen_requests_waiting", "kvgen_sessions_open", "kvgen_preemptions_total"):
        assert (gauge, ()) in after, gauge
    assert after[("kvgen_kv_blocks_total", ())] == server.gen.pool.capacity


def test_cancelled_stream_is_counted(server, stub):
    before = scrape(server)
    call = stub.GenerateStream(request("Once upon a time", max_new_tokens=500, ignore_eos=True))
    next(call)
    call.cancel()
    labels = dict(grpc_method="GenerateStream", grpc_code="CANCELLED")
    after = wait_for(server, lambda m: value(m, "kvgen_requests_finished_total", finish_reason="cancelled")
                     > value(before, "kvgen_requests_finished_total", finish_reason="cancelled")
                     and value(m, "grpc_server_handled_total", **labels)
                     > value(before, "grpc_server_handled_total", **labels))
    assert value(after, "grpc_server_handled_total", **labels) == value(before, "grpc_server_handled_total",
                                                                         **labels) + 1
    assert value(after, "kvgen_requests_finished_total", finish_reason="cancelled") == \
        value(before, "kvgen_requests_finished_total", finish_reason="cancelled") + 1


def test_usage_in_every_response(server, stub):
    """TokenUsage (prompt, completion, cached) on unary, stream and batch responses; cached counts
    a session's reused prefix, in the responses and in kvgen_cached_prompt_tokens_total."""
    before = scrape(server)
    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
    try:
        first = stub.Generate(request("My name is Ada.", session_id=sid, max_new_tokens=3, temperature=0.0))
        second = list(stub.GenerateStream(request(" What is my name?", session_id=sid, max_new_tokens=3,
                                                  temperature=0.0)))
        opened = scrape(server)
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    batch = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[request("Hi", max_new_tokens=2)] * 2))
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens == 3 and first.usage.cached_tokens == 0
    last = second[-1].usage
    assert last.cached_tokens > first.usage.prompt_tokens and last.prompt_tokens > last.cached_tokens
    assert all(r.response.usage.completion_tokens == 2 and r.response.usage.prompt_tokens > 0 for r in batch.results)
    assert value(opened, "kvgen_sessions_open") == value(before, "kvgen_sessions_open") + 1
    after = wait_for(server, lambda m: value(m, "kvgen_cached_prompt_tokens_total")
                     > value(before, "kvgen_cached_prompt_tokens_total"))
    assert value(after, "kvgen_cached_prompt_tokens_total") - value(before, "kvgen_cached_prompt_tokens_total") \
        == last.cached_tokens


def test_exact_block_slots_of_a_quantized_kv_format(make_gen):
    from prometheus_client import generate_latest

    from kvgen.engine.sampling import SamplingParams
    from kvgen.service.metrics import Metrics

    gen = make_gen(kv_dtype="q4", kv_cache_mb=64, max_running=4)
    m = Metrics(gen)

    def gauges():
        page = generate_latest(m.registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples
                if s.name.startswith("kvgen_kv_exact")}

    assert gauges() == {"kvgen_kv_exact_blocks_used": 0, "kvgen_kv_exact_blocks_total": 4}
    session = gen.new_session()
    session.generate("The capital of France is", SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert gauges()["kvgen_kv_exact_blocks_used"] == 1  # the idle session's part-filled block
    freed = threading.Event()
    assert gen.close_session(session.session_id, on_freed=freed.set)
    assert freed.wait(10)  # closing returns at once; the engine frees the blocks next
    assert gauges()["kvgen_kv_exact_blocks_used"] == 0
