"""The README's "Call it from ..." snippets, run as they are written against a tiny-model server
(its gRPC and OpenAI ports put in place of localhost:50051 and localhost:8000)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
GO_DIR = ROOT / "clients" / "go"


def snippets() -> dict[str, tuple[str, str]]:
    """{subsection heading: (language, code)} of the README's "## Call it from ..." section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Call it from"):]
    section = section[:section.index("\n## ", 3)]
    out = {}
    for part in section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        (block,) = re.findall(r"```(\w+)\n(.*?)```", body, re.S)
        out[heading.strip()] = block
    return out


SNIPPETS = snippets()


@pytest.fixture(scope="module")
def readme_server(start_server):
    return start_server(http_port=free_port())


def _code(server, heading: str) -> tuple[str, str]:
    lang, code = SNIPPETS[heading]
    code = code.replace("localhost:50051", server.target)
    return lang, code.replace("localhost:8000", f"127.0.0.1:{server.server.http.port}")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert p.returncode == 0, f"{cmd[0]} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def test_every_language_has_a_snippet():
    assert set(SNIPPETS) == {"Python (gRPC)", "The openai SDK", "curl (the OpenAI endpoint)", "Go", "Node.js",
                             "grpcurl"}


@pytest.mark.parametrize("heading", ["Python (gRPC)", "The openai SDK"])
def test_python_snippets(readme_server, heading):
    lang, code = _code(readme_server, heading)
    assert lang == "python"
    _run([sys.executable, "-c", code], cwd=ROOT)


def test_curl_snippet(readme_server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    _, code = _code(readme_server, "curl (the OpenAI endpoint)")
    out = _run(["bash", "-c", "set -euo pipefail\n" + code]).stdout
    assert '"object": "chat.completion"' in out and out.rstrip().endswith("data: [DONE]")


def test_go_snippet(readme_server, tmp_path):
    if shutil.which("go") is None and not (shutil.which("apt-get") and os.geteuid() == 0):
        pytest.skip("no Go toolchain, and no apt-get as root to install one")
    _run(["make", "-C", str(GO_DIR), "build"])
    _, code = _code(readme_server, "Go")
    (tmp_path / "main.go").write_text(code)
    env = {**os.environ, "GOPATH": f"{GO_DIR}/.build/gopath:/usr/share/gocode", "GO111MODULE": "off",
           "GOCACHE": f"{GO_DIR}/.build/cache", "GOFLAGS": ""}
    _run(["go", "run", "main.go"], cwd=tmp_path, env=env)


def test_node_snippet(readme_server, node_client):
    _, code = _code(readme_server, "Node.js")
    _run(["node", "-e", code], cwd=ROOT)


def test_grpcurl_snippet(readme_server):
    if shutil.which("grpcurl") is None:
        pytest.skip("grpcurl is not installed (Debian does not package it)")
    _, code = _code(readme_server, "grpcurl")
    assert '"finishReason"' in _run(["bash", "-c", code]).stdout
