"""Chaos: the real server process is SIGKILLed mid-stream. Its clients must hear UNAVAILABLE within
seconds (a dead peer is not a hang), and a new process on the same port serves again, to new
channels and to the old one alike."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import free_port
from tests.service.test_serve import ROOT, wait_serving

# A dead server's socket is reset at once on loopback; give slow CI room, never a hang's worth.
UNAVAILABLE_WITHIN_S = 5


def launch(model: str, port: int) -> subprocess.Popen:
    # KV_COLD_DIR unset: each process makes its own temp dir, so a killed one's files are never
    # another's. THREADS=1 keeps the tiny model off the shared cores' other tests.
    env = {**os.environ, "MODEL": model, "PORT": str(port), "METRICS_PORT": "0", "KV_CACHE_MB": "16",
           "THREADS": "1"}
    env.pop("KV_COLD_DIR", None)
    return subprocess.Popen([sys.executable, "-m", "kvgen.service.server"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_sigkill_mid_stream_gives_unavailable_and_a_restart_serves(tiny_gguf):
    port = free_port()
    target = f"127.0.0.1:{port}"
    proc = launch(tiny_gguf, port)
    old = grpc.insecure_channel(target)
    try:
        wait_serving(target, proc, timeout=120)
        stub = pb_grpc.GeneratorStub(old)
        # Far more tokens than the test lives for: the stream is mid-flight whenever the kill lands.
        call = stub.GenerateStream(request("the quick brown fox", max_new_tokens=2000, ignore_eos=True), timeout=60)
        assert next(call).token_ids
        os.killpg(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert time.monotonic() - t0 < UNAVAILABLE_WITHIN_S
        assert proc.wait(10) == -signal.SIGKILL

        # A call while nothing listens fails fast too (connection refused), not at its deadline.
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request("hello", max_new_tokens=4), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 < UNAVAILABLE_WITHIN_S

        proc = launch(tiny_gguf, port)  # the same port, free again at once
        wait_serving(target, proc, timeout=120)
        with grpc.insecure_channel(target) as fresh:
            r = pb_grpc.GeneratorStub(fresh).Generate(request("hello", max_new_tokens=4, ignore_eos=True), timeout=30)
            assert len(r.token_ids) == 4
        # The old channel reconnects by itself (wait_for_ready rides out its reconnect backoff).
        msgs = list(stub.GenerateStream(request("hello", max_new_tokens=4, ignore_eos=True), timeout=30,
                                        wait_for_ready=True))
        assert sum(len(m.token_ids) for m in msgs) == 4 and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        old.close()
        kill(proc)
