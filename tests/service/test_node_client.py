"""The Node.js client (clients/node) against a real server: runs its `node --test` suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node and npm are needed for the Node.js client")


def node_version() -> tuple[int, ...]:
    out = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in out.strip().lstrip("v").split(".")[:2])


@pytest.fixture(scope="module")
def node_client() -> Path:
    """clients/node with its dependencies installed (npm ci from package-lock.json when missing)."""
    if node_version() < (18, 15):
        pytest.skip("the client's tests need Node >= 18.15 (node:test with --test-reporter)")
    if not (NODE_DIR / "node_modules" / ".package-lock.json").exists():
        try:
            p = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                               capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"npm ci timed out after 300 s:\n{e.stdout or ''}{e.stderr or ''}")
        assert p.returncode == 0, f"npm ci failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return NODE_DIR


def test_node_client_suite(server, node_client):
    # Test files are passed one by one: a bare directory argument to `node --test` only works up to Node 20.
    files = sorted(str(p.relative_to(node_client.parent.parent)) for p in (node_client / "test").glob("*.test.js"))
    assert files
    env = {**os.environ, "KVGEN_TARGET": server.target}
    env.pop("KVGEN_API_KEY", None)
    p = subprocess.run(["node", "--test", "--test-reporter=tap", *files], cwd=node_client.parent.parent,
                       env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"node --test failed ({p.returncode}):\n{out}"
    counts = {k: int(v) for k, v in re.findall(r"^# (tests|pass|fail|skipped|cancelled) (\d+)$", out, re.M)}
    assert counts.get("pass", 0) > 0 and counts["pass"] == counts.get("tests"), f"tests skipped or missing:\n{out}"
