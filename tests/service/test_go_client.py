"""The Go client (clients/go) against a real server: `make -C clients/go test` installs Debian's
Go toolchain and gRPC packages when missing, generates the stubs, vets and builds the client and
its CLI, and runs `go test` on a tiny-model server (Generate, Stream, Batch, a session, cancellation and deadlines,
BadRequest details, Abort and Load, and a random LoRA adapter: Request.Adapter, SessionAdapter, NotFound for
an unknown one, UnloadAdapter then LoadAdapter); then the CLI streams from it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.service.conftest import LORA_ADAPTER

GO_DIR = Path(__file__).resolve().parents[2] / "clients" / "go"
CLI = GO_DIR / ".build" / "bin" / "kvgen-go"


def _can_install() -> bool:
    return shutil.which("go") is not None or (shutil.which("apt-get") is not None and os.geteuid() == 0)


pytestmark = pytest.mark.skipif(not _can_install(), reason="no Go toolchain, and no apt-get as root to install one")


@pytest.fixture(scope="module")
def go_server(lora_server):
    return lora_server


def _make(*args: str, **env) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["make", "-C", str(GO_DIR), *args], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"make {' '.join(args)} timed out:\n{e.stdout or ''}{e.stderr or ''}")


def test_go_client_suite(go_server):
    p = _make("test", KVGEN_TARGET=go_server.target, KVGEN_ADAPTER=LORA_ADAPTER,
              KVGEN_ADAPTER_PATH=go_server.adapter_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"go test failed ({p.returncode}):\n{out}"
    passed = re.findall(r"^--- PASS: (\w+)", out, re.M)
    assert len(passed) >= 15 and not re.search(r"^--- (FAIL|SKIP)", out, re.M), out
    assert {"TestAbortEndsARunningStream", "TestLoadSeesARunningRequest", "TestAdapterChangesTheTokensEverywhere",
            "TestUnknownAdapterIsNotFound", "TestUnloadThenLoadAdapter",
            "TestKVCompressTravelsPerRequestAndPerSession"} <= set(passed), out
    # every cancelled or timed-out call gave its KV blocks back
    deadline = time.time() + 10
    while go_server.gen.scheduler.kv.used and time.time() < deadline:
        time.sleep(0.05)
    assert go_server.gen.scheduler.kv.used == 0


def test_go_cli_streams(go_server):
    assert _make("build").returncode == 0
    env = {**os.environ, "KVGEN_TARGET": go_server.target}
    p = subprocess.run([str(CLI), "-max-new-tokens", "5", "-temperature", "0", "Once upon a time"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "completion 5 tokens" in p.stderr or "completion 5," in p.stderr
    bad = subprocess.run([str(CLI), "-temperature", "0", "-max-new-tokens", "0", "hi"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "InvalidArgument" in bad.stderr and "sampling.max_new_tokens" in bad.stderr
