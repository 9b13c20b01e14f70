"""The `kvgen` CLI for scripts: --json prints each message (or the error) as one JSON object per
line, KVGEN_TARGET and KVGEN_API_KEY give --target and --api-key their defaults, and UNAVAILABLE
before the first token is retried."""

from __future__ import annotations

import json

import pytest

from kvgen import cli
from kvgen.engine.generator import EngineOptions, Generator
from tests.client.conftest import FlakyServer
from tests.conftest import ServerThread, free_port


def test_json_lines(capsys, server):
    code = cli.main(["Once upon a time", "--temperature", "0", "--max-new-tokens", "4", "--json",
                     "--target", server.target])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and len(lines) >= 2
    messages = [json.loads(line) for line in lines]
    assert "".join(m.get("text", "") for m in messages)
    last = messages[-1]
    assert last["finishReason"] == "FINISH_REASON_LENGTH" and last["usage"]["completionTokens"] == 4
    assert cli.main(["--info", "--json", "--target", server.target]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == server.gen.cfg.name


def test_api_key_from_kvgen_api_key(capsys, monkeypatch, embedded):
    srv = ServerThread(Generator(*embedded, EngineOptions(kv_cache_mb=16)), api_key="secret")
    try:
        monkeypatch.setenv("KVGEN_TARGET", srv.target)
        monkeypatch.setenv("KVGEN_API_KEY", "secret")
        assert cli.main(["--info"]) == 0
        monkeypatch.setenv("KVGEN_API_KEY", "wrong")
        monkeypatch.delenv("API_KEY", raising=False)
        assert cli.main(["--info"]) == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        srv.stop()


def test_json_errors_timeout_and_retries(capsys, server):
    code = cli.main(["hi", "--grammar", "start: nowhere", "--json", "--target", server.target])
    out, err = capsys.readouterr()
    assert code == 1 and "sampling.grammar" in err  # the BadRequest's field, for people too
    error = json.loads(out)["error"]
    assert error["code"] == "INVALID_ARGUMENT" and error["fieldViolations"][0]["field"] == "sampling.grammar"
    code = cli.main(["Once upon a time", "--max-new-tokens", "500", "--timeout", "0.05", "--json",
                     "--target", server.target])
    assert code == 1 and json.loads(capsys.readouterr().out.splitlines()[-1])["error"]["code"] == "DEADLINE_EXCEEDED"
    with pytest.raises(SystemExit):
        cli.main(["hi", "--retries", "0", "--target", server.target])


def test_unavailable_before_the_first_token_is_retried(capsys):
    flaky = FlakyServer(free_port()).start()  # refuses its first call with UNAVAILABLE
    try:
        flaky.script.fail = 1
        assert cli.main(["hi", "--json", "--target", flaky.target]) == 0
        assert len(flaky.script.seen) == 2 and json.loads(capsys.readouterr().out.splitlines()[0])["text"] == "t0"
        flaky.script.seen.clear()
        flaky.script.fail = 1
        assert cli.main(["hi", "--json", "--retries", "1", "--target", flaky.target]) == 1
        assert json.loads(capsys.readouterr().out)["error"]["code"] == "UNAVAILABLE"
    finally:
        flaky.stop()
