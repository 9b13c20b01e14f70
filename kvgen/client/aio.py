"""The asyncio client (grpc.aio): AsyncClient, AsyncStream and AsyncSession, the twins of the
blocking Client, Stream and Session with the same methods, results, errors and retries.

    async with AsyncClient("localhost:50051") as c:
        async for delta in c.stream("Once upon a time", max_new_tokens=32):
            print(delta.text, end="")

Make an AsyncClient inside the event loop that uses it (a grpc.aio channel belongs to one loop).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgen.client import results as r
from kvgen.client.channels import open_aio_channel, serving_status
from kvgen.client.errors import Cancelled, KvgenError, NotFound, from_rpc_error, from_status
from kvgen.client.retry import DEFAULT, Retry, deadline_of, remaining
from kvgen.client.sync import collect, collect_batch
from kvgen.client.wire import Metadata, Prompt, auth_metadata, replica_of, request, session_request, with_session
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


class AsyncStream:
    """The deltas of one GenerateStream call, as an async iterator of StreamDelta; the call starts
    when the AsyncStream is made. Retries as Stream's; cancel() ends the call, and a read after it
    raises errors.Cancelled. A task cancelled while it reads ends the call too (the server stops
    generating) and gets its CancelledError."""

    def __init__(self, start: Callable[[float | None], grpc.aio.UnaryStreamCall], retry: Retry,
                 deadline: float | None):
        self._start, self._retry, self._deadline = start, retry, deadline
        self._tries, self.received, self._cancelled = 1, 0, False
        self._call = start(remaining(deadline))

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> r.StreamDelta:
        while True:
            try:
                msg = await self._call.read()
            except asyncio.CancelledError:
                if not self._cancelled:  # the reading task was cancelled: end the call, and let it go on
                    self._call.cancel()
                    raise
                raise Cancelled(grpc.StatusCode.CANCELLED, "cancelled by the client") from None
            except grpc.RpcError as raw:
                e = from_rpc_error(raw)
                wait = None if self.received else self._retry.delay(e, self._tries, self._deadline)
                if wait is None:
                    raise e from raw
                await asyncio.sleep(wait)
                self._tries += 1
                self._call = self._start(remaining(self._deadline))
                continue
            if msg is grpc.aio.EOF:
                raise StopAsyncIteration
            self.received += 1
            return self._of(msg)

    _of = staticmethod(r.StreamDelta.of)  # a message as this stream's items are

    async def collect(self) -> r.Completion:
        """Read the rest of the stream into one Completion."""
        deltas = [d async for d in self]
        return collect(deltas, replica_of(await self._call.trailing_metadata()))

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def trailing_metadata(self):
        return await self._call.trailing_metadata()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._call.done():
            self.cancel()


class AsyncBatchStream(AsyncStream):
    """BatchStream's twin: the messages of one BatchGenerateStream call, as an async iterator of
    BatchStreamDelta; retries and cancel() as AsyncStream's."""

    def __init__(self, start: Callable[[float | None], grpc.aio.UnaryStreamCall], retry: Retry,
                 deadline: float | None, entries: int):
        super().__init__(start, retry, deadline)
        self.entries = entries

    _of = staticmethod(r.BatchStreamDelta.of)

    async def collect(self) -> list[r.Completion | KvgenError]:
        """Read the rest of the stream: per entry, in order, a Completion or its KvgenError."""
        items = [x async for x in self]
        return collect_batch(items, self.entries, replica_of(await self._call.trailing_metadata()))


class AsyncClient:
    """The asyncio twin of Client: the same arguments, and the same methods as coroutines (stream
    returns an AsyncStream to `async for` over; session(...) is awaited, or used as
    `async with client.session() as s:`)."""

    def __init__(self, target: str = "localhost:50051", api_key: str = "", channel: grpc.aio.Channel | None = None,
                 *, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, timeout: float | None = None, retry: Retry = DEFAULT):
        self.channel = channel or open_aio_channel(target, tls, ca_file, cert_file, key_file)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.metadata = auth_metadata(api_key)
        self.timeout, self.retry = timeout, retry

    def _deadline(self, timeout: float | None) -> float | None:
        return deadline_of(self.timeout if timeout is None else timeout)

    async def _unary(self, method, req, timeout: float | None, metadata: Metadata):
        deadline, tries = self._deadline(timeout), 1
        while True:
            call = method(req, timeout=remaining(deadline), metadata=metadata)
            try:
                resp = await call
                return resp, replica_of(await call.trailing_metadata())
            except grpc.RpcError as raw:
                e = from_rpc_error(raw)
                wait = self.retry.delay(e, tries, deadline)
                if wait is None:
                    raise e from raw
                await asyncio.sleep(wait)
                tries += 1

    async def generate(self, prompt: Prompt, timeout: float | None = None, **kw) -> r.Completion:
        resp, replica = await self._unary(self.stub.Generate, request(prompt, **kw), timeout,
                                          with_session(self.metadata, kw.get("session_id", "")))
        return r.Completion.of(resp, replica)

    async def chat(self, messages: Sequence, timeout: float | None = None, **kw) -> r.Completion:
        if isinstance(messages, str) or not messages:
            raise ValueError("chat wants a non-empty list of messages")
        return await self.generate(messages, timeout, **kw)

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw) -> AsyncStream:
        req, md = request(prompt, **kw), with_session(self.metadata, kw.get("session_id", ""))
        return AsyncStream(lambda t: self.stub.GenerateStream(req, timeout=t, metadata=md), self.retry,
                           self._deadline(timeout))

    async def batch(self, prompts: Iterable[Prompt | pb.GenerateRequest], timeout: float | None = None,
                    **kw) -> list[r.Completion | KvgenError]:
        reqs = [p if isinstance(p, pb.GenerateRequest) else request(p, **kw) for p in prompts]
        resp, replica = await self._unary(self.stub.BatchGenerate, pb.BatchGenerateRequest(requests=reqs), timeout,
                                          self.metadata)
        return [r.Completion.of(x.response, replica) if x.HasField("response") else from_status(x.error)
                for x in resp.results]

    def batch_stream(self, prompts: Iterable[Prompt | pb.GenerateRequest], timeout: float | None = None,
                     **kw) -> AsyncBatchStream:
        reqs = [p if isinstance(p, pb.GenerateRequest) else request(p, **kw) for p in prompts]
        msg = pb.BatchGenerateRequest(requests=reqs)
        return AsyncBatchStream(lambda t: self.stub.BatchGenerateStream(msg, timeout=t, metadata=self.metadata),
                                self.retry, self._deadline(timeout), len(reqs))

    async def model_info(self, timeout: float | None = None) -> r.ModelInfo:
        resp, _ = await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, self.metadata)
        return r.ModelInfo.of(resp)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        check = health_pb2_grpc.HealthStub(self.channel).Check
        resp, _ = await self._unary(check, health_pb2.HealthCheckRequest(service=service), timeout, self.metadata)
        return serving_status(resp.status)

    async def load(self, timeout: float | None = None) -> r.Load:
        return r.Load.of((await self._unary(self.stub.GetLoad, pb.GetLoadRequest(), timeout, self.metadata))[0])

    async def abort(self, request_ids: list[str], routing_key: str = "",
                    timeout: float | None = None) -> r.AbortResult:
        resp, _ = await self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids), timeout,
                                    with_session(self.metadata, routing_key))
        return r.AbortResult(tuple(resp.aborted), tuple(resp.unknown))

    async def load_adapter(self, name: str, path: str, timeout: float | None = None) -> r.AdapterInfo:
        """As Client.load_adapter."""
        resp, _ = await self._unary(self.stub.LoadAdapter, pb.LoadAdapterRequest(name=name, path=path), timeout,
                                    self.metadata)
        return r.AdapterInfo.of(resp.adapter)

    async def unload_adapter(self, name: str, wait: float = 0.0, timeout: float | None = None) -> None:
        """As Client.unload_adapter."""
        await self._unary(self.stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name, timeout_seconds=wait),
                          timeout, self.metadata)

    async def open_session(self, session_id: str = "", timeout: float | None = None, **options) -> r.SessionInfo:
        """As Client.open_session."""
        sid = session_id or uuid.uuid4().hex
        resp, _ = await self._unary(self.stub.CreateSession, session_request(sid, **options), timeout,
                                    with_session(self.metadata, sid))
        return r.SessionInfo(resp.session_id, resp.ttl_seconds)

    async def create_session(self, session_id: str = "", timeout: float | None = None, **options) -> str:
        return (await self.open_session(session_id, timeout, **options)).session_id

    async def close_session(self, session_id: str, timeout: float | None = None) -> None:
        await self._unary(self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id), timeout,
                          with_session(self.metadata, session_id))

    def session(self, session_id: str = "", timeout: float | None = None, **options) -> AsyncSession:
        """A session (open_session's options), opened by awaiting it or by entering it (`async with`;
        closed on leaving)."""
        return AsyncSession(self, session_id, timeout, **options)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncSession:
    """Session's twin; `s = await client.session()` or `async with client.session() as s:`."""

    def __init__(self, client: AsyncClient, session_id: str = "", timeout: float | None = None, **options):
        self.client, self._want, self._timeout, self._options = client, session_id, timeout, options
        self.info: r.SessionInfo | None = None

    async def open(self) -> AsyncSession:
        if self.info is None:
            self.info = await self.client.open_session(self._want, self._timeout, **self._options)
        return self

    def __await__(self):
        return self.open().__await__()

    @property
    def id(self) -> str:
        if self.info is None:
            raise RuntimeError("the session is not open yet: await it first")
        return self.info.session_id

    async def generate(self, prompt: Prompt, timeout: float | None = None, **kw) -> r.Completion:
        return await self.client.generate(prompt, timeout, session_id=self.id, **kw)

    async def chat(self, messages: Sequence, timeout: float | None = None, **kw) -> r.Completion:
        return await self.client.chat(messages, timeout, session_id=self.id, **kw)

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw) -> AsyncStream:
        return self.client.stream(prompt, timeout, session_id=self.id, **kw)

    async def close(self) -> None:
        await self.client.close_session(self.id)

    async def __aenter__(self) -> AsyncSession:
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        try:
            await self.close()
        except NotFound:
            pass
