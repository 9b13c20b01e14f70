"""The docs' snippets, run as they are written against a tiny-model server (its gRPC and OpenAI
ports put in place of localhost:50051 and localhost:8000): every one of docs/api.md's "Call it
from ..." section, and the README's "A first call"."""

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
API, README = "docs/api.md", "README.md"


def snippets(doc: str, section: str) -> dict[str, list[tuple[str, str]]]:
    """{subsection heading: [(language, code), ...]} of a doc's "## <section>", its code blocks in
    order under each "### " heading."""
    text = (ROOT / doc).read_text()
    start = text.index(f"\n## {section}\n") + 1
    end = text.find("\n## ", start)
    part = text[start:end if end >= 0 else len(text)]
    out = {}
    for sub in part.split("\n### ")[1:]:
        heading, _, body = sub.partition("\n")
        out[heading.strip()] = re.findall(r"```(\w+)\n(.*?)```", body, re.S)
    return out


SNIPPETS = {API: snippets(API, "Call it from ..."), README: snippets(README, "A first call")}


@pytest.fixture(scope="module")
def readme_server(start_server):
    return start_server(http_port=free_port())


def _code(server, doc: str, heading: str, lang: str) -> str:
    """The one `lang` block under the heading, pointed at the server."""
    (code,) = [code for language, code in SNIPPETS[doc][heading] if language == lang]
    code = code.replace("localhost:50051", server.target)
    return code.replace("localhost:8000", f"127.0.0.1:{server.server.http.port}")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert p.returncode == 0, f"{cmd[0]} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


def test_every_language_has_a_snippet():
    api = SNIPPETS[API]
    assert set(api) == {"Python (gRPC)", "The openai SDK", "curl (the OpenAI endpoint)", "Go", "Node.js", "grpcurl"}
    assert all(len(blocks) == 1 for blocks in api.values()), {h: len(b) for h, b in api.items()}
    first = SNIPPETS[README]
    assert set(first) == {"grpcurl", "Python", "curl (the OpenAI endpoint)"}
    assert [lang for lang, _ in first["Python"]] == ["python", "sh"]


@pytest.mark.parametrize(("doc", "heading"), [(API, "Python (gRPC)"), (API, "The openai SDK"), (README, "Python")])
def test_python_snippets(readme_server, doc, heading):
    _run([sys.executable, "-c", _code(readme_server, doc, heading, "python")], cwd=ROOT)


def test_readme_cli_snippet(readme_server):
    code = _code(readme_server, README, "Python", "sh")
    cli = re.match(r"\S+", code).group()
    if not (ROOT / cli).exists():
        pytest.skip(f"{cli} is not installed (make serve installs it)")
    env = {**os.environ, "KVGEN_TARGET": readme_server.target}
    _run(["bash", "-c", "set -euo pipefail\n" + code], cwd=ROOT, env=env)


@pytest.mark.parametrize("doc", [API, README])
def test_curl_snippet(readme_server, doc):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    code = _code(readme_server, doc, "curl (the OpenAI endpoint)", "sh")
    out = _run(["bash", "-c", "set -euo pipefail\n" + code]).stdout
    assert '"object": "chat.completion"' in out
    if "stream" in code:
        assert out.rstrip().endswith("data: [DONE]")


def test_go_snippet(readme_server, tmp_path):
    if shutil.which("go") is None and not (shutil.which("apt-get") and os.geteuid() == 0):
        pytest.skip("no Go toolchain, and no apt-get as root to install one")
    _run(["make", "-C", str(GO_DIR), "build"])
    (tmp_path / "main.go").write_text(_code(readme_server, API, "Go", "go"))
    env = {**os.environ, "GOPATH": f"{GO_DIR}/.build/gopath:/usr/share/gocode", "GO111MODULE": "off",
           "GOCACHE": f"{GO_DIR}/.build/cache", "GOFLAGS": ""}
    _run(["go", "run", "main.go"], cwd=tmp_path, env=env)


def test_node_snippet(readme_server, node_client):
    _run(["node", "-e", _code(readme_server, API, "Node.js", "js")], cwd=ROOT)


@pytest.mark.parametrize("doc", [API, README])
def test_grpcurl_snippet(readme_server, doc):
    if shutil.which("grpcurl") is None:
        pytest.skip("grpcurl is not installed (Debian does not package it)")
    assert '"finishReason"' in _run(["bash", "-c", _code(readme_server, doc, "grpcurl", "sh")]).stdout
