"""Fixtures for the OpenAI-compatible HTTP API: tiny-model servers with HTTP_PORT on loopback,
and the real openai SDK pointed at them."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import ServerThread, free_port


def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http.port}/v1"


def sdk(server: ServerThread, api_key: str = "unused", **kw) -> openai.OpenAI:
    """The openai SDK on server; no retries, so a refusal is seen as it was sent."""
    return openai.OpenAI(base_url=base_url(server), api_key=api_key, max_retries=0, timeout=120, **kw)


@pytest.fixture(scope="module")
def http_server(start_server) -> ServerThread:
    """A tiny-model server with the HTTP API on (and gRPC beside it, as always)."""
    return start_server(http_port=free_port())


@pytest.fixture(scope="module")
def model(http_server) -> str:
    return http_server.gen.cfg.name


@pytest.fixture
def client(http_server):
    c = sdk(http_server)
    yield c
    c.close()


def wait_released(server: ServerThread, timeout: float = 10) -> None:
    """Until no request holds KV blocks and the engine has nothing to do."""
    import time

    deadline = time.time() + timeout
    while (server.gen.scheduler.kv.used or not server.gen.engine.idle) and time.time() < deadline:
        time.sleep(0.02)
    assert server.gen.scheduler.kv.used == 0 and server.gen.engine.idle
