"""The README's `make serve`, and graceful shutdown of the real server process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvgen import client
from kvgen.client import Client
from kvgen.cpu import features
from kvgen.v1 import generate_pb2 as pb
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    """The server process is up and SERVING (its output in the failure when it died)."""
    try:
        client.wait_serving(target, timeout, alive=lambda: proc.poll() is None)
    except RuntimeError:
        raise AssertionError(proc.stdout.read() if proc.stdout else "server exited") from None


def start(cmd: list[str], **env) -> tuple[subprocess.Popen, str, int]:
    port, metrics = free_port(), free_port()
    e = {**os.environ, "PORT": str(port), "METRICS_PORT": str(metrics), **env}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    target = f"127.0.0.1:{port}"
    wait_serving(target, proc)
    return proc, target, metrics


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_make_serve_streams_tokens():
    proc, target, metrics = start(["make", "serve"])
    try:
        client = Client(target)
        msgs = list(client.stream("The capital of France is", max_new_tokens=8, temperature=0.0))
        assert "".join(m.text for m in msgs).startswith(" Paris")
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        page = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        assert "kvgen_kv_blocks_total" in page
        # WEIGHT_DTYPE=auto on the CPU: the GGUF's own blocks, named in GetModelInfo
        info = client.model_info()
        assert info.weight_dtype == "gguf"
        # and the kernels' code path, chosen from this CPU's features (this process's own choice)
        assert info.cpu_kernels == features.path()
        # the Q4_1 matrices on the q4 block kernels, the F32 norms as floats
        assert info.type_kernels["Q4_1"] == "q4" and info.type_kernels["F32"] == "fp32"
        # blocks at the file's own 5 bits a weight (fp16 scale and min per 32); the tied Q8_0 embedding
        # counted twice, as the embedding's rows and as the head's blocks (~30 MB)
        assert info.file_bytes < info.weight_bytes < 1.35 * info.file_bytes
        # the tied embedding's rows read from the GGUF in place (and the tiles, from WEIGHT_CACHE_DIR, once
        # saved): mapped, not copied; what of it is in RAM is within the server's RSS
        assert 49152 * 576 * 34 // 32 <= info.mapped_bytes  # Q8_0: 34 bytes a 32 weights
        assert 0 < info.mapped_resident_bytes <= info.mapped_bytes
        assert info.mapped_resident_bytes < info.resident_bytes
        client.close()
    finally:
        stop_group(proc)


def _gauge(metrics_port: int, name: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return float(next(line.split()[1] for line in page.splitlines() if line.startswith(name + " ")))


STREAM_TOKENS = 200


def test_sigterm_drains_in_flight_streams():
    proc, target, metrics = start([sys.executable, "-m", "kvgen.service.server"], GRACE_S="120")
    try:
        client = Client(target)
        got: dict = {}
        running = threading.Event()

        def long_stream():
            msgs = []
            # long enough (seconds at ~150 tokens/s) to be running still when the drain is seen
            for m in client.stream("Once upon a time", max_new_tokens=STREAM_TOKENS, ignore_eos=True,
                                   temperature=0.0):
                msgs.append(m)
                running.set()
            got["tokens"] = sum(len(m.token_ids) for m in msgs)
            got["reason"] = msgs[-1].finish_reason

        t = threading.Thread(target=long_stream)
        t.start()
        assert running.wait(60)  # the stream is running (its first tokens arrived)
        proc.send_signal(signal.SIGTERM)
        probe = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_new_tokens=1))
        deadline = time.monotonic() + 30
        while True:  # until a call is refused: the drain has begun (the stub: no retries)
            try:
                client.stub.Generate(probe, timeout=10)
            except grpc.RpcError as first:
                # the first refusal is the servicer's, which a client may retry elsewhere: the server
                # refuses alone for a moment before grpc's stop begins (server.REFUSE_BEFORE_STOP_S)
                assert first.code() == grpc.StatusCode.UNAVAILABLE, first
                break
            assert time.monotonic() < deadline, "calls were still served 30 s after SIGTERM"
        with pytest.raises(grpc.RpcError) as e:  # and so is every call from now on, never served
            client.stub.Generate(probe, timeout=10)
        # UNAVAILABLE from the servicer once draining, CANCELLED once grpc's stop has begun (server.drain:
        # DRAIN_DELAY_S keeps serving until a proxy's health check has seen NOT_SERVING)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert _gauge(metrics, "kvgen_requests_running") == 1  # and the stream is still generating
        t.join(120)
        assert got == {"tokens": STREAM_TOKENS, "reason": pb.FINISH_REASON_LENGTH}  # the in-flight one finished
        assert proc.wait(30) == 0
        client.close()
    finally:
        stop_group(proc)
