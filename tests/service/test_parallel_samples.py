"""SamplingParams.n over real gRPC: Generate and BatchGenerate return the samples in `choices`
by index, a stream interleaves messages tagged by index, usage counts the prompt once, and sample
i is what a request with seed + i gives."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvgen.v1 import generate_pb2 as pb

PROMPT = "Write one sentence about the sea:"


def _sampling(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.8, seed=21, max_new_tokens=8, ignore_eos=True, **kw)


def test_generate_returns_every_sample_by_index(stub):
    r = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(n=3)))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert list(r.token_ids) == list(r.choices[0].token_ids) and r.text == r.choices[0].text
    for i, c in enumerate(r.choices):
        alone = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
            temperature=0.8, seed=21 + i, max_new_tokens=8, ignore_eos=True)))
        assert list(c.token_ids) == list(alone.token_ids)
    prompt = r.choices[0].usage.prompt_tokens
    assert r.usage.prompt_tokens == prompt and r.usage.completion_tokens == 24
    assert [c.usage.cached_tokens for c in r.choices[1:]] == [prompt, prompt]  # computed once


def test_a_stream_interleaves_samples_tagged_by_index(stub):
    msgs = list(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(n=3))))
    by = {i: [m for m in msgs if m.index == i] for i in range(3)}
    assert all(len(ms) >= 1 for ms in by.values()) and {m.index for m in msgs} == {0, 1, 2}
    whole = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(n=3)))
    for i, ms in by.items():
        assert [t for m in ms for t in m.token_ids] == list(whole.choices[i].token_ids)
        assert ms[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(bool(m.finish_reason) for m in ms) == 1


def test_batch_entries_carry_their_samples(stub):
    out = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[
        pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(n=2)),
        pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(n=0))]))
    assert [c.index for c in out.results[0].response.choices] == [0, 1]
    assert out.results[1].WhichOneof("result") == "error"
    assert out.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_invalid_argument(stub, n):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(n=n)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(e.value)
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    assert [v.field for v in bad.field_violations] == ["sampling.n"]


def test_n_in_a_session_is_invalid_argument(stub):
    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt=PROMPT, session_id=sid, sampling=_sampling(n=2)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
