"""The `kvgen` CLI against a real server: constraints and sampling controls reach the engine."""

from __future__ import annotations

import json

import pytest

from kvgen import cli


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


def test_cli_sampling_controls(capsys, server):
    code, out, err = run(capsys, server, "One two three", "--temperature", "0", "--max-new-tokens", "3",
                         "--min-new-tokens", "3", "--min-p", "0.1", "--presence-penalty", "0.5",
                         "--frequency-penalty", "0.2", "--logit-bias", "13=-100", "--prompt-logprobs", "1")
    assert code == 0 and out.strip()
    assert err.count("prompt ") >= 3  # one line per prompt token, then the usage line
    with pytest.raises(SystemExit):
        cli.main(["hi", "--logit-bias", "x=1", "--target", server.target])
    with pytest.raises(SystemExit):  # one constraint at most
        cli.main(["hi", "--regex", "a", "--json-object", "--target", server.target])
