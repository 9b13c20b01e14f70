"""Servers for the Python client's tests, all real and on loopback: a kvgen server over a tiny
random model (a step costs a millisecond), and FlakyServer, a grpc.aio server whose small
Generator fails calls as a test tells it to (UNAVAILABLE before the first message, after it, ...)
and counts the calls that reached it."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.model import Model
from kvgen.engine.tokenizer import TextTokenizer
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import ServerThread, free_port
from tests.tiny import CHATML_TEMPLATE, tiny_bpe_tokenizer, tiny_config, tiny_weights

REPLICA = "replica-under-test"
KEY = "client-test-key"


@pytest.fixture(scope="module")
def tiny_kvgen():
    """A kvgen server over a 2-layer random Llama with a ChatML template; API key KEY, batches
    of 4 at most."""
    tok = TextTokenizer(tiny_bpe_tokenizer(300), CHATML_TEMPLATE, bos_id=None, add_bos=False,
                        special_ids={0, 1, 2}, eos_token="<|im_end|>")
    cfg = tiny_config(vocab=300, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=2048)
    gen = Generator(Model(cfg, tiny_weights(cfg, seed=3)), tok, EngineOptions(kv_cache_mb=16))
    s = ServerThread(gen, replica_id=REPLICA, max_batch_entries=4, api_key=KEY)
    yield s
    s.stop()


def unavailable(retry_after: float | None = None, code: int = code_pb2.UNAVAILABLE) -> grpc.Status:
    details = []
    if retry_after is not None:
        info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=int(retry_after), nanos=int(retry_after % 1 * 1e9)))
        details = [any_pb2.Any()]
        details[0].Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=code, message="not now", details=details))


@dataclass
class Script:
    """What FlakyServer does: the first `fail` calls end with `status` (after `sent` stream
    messages); every call's metadata is kept in `seen`."""

    fail: int = 0
    status: grpc.Status = field(default_factory=unavailable)
    sent: int = 0
    seen: list[dict] = field(default_factory=list)


class _Flaky(pb_grpc.GeneratorServicer):
    def __init__(self, script: Script):
        self.script = script

    def _maybe_fail(self, context) -> bool:
        s = self.script
        s.seen.append(dict(context.invocation_metadata()))
        return len(s.seen) <= s.fail

    async def Generate(self, req, context):
        if self._maybe_fail(context):
            await context.abort_with_status(self.script.status)
        return pb.GenerateResponse(request_id=req.request_id, text="ok", token_ids=[7, 8],
                                   finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=2))

    async def GenerateStream(self, req, context):
        fail = self._maybe_fail(context)
        for i in range(self.script.sent if fail else 3):
            yield pb.GenerateStreamResponse(text=f"t{i}", token_ids=[i])
        if fail:
            await context.abort_with_status(self.script.status)
        yield pb.GenerateStreamResponse(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=3))

    async def CreateSession(self, req, context):
        if self._maybe_fail(context):
            await context.abort_with_status(self.script.status)
        return pb.CreateSessionResponse(session_id=req.session_id, ttl_seconds=60)

    async def CloseSession(self, req, context):
        self.script.seen.append(dict(context.invocation_metadata()))
        return pb.CloseSessionResponse()


class FlakyServer:
    """A grpc.aio server with _Flaky on its own loop thread; start() binds `port` (which may be
    chosen before, to test a client that calls before anything listens)."""

    def __init__(self, port: int):
        self.port, self.target, self.script = port, f"127.0.0.1:{port}", Script()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = None

    def start(self) -> FlakyServer:
        async def go():
            server = grpc.aio.server()
            pb_grpc.add_GeneratorServicer_to_server(_Flaky(self.script), server)
            server.add_insecure_port(self.target)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)
        return self

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def flaky():
    s = FlakyServer(free_port()).start()
    yield s
    s.stop()
