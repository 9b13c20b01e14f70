"""Fixtures for the service's edges: tiny-model servers on loopback (fast to step), and TLS
certificates made for the test run."""

from __future__ import annotations

import pytest

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.model import Model
from kvgen.engine.tokenizer import TextTokenizer
from tests.conftest import ServerThread
from tests.tiny import CHATML_TEMPLATE, tiny_bpe_tokenizer, tiny_config, tiny_weights

from .certs import make_pki

TINY_VOCAB = 300


@pytest.fixture(scope="session")
def tiny_pair():
    """(model, tokenizer): a 2-layer random Llama over a 300-token byte-level BPE with a ChatML
    template; a step costs a millisecond and nothing is read from disk."""
    tok = TextTokenizer(tiny_bpe_tokenizer(TINY_VOCAB), CHATML_TEMPLATE, bos_id=None, add_bos=False,
                        special_ids={0, 1, 2}, eos_token="<|im_end|>")
    cfg = tiny_config(vocab=TINY_VOCAB, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=2048)
    return Model(cfg, tiny_weights(cfg, seed=3)), tok


@pytest.fixture(scope="session")
def start_server(tiny_pair):
    """start_server(**settings) -> a running ServerThread over its own tiny-model engine; every
    one started is drained at the end of the session."""
    started = []

    def start(engine: dict | None = None, **settings) -> ServerThread:
        s = ServerThread(Generator(*tiny_pair, EngineOptions(kv_cache_mb=16, **(engine or {}))), **settings)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def tiny_server(start_server):
    """A plain server with default settings but a small BatchGenerate limit."""
    return start_server(max_batch_entries=4)


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))
