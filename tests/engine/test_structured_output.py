"""Constrained generation on the real model, sampled at temperature 0.8: every output parses and
validates (jsonschema), matches (re.fullmatch), is one of the choices, or parses with lark."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from kvgen.engine.constraint import Constraint
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.sequence import FinishReason

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer"}},
     "required": ["ok", "code"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "exclusiveMaximum": 1000}},
     "required": ["price"]},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
     "required": ["sku"]},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
     "required": ["email"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]},
    {"type": "object", "properties": {
        "author": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["author", "year"]},
    {"type": "object", "properties": {"point": {"type": "array", "items": False,
                                                "prefixItems": [{"type": "number"}, {"type": "number"}]}},
     "required": ["point"]},
    {"anyOf": [{"type": "object", "properties": {"cat": NAME}, "required": ["cat"]},
               {"type": "object", "properties": {"dog": NAME}, "required": ["dog"]}]},
    {"type": "object", "properties": {"pet": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "maximum": 9}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"]}]}}, "required": ["pet"]},
    {"$defs": {"item": {"type": "object", "properties": {"name": NAME, "qty": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 99}},
                        "required": ["name", "qty"]}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                                                "maxItems": 3}}, "required": ["items"]},
    {"definitions": {"step": {"type": "string", "maxLength": 24}},
     "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/definitions/step"},
                                                "maxItems": 3}}, "required": ["steps"]},
    {"type": "object", "properties": {"score": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
     "required": ["score"]},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -50, "maximum": 50}},
     "required": ["temp"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "object", "properties": {"answer": {"type": ["string", "null"], "maxLength": 20}},
     "required": ["answer"]},
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 255},
                                              "minItems": 3, "maxItems": 3}}, "required": ["rgb"]},
    {"type": "object", "properties": {"title": NAME, "done": {"type": "boolean"},
                                      "priority": {"enum": [1, 2, 3]}}, "required": ["title", "done", "priority"]},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}},
     "required": ["version"]},
]


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only. {what}"}]


def test_every_sampled_output_validates_against_its_schema(gen):
    assert len(SCHEMAS) >= 25
    prompts = [ask(f"Follow this JSON schema: {json.dumps(s)}") for s in SCHEMAS]
    params = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=160,
                             constraint=Constraint("json_schema", json.dumps(s))) for i, s in enumerate(SCHEMAS)]
    results = gen.batch_generate(prompts, params)
    for schema, r in zip(SCHEMAS, results, strict=True):
        assert not isinstance(r, Exception), r
        assert r.finish_reason == FinishReason.STOP_TOKEN, (schema, r.text)
        jsonschema.validate(json.loads(r.text), schema, format_checker=jsonschema.FormatChecker())


REGEXES = [r"\d{3}-\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,30}\.", r"[A-Z][a-z]{2,10} [A-Z][a-z]{2,10}",
           r"#[0-9a-f]{6}", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"]
GRAMMAR = r"""
start: sentence
sentence: subject " " verb " " object "."
subject: "The cat" | "A dog" | "My friend"
verb: "likes" | "sees" | "wants"
object: NUMBER " " NOUN
NUMBER: /[1-9][0-9]?/
NOUN: "apples" | "birds" | "books"
"""


def test_regex_choice_and_lark_outputs_conform(gen):
    choices = ["positive", "negative", "neutral"]
    prompts = [[{"role": "user", "content": "Write something."}]] * len(REGEXES)
    prompts += [[{"role": "user", "content": "Is 'I love it' positive, negative or neutral?"}]] * 3
    prompts += [[{"role": "user", "content": "Write a sentence."}]] * 3
    params = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=80, constraint=Constraint("regex", r))
              for i, r in enumerate(REGEXES)]
    params += [SamplingParams(temperature=0.8, seed=i, constraint=Constraint.choice(choices)) for i in range(3)]
    params += [SamplingParams(temperature=0.8, seed=i, max_new_tokens=40, constraint=Constraint("grammar", GRAMMAR))
               for i in range(3)]
    results = gen.batch_generate(prompts, params)
    parser = lark.Lark(GRAMMAR)
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        assert r.finish_reason == FinishReason.STOP_TOKEN, r.text
        if i < len(REGEXES):
            assert re.fullmatch(REGEXES[i], r.text), (REGEXES[i], r.text)
        elif i < len(REGEXES) + 3:
            assert r.text in choices
        else:
            parser.parse(r.text)


def test_stop_strings_and_max_tokens_still_apply(gen):
    c = Constraint("regex", r"[a-z]+(, [a-z]+)*")
    r = gen.generate("List some fruits:", SamplingParams(temperature=0, max_new_tokens=6, constraint=c))
    assert r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 6
    first = r.text.split(",")[0]
    r2 = gen.generate("List some fruits:", SamplingParams(temperature=0, max_new_tokens=6, constraint=c,
                                                          stop_strings=[","]))
    assert r2.finish_reason == FinishReason.STOP_STRING and r2.text == first


def test_streamed_deltas_are_valid_prefixes(gen):
    schema = SCHEMAS[1]
    c = Constraint("json_schema", json.dumps(schema))
    m = gen.grammars.matcher(c)
    text = ""
    for ev in gen.generate_stream(ask("A city."), SamplingParams(temperature=0.8, seed=3, max_new_tokens=100,
                                                                  constraint=c)):
        for t in ev.token_ids:
            if ev.finish_reason is None or t not in gen.cfg.eos_token_ids:
                assert m.consume_token(t)
        text += ev.text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_complete_grammar_ends_the_output(gen, ignore_eos):
    """When nothing may follow, the output ends with a stop (EOS is never emitted as text)."""
    r = gen.generate("Pick:", SamplingParams(temperature=0, constraint=Constraint.choice(["left", "right"]),
                                             ignore_eos=ignore_eos, max_new_tokens=50))
    assert r.text in ("left", "right") and r.finish_reason == FinishReason.STOP_TOKEN


def test_constrained_streams_survive_preemption_and_equal_their_solo_runs(make_gen):
    """The engine starts a step's masks when the last step fed its tokens (Engine._mask_ahead),
    for sequences that a tight pool then preempts, recomputes and resumes, beside unconstrained
    ones: every output equals the same request run alone, and the constrained ones validate."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    c = Constraint("json_schema", json.dumps(schema))
    params = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=48, constraint=c if i < 6 else None,
                             ignore_eos=i >= 6) for i in range(8)]
    prompts = [ask(f"A user record, number {i}.") for i in range(8)]
    roomy = make_gen(kv_cache_mb=16)
    solo = [roomy.generate(p, s).token_ids for p, s in zip(prompts, params, strict=True)]
    tight = make_gen(kv_cache_mb=12 * roomy.pool.fmt.bytes_per_block() / 2**20)
    out = tight.batch_generate(prompts, params)
    assert [r.token_ids for r in out] == solo
    assert tight.scheduler.preemptions > 0 and tight.scheduler.kv.used == 0
    for r in out[:6]:
        assert r.finish_reason == FinishReason.STOP_TOKEN, r.text
        jsonschema.validate(json.loads(r.text), schema)
