"""The `kvgen` CLI for scripts: --json prints each message as one JSON object per line, and
KVGEN_API_KEY gives --api-key its default."""

from __future__ import annotations

import json

from kvgen import cli
from kvgen.engine.generator import EngineOptions, Generator
from tests.conftest import ServerThread


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
