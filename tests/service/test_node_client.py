"""The Node.js client (clients/node) against a real server: runs its `node --test` suite; its LoRA
adapter tests (test/adapter.test.js) against a second, tiny-model server that loads a random adapter."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.service.conftest import LORA_ADAPTER

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node and npm are needed for the Node.js client")


def test_node_client_suite(server, lora_server, node_client):
    # Test files are passed one by one: a bare directory argument to `node --test` only works up to Node 20.
    files = sorted(str(p.relative_to(node_client.parent.parent)) for p in (node_client / "test").glob("*.test.js"))
    assert files
    env = {**os.environ, "KVGEN_TARGET": server.target, "KVGEN_LORA_TARGET": lora_server.target,
           "KVGEN_ADAPTER": LORA_ADAPTER, "KVGEN_ADAPTER_PATH": lora_server.adapter_path}
    env.pop("KVGEN_API_KEY", None)
    p = subprocess.run(["node", "--test", "--test-reporter=tap", *files], cwd=node_client.parent.parent,
                       env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"node --test failed ({p.returncode}):\n{out}"
    counts = {k: int(v) for k, v in re.findall(r"^# (tests|pass|fail|skipped|cancelled) (\d+)$", out, re.M)}
    assert counts.get("pass", 0) > 0 and counts["pass"] == counts.get("tests"), f"tests skipped or missing:\n{out}"
