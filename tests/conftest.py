"""Shared fixtures: the embedded model (loaded once), engines over it, servers on loopback; and the
test tiers (docs/testing.md).

Tiers: `make test` runs every test but the `slow` and `gpu` ones. `make test-fast`, what a
contributor runs before each commit, also leaves out the `heavy` ones: a test is heavy when it
loads the embedded 135M model or the transformers oracle (the fixtures in REAL_MODEL, at any depth),
or when its file builds, installs or starts processes (HEAVY_FILES), or when it says so itself
(`@pytest.mark.heavy`: kernel builds for other ISAs in a subprocess, long engine runs).
`make test` runs its tests on two workers, then the `serial` ones (SERIAL) alone: they hold the
event loop, the engine or a call to a time limit, which another worker's load could break.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
from pathlib import Path

import grpc
import pytest

from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.model_files import embedded_model_path
from kvgen.service.server import Server
from kvgen.service.settings import Settings
from kvgen.v1 import generate_pb2_grpc as pb_grpc

REAL_MODEL = {"embedded", "embedded_fp32", "gen", "make_gen", "server", "stub", "hf_model"}
HEAVY_FILES = {
    "tests/engine/test_lora.py": "writes PEFT adapters, runs transformers + PEFT as the oracle (~2 min)",
    "tests/service/test_lora.py": "writes PEFT adapters for a server's tiny model",
    "tests/service/test_go_client.py": "installs Debian's Go toolchain, builds the Go client",
    "tests/service/test_node_client.py": "npm ci, the Node.js client's suite",
    "tests/service/http/test_lm_eval.py": "lm-eval in a venv of its own, evaluating over HTTP",
    "tests/service/test_serve.py": "`make serve` and server processes on the real model",
    "tests/service/test_chaos.py": "server processes killed mid-stream",
    "tests/service/test_unsupported_model.py": "server processes refusing a model",
    "tests/engine/test_families.py": "llama.cpp's converter on a tiny model of each family (~3 min)",
    "tests/engine/test_mamba2.py": "llama.cpp's converter on a tiny Mamba-2, transformers as the oracle",
    "tests/engine/test_tokenizer_sentencepiece.py": "llama.cpp's converter on a sentencepiece-vocabulary model",
    "tests/service/test_model_info_layout.py": "a tiny gemma2 made by transformers, servers on the real model",
    "tests/service/test_soak.py": "a 30 s soak",
    "tests/deploy/test_envoy.py": "Envoy and replica processes",
    "tests/deploy/test_smg.py": "smg and replica processes",
    "tests/deploy/test_smg_grpc.py": "the smg binary over a server's vLLM gRPC worker service",
    "tests/deploy/test_mesh_start.py": "replica processes, one of them refusing its model",
    "tests/gpu/test_compile.py": "nvcc / NVRTC compiles of every kernel",
    "tests/gpu/test_numba_pack.py": "Numba CUDA kernels in the simulator",
    "tests/gpu/test_emulated_flash_decode.py": "the CUDA kernels compiled for the host and run",
    "tests/gpu/test_emulated_exact_tail.py": "the CUDA kernels compiled for the host and run",
    "tests/gpu/test_emulated_kv_append.py": "the CUDA kernels compiled for the host and run",
    "tests/gpu/test_launch.py": "the CUDA kernels compiled for the host",
    "tests/cpu/test_kernel_cache.py": "kernel builds in fresh processes and caches",
    "tests/engine/speculative/test_lossless.py": "speculative decoding end to end, every drafter (~2 min)",
    "tests/engine/speculative/test_eagle_training.py": "trains an EAGLE head",
    "tests/test_require_gpu.py": "pytest in subprocesses, with and without KVGEN_REQUIRE_GPU",
}

SERIAL = {
    "tests/service/test_event_loop.py": "no loop callback may take over 0.2 s",
    "tests/service/test_limits.py": "calls within 5 ms and 1 s",
    "tests/engine/speculative/test_policy.py": "the cost gate weighs measured step and draft times",
    "tests/service/test_chaos.py": "UNAVAILABLE within a bound after a kill",
    "tests/deploy/test_smg.py": "smg sees a draining replica's 503 within a bound",
    "tests/client/test_retry.py": "retries within their time budget",
}


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent.parent
    for item in items:
        path = Path(item.fspath).resolve()
        if not path.is_relative_to(root):  # a suite written to a temp dir (tests/test_require_gpu.py)
            continue
        rel = path.relative_to(root).as_posix()
        if REAL_MODEL & set(item.fixturenames) or rel in HEAVY_FILES:
            item.add_marker(pytest.mark.heavy)
        if rel in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """KVGEN_REQUIRE_GPU (`make test-gpu` sets it): a `gpu` test that skips fails instead, so a run
    without a device, CuPy or Numba's CUDA target cannot pass by skipping everything."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("KVGEN_REQUIRE_GPU") and item.get_closest_marker("gpu"):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"KVGEN_REQUIRE_GPU is set and this GPU test skipped: {why}"


# Finished requests and their sequences hold each other, and through their tables a Generator's structures,
# until Python's cycle collector runs; a module that starts many Generators (each with KV_CACHE_MB of pool
# and its own buffers) grew a worker past 15 GB before it did, two such workers nearly the 24 GB machine.
# Collecting after every test costs ~0.3 s (285k objects), so a worker collects when it has grown this much.
COLLECT_ABOVE_MB = 3072


def pytest_runtest_teardown(item, nextitem):
    with open("/proc/self/status") as f:
        rss = next((int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS:")), 0)
    if rss > COLLECT_ABOVE_MB:
        gc.collect()


def run_together(gen: Generator, requests: list[tuple]) -> list:
    """Each (token ids, SamplingParams, submit's keywords) handed to gen's engine while its inbox is held,
    so all join the engine's next step (on a loaded machine it could otherwise finish the first before
    the next is submitted); their events added up, in order, once the engine has let go of their blocks."""

    async def go():
        with gen.engine._cv:  # (a reentrant lock: submit takes it too)
            reqs = [gen.submit(ids, params, **kw) for ids, params, kw in requests]
        out = [await r.result() for r in reqs]
        for r in reqs:
            await r.released()
        return out

    return gen.bridge.run(go())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2 GGUF as `make serve` runs it: WEIGHT_DTYPE auto, the
    file's own blocks on the CPU kernels, one-sequence decode steps fused (decode_step.py). The engine's
    and the service's suites run over it: what a user runs, and ~3x faster than fp32 copies."""
    return load_model(embedded_model_path())


@pytest.fixture(scope="session")
def embedded_fp32():
    """The same file dequantized to fp32 (WEIGHT_DTYPE=fp32, Model.forward in torch): for what only fp32
    weights show, logits equal to transformers' to float rounding."""
    return load_model(embedded_model_path(), "fp32")


@pytest.fixture(scope="session")
def gen(embedded):
    g = Generator(*embedded, EngineOptions())
    yield g
    g.close()


@pytest.fixture
def make_gen(embedded):
    """Engines with their own options over the shared model; closed after the test."""
    made = []

    def make(**options) -> Generator:
        g = Generator(*embedded, EngineOptions(**options))
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


class ServerThread:
    """A real kvgen server (grpc.aio) on its own event loop thread, bound to loopback."""

    def __init__(self, gen: Generator | None, **settings):
        self.settings = Settings(host="127.0.0.1", port=0, metrics_port=free_port(), grace_s=5.0, **settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            server = Server(self.settings, gen)
            await server.start()
            return server

        self.server = self.run(start())
        self.port = self.server.port
        self.target = f"127.0.0.1:{self.port}"

    def run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def gen(self) -> Generator:
        return self.server.servicer.gen

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stop(self) -> None:
        self.run(self.server.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def stop_all(servers: list[ServerThread]) -> None:
    """Drain the servers at once: a drain waits on its own clock (server.REFUSE_BEFORE_STOP_S, grpc's
    stop, the engine's close), ~1 s each, which one after another came to 30 s of a session's end."""
    threads = [threading.Thread(target=s.stop) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture(scope="session")
def server(embedded):
    s = ServerThread(Generator(*embedded, EngineOptions()))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def stub(server):
    ch = server.channel()
    yield pb_grpc.GeneratorStub(ch)
    ch.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """A 2-layer random Llama with a 300-token BPE, as a GGUF file a server process loads from MODEL."""
    from tests.tiny import tiny_bpe_tokenizer, tiny_config, tiny_weights, write_gguf

    tok = tiny_bpe_tokenizer(300)
    cfg = tiny_config(vocab=tok.get_vocab_size(), layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=2048)
    cfg.bos_token_id, cfg.eos_token_ids = None, [2]
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    write_gguf(path, cfg, tiny_weights(cfg, seed=5), tok)
    return str(path)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own loading of the same GGUF, fp32: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = embedded_model_path()
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tok
