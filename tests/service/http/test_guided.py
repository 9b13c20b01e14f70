"""vLLM's structured-output fields through the openai SDK's extra_body, on a tiny-model server:
guided_json (an object or its text), guided_regex, guided_grammar (Lark), guided_choice and
structured_outputs each constrain the reply on both APIs; two constraints, or a malformed one,
are a 400 naming the parameter."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

ASK = [{"role": "user", "content": "Is it?"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
GRAMMAR = 'start: "Answer: " ("yes" | "no")'


def _check_schema(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


@pytest.mark.parametrize(("extra", "check"), [
    ({"guided_json": SCHEMA}, _check_schema),
    ({"guided_json": json.dumps(SCHEMA)}, _check_schema),
    ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ({"guided_grammar": GRAMMAR}, lambda t: t in ("Answer: yes", "Answer: no")),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"json": SCHEMA}}, _check_schema),
], ids=["guided_json", "guided_json_text", "guided_regex", "guided_grammar", "guided_choice",
        "structured_outputs_choice", "structured_outputs_json"])
def test_each_guided_field_constrains_both_apis(client, model, extra, check):
    for seed in (1, 2):
        chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=1.0, seed=seed,
                                              extra_body=extra)
        text = client.completions.create(model=model, prompt="Q:", max_tokens=40, temperature=1.0, seed=seed,
                                         extra_body=extra)
        for reply, finish in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                              (text.choices[0].text, text.choices[0].finish_reason)):
            assert finish == "stop" and bool(check(reply)), (extra, reply)


def test_a_streamed_guided_choice(client, model):
    chunks = client.chat.completions.create(model=model, messages=ASK, max_tokens=10, stream=True,
                                            extra_body={"guided_choice": ["alpha", "beta"]})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in ("alpha", "beta")


def test_sampling_extensions_are_taken(client, model):
    """Each of vLLM's extensions changes what the tiny model says (greedily, it repeats the prompt's
    last token, "er", far ahead of every other)."""
    def complete(**extra):
        return client.completions.create(model=model, prompt="Once upon a time there was a lighthouse keeper",
                                         max_tokens=6, extra_body=extra).choices[0]

    greedy = complete(temperature=0, ignore_eos=True).text
    assert greedy == "er" * 6
    hot = dict(temperature=5.0, seed=2, ignore_eos=True)  # hot enough to wander off the top token
    assert complete(**hot).text != greedy
    assert complete(**hot, top_k=1).text == greedy  # top_k / min_p cut all but the top token
    assert complete(**hot, min_p=0.5).text == greedy
    assert not complete(temperature=0, ignore_eos=True, repetition_penalty=5.0).text.startswith("er")
    stopped = complete(temperature=0, stop_token_ids=[264])  # "er"'s id
    assert (stopped.text, stopped.finish_reason) == ("", "stop")
    eos = {"2": 100}  # <|im_end|>, the tiny model's EOS, first
    r = complete(temperature=0, logit_bias=eos)
    assert (r.text, r.finish_reason) == ("", "stop")
    r = complete(temperature=0, logit_bias=eos, min_tokens=3)  # no EOS before 3 tokens, then at once
    assert (r.text, r.finish_reason) == ("er" * 3, "stop")
    r = complete(temperature=0, logit_bias=eos, ignore_eos=True)
    assert r.finish_reason == "length"


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_grammar": GRAMMAR, "structured_outputs": {"regex": "b"}}, "structured_outputs.regex"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_grammar": "start: ??"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"min_p": "high"}, "min_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_or_several_constraints_are_400_naming_the_param(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
