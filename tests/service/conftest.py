"""Fixtures for the service's edges: tiny-model servers on loopback (fast to step), and TLS
certificates made for the test run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.model import Model
from kvgen.engine.tokenizer import TextTokenizer
from tests.conftest import ServerThread, stop_all
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
    stop_all(started)


LORA_ADAPTER = "tiny-lora"


def write_tiny_adapter(folder: Path) -> Path:
    """A random PEFT LoRA adapter (every projection, rank 4) of tiny_pair's model: its weights are
    large enough to change greedy tokens."""
    from tests.engine.test_lora import _hf_logging_quiet, write_adapter
    from tests.tiny import tiny_bpe_tokenizer, write_hf_folder

    _hf_logging_quiet()
    cfg = tiny_config(vocab=TINY_VOCAB, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=2048)
    write_hf_folder(folder / "base", cfg, tiny_weights(cfg, seed=3), tiny_bpe_tokenizer(TINY_VOCAB))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return write_adapter(folder / "base", folder / LORA_ADAPTER, targets, 4, 8, False, seed=0)


@pytest.fixture(scope="module")
def lora_server(start_server, tmp_path_factory):
    """A tiny-model server with LORA_ADAPTER loaded; .adapter_path: its PEFT folder (the clients'
    tests load it again at run time)."""
    path = write_tiny_adapter(tmp_path_factory.mktemp("lora"))
    s = start_server(engine={"lora_adapters": f"{LORA_ADAPTER}={path}"})
    s.adapter_path = str(path)
    return s


@pytest.fixture(scope="module")
def tiny_server(start_server):
    """A plain server with default settings but a small BatchGenerate limit."""
    return start_server(max_batch_entries=4)


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


def node_version() -> tuple[int, ...]:
    out = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in out.strip().lstrip("v").split(".")[:2])


@pytest.fixture(scope="module")
def node_client() -> Path:
    """clients/node with its dependencies installed (npm ci from package-lock.json when missing)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node.js client")
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
