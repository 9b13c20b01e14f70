"""kvgen.v1.Generator through a real channel on loopback."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import gguf
import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgen.client import request
from kvgen.cpu import features
from kvgen.engine.model_files import embedded_model_path
from kvgen.v1 import generate_pb2 as pb

GREEDY = dict(temperature=0.0)
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


def bad_request(err: grpc.RpcError) -> list[tuple[str, str]]:
    """The google.rpc.BadRequest field violations carried by an INVALID_ARGUMENT error."""
    md = dict(err.trailing_metadata())
    status = status_pb2.Status.FromString(md["grpc-status-details-bin"])
    br = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(br)
    return [(v.field, v.description) for v in br.field_violations]


def test_unary_greedy(stub):
    r = stub.Generate(request("The capital of France is", max_new_tokens=8, **GREEDY))
    assert r.text.startswith(" Paris")
    assert len(r.token_ids) == 8
    assert r.finish_reason == pb.FINISH_REASON_LENGTH
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    assert r.timings.total_ms >= r.timings.time_to_first_token_ms > 0
    assert r.request_id


def test_stream_deltas_concatenate_to_unary(stub):
    req = request(CHAT, max_new_tokens=40, request_id="req-1", **GREEDY)
    unary = stub.Generate(req)
    msgs = list(stub.GenerateStream(req))
    assert len(msgs) > 1
    assert "".join(m.text for m in msgs) == unary.text
    assert [t for m in msgs for t in m.token_ids] == list(unary.token_ids)
    assert all(m.request_id == "req-1" for m in msgs)
    assert all(m.finish_reason == 0 for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == unary.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert last.matched_stop == "<|im_end|>"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (unary.usage.prompt_tokens,
                                                                        unary.usage.completion_tokens)
    # the same prompt again: its full blocks come from the prefix cache
    assert last.usage.cached_tokens == (unary.usage.prompt_tokens - 1) // 16 * 16


def test_batch_with_one_invalid_entry(stub):
    reqs = [request("The capital of France is", max_new_tokens=6, **GREEDY),
            request([1, 2, 99_999_999], max_new_tokens=4),
            request(CHAT, max_new_tokens=6, **GREEDY)]
    out = stub.BatchGenerate(pb.BatchGenerateRequest(requests=reqs))
    assert [r.WhichOneof("result") for r in out.results] == ["response", "error", "response"]
    assert out.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "99999999" in out.results[1].error.message
    solo = stub.Generate(reqs[0])
    assert out.results[0].response.token_ids == solo.token_ids


def test_stop_strings_cut_before_the_match(stub):
    free = stub.Generate(request("The capital of France is", max_new_tokens=20, **GREEDY))
    assert "answer" in free.text  # " Paris.\n\nThe answer is: ..."
    r = stub.Generate(request("The capital of France is", max_new_tokens=20, stop_strings=["answer"], **GREEDY))
    assert r.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert r.matched_stop == "answer"
    assert r.text == free.text[: free.text.index("answer")]
    streamed = list(stub.GenerateStream(request("The capital of France is", max_new_tokens=20,
                                                stop_strings=["answer"], **GREEDY)))
    assert "".join(m.text for m in streamed) == r.text


def test_stop_token_ids(stub):
    free = stub.Generate(request("The capital of France is", max_new_tokens=6, **GREEDY))
    stop = free.token_ids[2]
    r = stub.Generate(request("The capital of France is", max_new_tokens=6, stop_token_ids=[stop], **GREEDY))
    assert r.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert list(r.token_ids) == list(free.token_ids[:3])


def test_max_new_tokens(stub):
    for n in (1, 3):
        r = stub.Generate(request("Once upon a time", max_new_tokens=n, ignore_eos=True))
        assert len(r.token_ids) == n and r.finish_reason == pb.FINISH_REASON_LENGTH


def test_seed_reproducibility(stub):
    kw = dict(temperature=1.0, top_p=0.95, top_k=100, max_new_tokens=16, ignore_eos=True)
    a = stub.Generate(request("Once upon a time", seed=7, **kw))
    b = stub.Generate(request("Once upon a time", seed=7, **kw))
    c = stub.Generate(request("Once upon a time", seed=8, **kw))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_logprobs(stub):
    r = stub.Generate(request("The capital of France is", max_new_tokens=3, logprobs=3, **GREEDY))
    assert len(r.logprobs) == 3
    for lp, tid in zip(r.logprobs, r.token_ids, strict=True):
        assert lp.token_id == tid and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0].token_id == tid  # greedy takes the top token
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_cancel_stops_generation_and_frees_blocks(server, stub):
    pool = server.gen.scheduler.kv  # blocks held by requests (the prefix cache's own count as free)
    call = stub.GenerateStream(request("Once upon a time", max_new_tokens=2000, ignore_eos=True))
    first = next(call)
    assert first.token_ids
    assert pool.used > 0
    call.cancel()
    deadline = time.time() + 10
    while pool.used and time.time() < deadline:
        time.sleep(0.05)
    assert pool.used == 0
    assert server.gen.engine.idle


def test_deadline_frees_blocks(server, stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.GenerateStream(request("Once upon a time", max_new_tokens=2000, ignore_eos=True), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.time() + 10
    while server.gen.scheduler.kv.used and time.time() < deadline:
        time.sleep(0.05)
    assert server.gen.scheduler.kv.used == 0


@pytest.mark.parametrize("req, field", [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
    (request("hi", temperature=-0.5), "sampling.temperature"),
    (request("hi", top_p=0.0), "sampling.top_p"),
    (request("hi", top_p=1.5), "sampling.top_p"),
    (request("hi", top_k=-1), "sampling.top_k"),
    (request("hi", max_new_tokens=0), "sampling.max_new_tokens"),
    (request("hi", max_new_tokens=9000), "sampling.max_new_tokens"),
    (request([5, 49152]), "prompt_token_ids"),
    (request([-1]), "prompt_token_ids"),
])
def test_invalid_argument(stub, req, field):
    for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in [f for f, _ in bad_request(e.value)], e.value.details()


def test_unknown_session_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(request("hi", session_id="nope", max_new_tokens=1))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.architecture, info.num_layers, info.num_heads, info.num_kv_heads) == ("llama", 30, 9, 3)
    assert info.vocab_size == 49152 and info.context_length == 8192
    assert info.has_chat_template and list(info.eos_token_ids) == [2]
    assert info.kv_dtype == "fp32" and info.kv_blocks_total > 0
    # the default (WEIGHT_DTYPE auto): the file's blocks on the block kernels built for this CPU
    assert info.weight_dtype == "gguf" and info.cpu_kernels == features.path()
    assert info.decode_path == "fused" and info.decode_path_reason == ""
    # the file's quant mixture, as gguf-py reads it, and how each type runs here
    path = embedded_model_path()
    mixture = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    assert dict(info.tensor_types) == mixture == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert dict(info.type_kernels) == {"Q4_1": "q4", "Q8_0": "q8", "F32": "fp32"}
    assert info.file_bytes == os.path.getsize(path)
    # held at the file's bits: Q4_1's 20 bytes and Q8_0's 34 per 32 weights, the norms as fp32; the tied
    # embedding twice, as the file's rows (mapped: a lookup reads a row) and as the head's tiles
    matrices = 30 * (576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536)  # q|k|v, o, MLP
    norms = (2 * 30 + 1) * 576
    assert info.weight_bytes == matrices * 20 // 32 + 2 * (49152 * 576 * 34 // 32) + 4 * norms


def test_health_serving(server):
    with server.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvgen.v1.Generator"):
            assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(server):
    with server.channel() as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvgen.v1.Generator")]
        replies = list(stub.ServerReflectionInfo(iter(reqs)))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kvgen.v1.Generator", "grpc.health.v1.Health"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto


def test_concurrent_streams_share_the_engine(server, stub):
    prompts = ["The sky is", "My favourite food is", "Water boils at", "The best way to learn is"]
    solo = [stub.Generate(request(p, max_new_tokens=10, **GREEDY)).token_ids for p in prompts]
    out = [None] * len(prompts)

    def run(i):
        out[i] = [t for m in stub.GenerateStream(request(prompts[i], max_new_tokens=10, **GREEDY)) for t in m.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [list(s) for s in solo]
