"""Constraints compiled by llguidance: masks as the grammar engine computes them, the compile
cache, and every malformed constraint refused with its field named."""

from __future__ import annotations

import json

import llguidance
import llguidance.torch
import pytest
import torch

from kvgen.engine.constraint import Constraint, Grammars, Masks
from kvgen.engine.sampling import unpack_bitmask
from kvgen.errors import InvalidRequest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "tags"]}
# (constraint, an output it accepts)
VALID = [
    (Constraint("json_schema", json.dumps(PERSON)), '{"name": "Ada", "tags": ["a", "b"]}'),
    (Constraint("regex", r"\d{3}-[a-z]+"), "123-abc"),
    (Constraint.choice(["positive", "negative", "neutral"]), "neutral"),
    (Constraint("json_object"), '{"x": [1, 2.5, {"y": null}]}'),
    (Constraint("grammar", 'start: expr\nexpr: NUM | expr "+" NUM\nNUM: /[0-9]+/'), "12+7+300"),
]


@pytest.fixture(scope="module")
def grammars(embedded):
    model, tok = embedded
    return Grammars(tok.tok, model.cfg.vocab_size, model.cfg.eos_token_ids)


def test_masks_equal_the_grammar_engines_own_along_a_valid_output(grammars, embedded):
    """All constraints' rows filled together by Masks (in parallel, off the caller's thread) equal
    llguidance's single-matcher mask at every step, and always allow the next valid token."""
    model, tok = embedded
    vocab = model.cfg.vocab_size
    masks = Masks(vocab, threads=2)
    ours = [grammars.matcher(c) for c, _ in VALID]
    refs = [grammars.matcher(c) for c, _ in VALID]
    paths = [tok.encode(text, add_bos=False) + [model.cfg.eos_token_ids[0]] for _, text in VALID]
    try:
        for step in range(max(len(p) for p in paths)):
            live = [i for i, p in enumerate(paths) if step < len(p)]
            bitmask = masks.start([ours[i] for i in live]).result()
            allowed = unpack_bitmask(bitmask, vocab)
            for row, i in enumerate(live):
                ref = torch.zeros((1, bitmask.shape[1]), dtype=torch.int32)
                llguidance.torch.fill_next_token_bitmask(refs[i], ref)
                assert torch.equal(bitmask[row], ref[0]), (VALID[i][0].kind, step)
                token = paths[i][step]
                assert allowed[row, token], (VALID[i][0].kind, step, tok.token_text(token))
                assert ours[i].consume_token(token) and refs[i].consume_token(token)
        assert all(m.is_stopped() for m in ours)  # EOS ended each one
    finally:
        masks.close()


def test_a_repeated_constraint_compiles_once(grammars, embedded):
    c = Constraint("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    before = grammars.compiles
    a, b = grammars.matcher(c), grammars.matcher(c)
    assert grammars.compiles == before + 1 and grammars.cached(c)
    for t in embedded[1].encode('{"n": 4', add_bos=False):  # each request has its own state
        assert a.consume_token(t)
    assert not b.consume_token(embedded[1].encode("4", add_bos=False)[0])


def test_the_cache_keeps_the_most_recent(embedded):
    model, tok = embedded
    g = Grammars(tok.tok, model.cfg.vocab_size, model.cfg.eos_token_ids, cache_size=2)
    for word in ("a", "b", "c"):
        g.matcher(Constraint.choice([word]))
    assert not g.cached(Constraint.choice(["a"])) and g.cached(Constraint.choice(["c"]))


@pytest.mark.parametrize("constraint, field, words", [
    (Constraint("json_schema", "{not json"), "sampling.json_schema", "is not JSON"),
    (Constraint("json_schema", "[1, 2]"), "sampling.json_schema", "must be a JSON object"),
    (Constraint("json_schema", '{"type": "wat"}'), "sampling.json_schema", "not a valid JSON Schema"),
    (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'), "sampling.json_schema",
     "cannot be enforced"),
    (Constraint("json_schema", '{"not": {"type": "string"}}'), "sampling.json_schema", "cannot be enforced"),
    (Constraint("regex", "(("), "sampling.regex", "cannot be enforced"),
    (Constraint("regex", ""), "sampling.regex", "must not be empty"),
    (Constraint("grammar", "start: undefined_rule"), "sampling.grammar", "cannot be enforced"),
    (Constraint("grammar", "start: ("), "sampling.grammar", "cannot be enforced"),
    (Constraint.choice([]), "sampling.choice.choices", "must not be empty"),
    (Constraint.choice(["a", ""]), "sampling.choice.choices", "empty strings"),
])
def test_malformed_constraints_name_their_field(grammars, constraint, field, words):
    with pytest.raises(InvalidRequest) as e:
        grammars.matcher(constraint)
    assert [f for f, _ in e.value.violations] == [field]
    assert words in e.value.violations[0][1]


def test_json_output_is_compact_and_bounded(grammars, embedded):
    """No free whitespace: after a key, the only continuation is the separator (a model cannot
    pad its output with blanks until max_new_tokens)."""
    model, tok = embedded
    m = grammars.matcher(Constraint("json_object"))
    for t in tok.encode('{"a"', add_bos=False):
        assert m.consume_token(t)
    bm = torch.zeros((1, (model.cfg.vocab_size + 31) // 32), dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask(m, bm)
    allowed = unpack_bitmask(bm, model.cfg.vocab_size)[0].nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]).startswith(":") for t in allowed)
