"""The `kvgen` CLI against a real server: constraints and sampling controls reach the engine."""

from __future__ import annotations

import json
import re

import pytest

from kvgen import cli

PARIS = "The capital of France is"


def run(capsys, server, *args) -> tuple[int, str, str]:
    code = cli.main([*args, "--target", server.target])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_constraints(capsys, server, tmp_path):
    code, out, _ = run(capsys, server, "Is water wet?", "--chat", "--choice", "yes", "--choice", "no")
    assert code == 0 and out.strip() in ("yes", "no")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
                                  "required": ["n"], "additionalProperties": False}))
    code, out, _ = run(capsys, server, "A number as JSON.", "--chat", "--temperature", "0", "--max-new-tokens", "40",
                       "--json-schema", f"@{schema}")
    assert code == 0 and isinstance(json.loads(out)["n"], int)
    code, out, _ = run(capsys, server, "Call", "--regex", r"\d{3}", "--temperature", "0")
    assert code == 0 and out.strip().isdigit() and len(out.strip()) == 3
    code, _, err = run(capsys, server, "hi", "--grammar", "start: nowhere")
    assert code == 1 and "INVALID_ARGUMENT" in err and "sampling.grammar" in err


def test_cli_sampling_controls(capsys, server, monkeypatch):
    """Each flag reaches the engine: the SamplingParams it gets say so, and so does what the model
    says (greedily " Paris.\n\n", repeating "\n")."""
    seen = []  # the SamplingParams of each request the engine takes
    check = server.gen.check
    monkeypatch.setattr(server.gen, "check", lambda ids, params: (seen.append(params), check(ids, params))[1])

    def tokens(*flags, n=4) -> list[int]:
        code, out, err = run(capsys, server, PARIS, "--json", "--max-new-tokens", str(n), *flags)
        assert code == 0, err
        ids = [t for line in out.splitlines() for t in json.loads(line).get("tokenIds", [])]
        assert seen[-1].max_new_tokens == n and len(ids) <= n
        return ids

    greedy = tokens("--temperature", "0")
    assert seen[-1].temperature == 0 and len(greedy) == 4 and greedy[2] == greedy[3]
    for flag, field, value in (("--repetition-penalty", "repetition_penalty", 1.3),
                               ("--presence-penalty", "presence_penalty", 2.0),
                               ("--frequency-penalty", "frequency_penalty", 2.0)):
        r = tokens("--temperature", "0", flag, str(value))
        assert getattr(seen[-1], field) == pytest.approx(value) and r[:3] == greedy[:3] and r[3] != greedy[3], flag
    hot = ("--temperature", "1", "--seed", "1")
    sampled = tokens(*hot, n=1)
    assert (seen[-1].temperature, seen[-1].seed) == (1, 1) and sampled != greedy[:1]
    for flag, field, value in (("--top-k", "top_k", 1), ("--top-p", "top_p", 0.01), ("--min-p", "min_p", 1.0)):
        r = tokens(*hot, flag, str(value), n=1)  # each keeps only the top token
        assert getattr(seen[-1], field) == pytest.approx(value) and r == greedy[:1], flag
    assert tokens("--temperature", "0", "--logit-bias", "1000=100", n=2) == [1000, 1000]
    eos = server.gen.cfg.eos_token_ids[0]
    r = tokens("--temperature", "0", "--logit-bias", f"{eos}=100", "--min-new-tokens", "3", n=8)
    assert seen[-1].min_new_tokens == 3 and len(r) == 4 and r[3] == eos  # no EOS before 3 tokens, then at once
    code, out, err = run(capsys, server, PARIS, "--temperature", "0", "--max-new-tokens", "4", "--stop", ".",
                         "--prompt-logprobs", "1", "--no-speculative")
    assert code == 0 and out == " Paris\n"  # cut before the stop string
    assert seen[-1].stop_strings == ["."] and seen[-1].speculative is False  # (lossless: no visible effect)
    lines = [line for line in err.splitlines() if line.startswith("prompt ")]
    assert len(lines) == len(server.gen.tokenize(PARIS)) and all(line.count("[") == 1 for line in lines[1:])
    with pytest.raises(SystemExit):
        cli.main(["hi", "--logit-bias", "x=1", "--target", server.target])
    with pytest.raises(SystemExit):  # one constraint at most
        cli.main(["hi", "--regex", "a", "--json-object", "--target", server.target])


def test_cli_batch_stream(capsys, server):
    """--batch runs its prompts together: each entry's greedy text as the plain stream gives it, a
    bad entry's error on stderr (exit status 1) while the others complete; --json prints every
    message tagged by its entry."""
    greedy = ("--temperature", "0", "--max-new-tokens", "6")
    alone = [run(capsys, server, p, *greedy)[1].rstrip("\n") for p in (PARIS, "Once upon a time")]
    code, out, err = run(capsys, server, PARIS, "--batch", "Once upon a time", *greedy)
    assert code == 0, err
    assert _entries(out) == {0: alone[0], 1: alone[1]}
    assert "[0] [FINISH_REASON_LENGTH; prompt 5, completion 6" in err
    code, out, err = run(capsys, server, "--batch", PARIS, "--batch", "", "--batch", "Once upon a time", *greedy)
    assert code == 1 and "[1] error: INVALID_ARGUMENT" in err and "[1]   prompt:" in err
    assert _entries(out) == {0: alone[0], 2: alone[1]}
    code, out, _ = run(capsys, server, "--batch", PARIS, "--batch", "Once upon a time", "--json", *greedy)
    msgs = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {m.get("index", 0) for m in msgs} == {0, 1}
    assert "".join(m["response"].get("text", "") for m in msgs if m.get("index", 0) == 1) == alone[1]


def _entries(out: str) -> dict[int, str]:
    """The CLI's `[i] text` blocks (a text may hold newlines), by entry, each printed once."""
    parts = re.split(r"(?:^|\n)\[(\d+)\] ", out.rstrip("\n"))
    assert parts[0] == "", out
    got = {int(i): text for i, text in zip(parts[1::2], parts[2::2], strict=True)}
    assert len(got) == len(parts) // 2, out
    return got
