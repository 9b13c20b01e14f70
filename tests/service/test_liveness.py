"""Liveness ("kvgen.liveness") apart from readiness: NOT_SERVING while the engine makes no progress
on pending work for LIVENESS_STALL_S, SERVING again once it moves, with a stack dump logged once."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgen.client import request
from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.model import Model
from kvgen.service.liveness import LIVENESS
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import ServerThread
from tests.tiny import tiny_weights

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def stuck_server(tiny_pair):
    """A server whose engine's forward pass blocks until the test lets it go."""
    shared, tok = tiny_pair
    model = Model(shared.cfg, tiny_weights(shared.cfg, seed=3))  # its own: the patch stays here
    release = threading.Event()
    real = model.forward

    def stuck_forward(*args, **kwargs):
        release.wait(30)  # the engine thread sits here: no progress while a request is pending
        return real(*args, **kwargs)

    model.forward = stuck_forward
    server = ServerThread(Generator(model, tok, EngineOptions(kv_cache_mb=16)), liveness_stall_s=0.5)
    server.release = release
    yield server
    release.set()
    server.stop()


def wait_status(health, name: str, want: int, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name!r} never became {health_pb2.HealthCheckResponse.ServingStatus.Name(want)}")


def test_stalled_engine_turns_liveness_off_and_back(stuck_server, caplog):
    with caplog.at_level(logging.WARNING, logger="kvgen.liveness"), stuck_server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        wait_status(health, LIVENESS, SERVING)
        out = {}
        call = threading.Thread(target=lambda: out.setdefault("r", pb_grpc.GeneratorStub(ch).Generate(
            request("Hello", max_new_tokens=2, temperature=0.0, ignore_eos=True), timeout=60)))
        call.start()
        wait_status(health, LIVENESS, NOT_SERVING)
        # readiness is another question: the server still takes calls
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == SERVING
        time.sleep(1.0)  # several more polls of the watchdog while still stalled: one dump only
        stuck_server.release.set()
        call.join(30)
        assert len(out["r"].token_ids) == 2
        wait_status(health, LIVENESS, SERVING)
    dumps = [r.getMessage() for r in caplog.records if "engine stalled" in r.getMessage()]
    assert len(dumps) == 1
    assert "--- thread kvgen-engine" in dumps[0] and "stuck_forward" in dumps[0]
    assert any("progressing again" in r.getMessage() for r in caplog.records)


def test_idle_engine_is_live(tiny_server):
    with tiny_server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvgen.v1.Generator", LIVENESS):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
    assert tiny_server.gen.engine.stalled_s() == 0.0
