"""Structured output and the sampling controls over a real channel: every RPC takes them, and
every malformed one is INVALID_ARGUMENT with a BadRequest naming the field (never INTERNAL, never
a hang), the rest of a BatchGenerate still running."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from google.rpc import error_details_pb2

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb

from .wire import bad_request

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
    "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
STOP = pb.FINISH_REASON_STOP_TOKEN


def test_generate_stream_and_batch_take_every_constraint(stub):
    r = stub.Generate(request(ASK, temperature=0.8, seed=1, max_new_tokens=60, json_schema=json.dumps(SCHEMA)))
    jsonschema.validate(json.loads(r.text), SCHEMA)
    assert r.finish_reason == STOP
    text = "".join(m.text for m in stub.GenerateStream(
        request(ASK, temperature=0.8, seed=2, max_new_tokens=60, json_object=True)))
    assert isinstance(json.loads(text), dict)
    batch = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[
        request(ASK, choice=pb.ChoiceList(choices=["yes", "no"])),
        request("Call me at", temperature=0.8, seed=3, regex=r"\d{3}-\d{4}"),
        request(ASK, max_new_tokens=20, grammar='start: "Answer: " ("yes" | "no")'),
    ]))
    texts = [res.response.text for res in batch.results]
    assert texts[0] in ("yes", "no")
    assert len(texts[1]) == 8 and texts[1][3] == "-" and texts[1].replace("-", "").isdigit()
    assert texts[2] in ("Answer: yes", "Answer: no")
    assert all(res.response.finish_reason == STOP for res in batch.results)


def test_a_session_turn_takes_a_constraint(stub):
    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
    try:
        first = stub.Generate(request([{"role": "user", "content": "Name a color."}], session_id=sid,
                                      choice=pb.ChoiceList(choices=["red", "green"])))
        second = stub.Generate(request([{"role": "user", "content": "Now as JSON."}], session_id=sid,
                                       temperature=0.8, seed=5, max_new_tokens=60, json_schema=json.dumps(SCHEMA)))
        assert first.text in ("red", "green")
        assert second.finish_reason == STOP
        jsonschema.validate(json.loads(second.text), SCHEMA)
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_sampling_controls_reach_the_engine(stub):
    """Each control changes what the model says. Greedily it answers " Paris.\n\n", repeating "\n";
    the variants run side by side, in one BatchGenerate."""
    eos = list(stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids)
    first_eos = {t: 100.0 for t in eos}  # the model's EOS, first
    forced, hot = 1000, dict(temperature=1.0, seed=1)
    variants = {"greedy": dict(temperature=0), "forced": dict(temperature=0, logit_bias={forced: 100.0}),
                "repetition": dict(temperature=0, repetition_penalty=1.3),
                "presence": dict(temperature=0, presence_penalty=2.0),
                "frequency": dict(temperature=0, frequency_penalty=2.0),
                "hot": hot, "hot again": hot, "top_k": dict(hot, top_k=1), "top_p": dict(hot, top_p=0.01),
                "min_p": dict(hot, min_p=1.0), "eos": dict(temperature=0, logit_bias=first_eos),
                "min_new_tokens": dict(temperature=0, logit_bias=first_eos, min_new_tokens=3)}
    batch = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[
        request("The capital of France is", max_new_tokens=4, **kw) for kw in variants.values()]))
    out = {name: res.response for name, res in zip(variants, batch.results, strict=True)}
    ids = {name: list(r.token_ids) for name, r in out.items()}
    greedy = ids["greedy"]
    assert greedy[2] == greedy[3] and forced not in greedy
    assert ids["forced"] == [forced] * 4
    for penalty in ("repetition", "presence", "frequency"):
        assert ids[penalty][:3] == greedy[:3] and ids[penalty][3] != greedy[3], penalty  # the repeat turned away
    assert ids["hot"] != greedy and ids["hot again"] == ids["hot"]  # sampled, and the seed repeats it
    for cut in ("top_k", "top_p", "min_p"):  # each keeps only the top token
        assert ids[cut] == greedy, cut
    assert ids["eos"] == eos[:1] and out["eos"].finish_reason == STOP
    r = ids["min_new_tokens"]  # no EOS before 3 tokens, then at once
    assert len(r) == 4 and r[3] in eos and not set(r[:3]) & set(eos) and out["min_new_tokens"].finish_reason == STOP
    r = stub.Generate(request(ASK, temperature=0, max_new_tokens=12, min_new_tokens=12, choice=pb.ChoiceList(
        choices=["yes"])))
    assert r.text == "yes"  # a complete constraint wins over min_new_tokens
    r = stub.Generate(request("One two three", temperature=0, max_new_tokens=3, prompt_logprobs=2))
    assert len(r.prompt_logprobs) == r.usage.prompt_tokens and r.usage.cached_tokens == 0
    assert r.prompt_logprobs[0].logprob == 0 and not r.prompt_logprobs[0].top  # the first token has none
    assert all(p.logprob < 0 and len(p.top) == 2 for p in r.prompt_logprobs[1:])
    first = next(iter(stub.GenerateStream(request("One two three", max_new_tokens=3, prompt_logprobs=0))))
    assert [p.logprob for p in first.prompt_logprobs[1:]] == pytest.approx([p.logprob for p in r.prompt_logprobs[1:]],
                                                                          abs=1e-4)
    assert not any(p.top for p in first.prompt_logprobs)


BAD = [
    (dict(json_schema="{not json"), "sampling.json_schema"),
    (dict(json_schema='{"type": "wat"}'), "sampling.json_schema"),
    (dict(json_schema='{"not": {"type": "string"}}'), "sampling.json_schema"),
    (dict(json_schema='{"type": "string", "format": "no-such-format"}'), "sampling.json_schema"),
    (dict(regex="(("), "sampling.regex"),
    (dict(grammar="start: nowhere"), "sampling.grammar"),
    (dict(choice=pb.ChoiceList()), "sampling.choice.choices"),
    (dict(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
    (dict(logit_bias={5: 500.0}), "sampling.logit_bias"),
    (dict(min_p=1.5), "sampling.min_p"),
    (dict(presence_penalty=3.0), "sampling.presence_penalty"),
    (dict(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    (dict(min_new_tokens=50, max_new_tokens=10), "sampling.min_new_tokens"),
    (dict(prompt_logprobs=21), "sampling.prompt_logprobs"),
]


@pytest.mark.parametrize("fields, field", BAD, ids=[f for _, f in BAD])
def test_bad_controls_are_invalid_argument_naming_the_field(stub, fields, field):
    for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(request("Hello", **fields))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in [f for f, _ in bad_request(e.value)], bad_request(e.value)


def test_a_bad_constraint_fails_only_its_batch_entry(stub):
    out = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[
        request("Hello", max_new_tokens=3), request("Hello", regex="(("), request("Hello", max_new_tokens=3,
                                                                                    json_object=True)]))
    assert out.results[0].response.text
    assert out.results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    br = error_details_pb2.BadRequest()
    assert out.results[1].error.details[0].Unpack(br) and br.field_violations[0].field == "sampling.regex"
    assert out.results[2].response.text.startswith("{")
