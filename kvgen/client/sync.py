"""The blocking client: Client, the Stream of one GenerateStream call, and Session."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgen.client import results as r
from kvgen.client.channels import open_channel, serving_status
from kvgen.client.errors import KvgenError, NotFound, from_rpc_error, from_status
from kvgen.client.retry import DEFAULT, Retry, deadline_of, remaining
from kvgen.client.wire import Metadata, Prompt, auth_metadata, replica_of, request, session_request, with_session
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


def collect(deltas: Sequence[r.StreamDelta], replica: str = "") -> r.Completion:
    """One Completion from a stream's deltas (their text and tokens joined; the last's reason,
    usage and timings; the first's prompt logprobs)."""
    last = deltas[-1] if deltas else r.StreamDelta("", "", ())
    return r.Completion(last.request_id, "".join(d.text for d in deltas), tuple(t for d in deltas for t in d.token_ids),
                        last.finish_reason, last.matched_stop, last.usage or r.Usage(), last.timings or r.Timings(),
                        tuple(p for d in deltas for p in d.logprobs), deltas[0].prompt_logprobs if deltas else (),
                        replica)


def collect_batch(items: Sequence[r.BatchStreamDelta], entries: int, replica: str = ""
                  ) -> list[r.Completion | KvgenError]:
    """A batch stream's messages as batch() gives them: per entry, in order, a Completion of its
    deltas (sample 0's, with sampling.n > 1) or the error that ended it."""
    deltas: list[list[r.StreamDelta]] = [[] for _ in range(entries)]
    errors: dict[int, KvgenError] = {}
    for item in items:
        if item.error is not None:
            errors[item.index] = item.error
        elif item.raw is None or item.raw.response.index == 0:
            deltas[item.index].append(item.delta)
    return [errors[i] if i in errors else collect(d, replica) for i, d in enumerate(deltas)]


class Stream:
    """The deltas of one GenerateStream call, as an iterator of StreamDelta. The call starts when
    the Stream is made, before the first next(). Until a message arrived, UNAVAILABLE is retried
    (Retry); after one, every failure is raised as a KvgenError. cancel() ends the call (the
    server stops generating); leaving a `with` block does too."""

    def __init__(self, start: Callable[[float | None], grpc.Call], retry: Retry, deadline: float | None):
        self._start, self._retry, self._deadline = start, retry, deadline
        self._tries, self.received = 1, 0
        self._call = start(remaining(deadline))

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> r.StreamDelta:
        while True:
            try:
                msg = next(self._call)
            except grpc.RpcError as raw:
                e = from_rpc_error(raw)
                wait = None if self.received else self._retry.delay(e, self._tries, self._deadline)
                if wait is None:
                    raise e from raw
                time.sleep(wait)
                self._tries += 1
                self._call = self._start(remaining(self._deadline))
                continue
            self.received += 1
            return self._of(msg)

    _of = staticmethod(r.StreamDelta.of)  # a message as this stream's items are

    def collect(self) -> r.Completion:
        """Read the rest of the stream into one Completion."""
        return collect(list(self), self.replica)

    def cancel(self) -> None:
        self._call.cancel()

    def trailing_metadata(self):
        return self._call.trailing_metadata()

    @property
    def replica(self) -> str:
        """The replica that answered (once the stream was read to its end)."""
        return replica_of(self._call.trailing_metadata()) if self._call.done() else ""

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class BatchStream(Stream):
    """The messages of one BatchGenerateStream call, as an iterator of BatchStreamDelta (each
    entry's deltas in order, the entries' interleaved); retries, cancel() and `with` as Stream's."""

    def __init__(self, start: Callable[[float | None], grpc.Call], retry: Retry, deadline: float | None,
                 entries: int):
        super().__init__(start, retry, deadline)
        self.entries = entries

    _of = staticmethod(r.BatchStreamDelta.of)

    def collect(self) -> list[r.Completion | KvgenError]:
        """Read the rest of the stream: per entry, in order, a Completion or its KvgenError."""
        return collect_batch(list(self), self.entries, self.replica)


class Client:
    """A blocking client of a kvgen server.

    target, or a ready channel; api_key (sent as `authorization: Bearer`); tls, ca_file,
    cert_file, key_file: see open_channel (ignored when a channel is given); timeout: the default
    deadline of every call in seconds (None: none; each method takes its own); retry: the policy
    for UNAVAILABLE on calls that never started (Retry(attempts=1) never retries).
    Every failure is a KvgenError (kvgen.client.errors)."""

    def __init__(self, target: str = "localhost:50051", api_key: str = "", channel: grpc.Channel | None = None,
                 *, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, timeout: float | None = None, retry: Retry = DEFAULT):
        self.channel = channel or open_channel(target, tls, ca_file, cert_file, key_file)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.metadata = auth_metadata(api_key)
        self.timeout, self.retry = timeout, retry

    def _deadline(self, timeout: float | None) -> float | None:
        return deadline_of(self.timeout if timeout is None else timeout)

    def _unary(self, method, req, timeout: float | None, metadata: Metadata):
        """(response, replica) of a unary call, UNAVAILABLE retried while no response came."""
        deadline, tries = self._deadline(timeout), 1
        while True:
            try:
                resp, call = method.with_call(req, timeout=remaining(deadline), metadata=metadata)
                return resp, replica_of(call.trailing_metadata())
            except grpc.RpcError as raw:
                e = from_rpc_error(raw)
                wait = self.retry.delay(e, tries, deadline)
                if wait is None:
                    raise e from raw
                time.sleep(wait)
                tries += 1

    def generate(self, prompt: Prompt, timeout: float | None = None, **kw) -> r.Completion:
        """Run one request to completion. prompt: text, chat messages or token ids; kw: session_id,
        request_id, cache_salt, and SamplingParams fields (temperature=0.0, max_new_tokens=64, ...)."""
        resp, replica = self._unary(self.stub.Generate, request(prompt, **kw), timeout,
                                    with_session(self.metadata, kw.get("session_id", "")))
        return r.Completion.of(resp, replica)

    def chat(self, messages: Sequence, timeout: float | None = None, **kw) -> r.Completion:
        """generate() over chat messages ({"role", "content"} dicts, (role, content) pairs, or
        objects with .role and .content), rendered with the model's chat template."""
        if isinstance(messages, str) or not messages:
            raise ValueError("chat wants a non-empty list of messages")
        return self.generate(messages, timeout, **kw)

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw) -> Stream:
        """Stream one request's deltas (arguments as generate's)."""
        req, md = request(prompt, **kw), with_session(self.metadata, kw.get("session_id", ""))
        return Stream(lambda t: self.stub.GenerateStream(req, timeout=t, metadata=md), self.retry,
                      self._deadline(timeout))

    def batch(self, prompts: Iterable[Prompt | pb.GenerateRequest], timeout: float | None = None,
              **kw) -> list[r.Completion | KvgenError]:
        """Run requests together: one result per request, in order, a Completion or the KvgenError
        of that request alone. kw (sampling fields) applies to the prompts, not to GenerateRequests."""
        reqs = [p if isinstance(p, pb.GenerateRequest) else request(p, **kw) for p in prompts]
        resp, replica = self._unary(self.stub.BatchGenerate, pb.BatchGenerateRequest(requests=reqs), timeout,
                                    self.metadata)
        return [r.Completion.of(x.response, replica) if x.HasField("response") else from_status(x.error)
                for x in resp.results]

    def batch_stream(self, prompts: Iterable[Prompt | pb.GenerateRequest], timeout: float | None = None,
                     **kw) -> BatchStream:
        """Run requests together as batch() does, streaming each one's deltas as they come: a
        BatchStream of BatchStreamDelta, each tagged by its entry's position; a failed entry ends
        with its KvgenError and the others go on. cancel() (or the timeout) ends every entry."""
        reqs = [p if isinstance(p, pb.GenerateRequest) else request(p, **kw) for p in prompts]
        msg = pb.BatchGenerateRequest(requests=reqs)
        return BatchStream(lambda t: self.stub.BatchGenerateStream(msg, timeout=t, metadata=self.metadata),
                           self.retry, self._deadline(timeout), len(reqs))

    def model_info(self, timeout: float | None = None) -> r.ModelInfo:
        return r.ModelInfo.of(self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout,
                                          self.metadata)[0])

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The health service's word on the server: SERVING once the model is loaded, NOT_SERVING
        while it drains (service "" is the server; "kvgen.v1.Generator" the API)."""
        check = health_pb2_grpc.HealthStub(self.channel).Check
        resp, _ = self._unary(check, health_pb2.HealthCheckRequest(service=service), timeout, self.metadata)
        return serving_status(resp.status)

    def load(self, timeout: float | None = None) -> r.Load:
        return r.Load.of(self._unary(self.stub.GetLoad, pb.GetLoadRequest(), timeout, self.metadata)[0])

    def abort(self, request_ids: list[str], routing_key: str = "", timeout: float | None = None) -> r.AbortResult:
        """End running requests by id (on the server this channel reaches; behind a mesh, send the
        routing_key the requests were sent with)."""
        resp, _ = self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids), timeout,
                              with_session(self.metadata, routing_key))
        return r.AbortResult(tuple(resp.aborted), tuple(resp.unknown))

    def load_adapter(self, name: str, path: str, timeout: float | None = None) -> r.AdapterInfo:
        """Load a LoRA adapter (a PEFT folder or .gguf file on the server's disk) under name; admin-only
        when the server has API keys (PermissionDenied)."""
        resp, _ = self._unary(self.stub.LoadAdapter, pb.LoadAdapterRequest(name=name, path=path), timeout,
                              self.metadata)
        return r.AdapterInfo.of(resp.adapter)

    def unload_adapter(self, name: str, wait: float = 0.0, timeout: float | None = None) -> None:
        """Unload it once the requests running with it finish; FailedPrecondition if some still run
        after `wait` seconds (0: the server's 30 s), the adapter then still loaded."""
        self._unary(self.stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name, timeout_seconds=wait), timeout,
                    self.metadata)

    def open_session(self, session_id: str = "", timeout: float | None = None, **options) -> r.SessionInfo:
        """Open a session under session_id (default: a fresh random id, chosen here so that the
        CreateSession call itself is routed by it, to the replica its later turns go to). options:
        what every turn runs with: adapter, kv_compress, kv_compress_window, kv_compress_ratio."""
        sid = session_id or uuid.uuid4().hex
        resp, _ = self._unary(self.stub.CreateSession, session_request(sid, **options), timeout,
                              with_session(self.metadata, sid))
        return r.SessionInfo(resp.session_id, resp.ttl_seconds)

    def create_session(self, session_id: str = "", timeout: float | None = None, **options) -> str:
        """open_session, its id only."""
        return self.open_session(session_id, timeout, **options).session_id

    def close_session(self, session_id: str, timeout: float | None = None) -> None:
        self._unary(self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id), timeout,
                    with_session(self.metadata, session_id))

    def session(self, session_id: str = "", timeout: float | None = None, **options) -> Session:
        """Open a session (open_session's options) and return it; `with client.session() as s:`
        closes it at the end."""
        return Session(self, self.open_session(session_id, timeout, **options))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """An open session: its turns reuse the conversation's KV cache on the server. Chat messages
    sent to it are appended to the conversation (the server keeps the replies); a text prompt or
    token ids continue its token history."""

    def __init__(self, client: Client, info: r.SessionInfo):
        self.client, self.info = client, info

    @property
    def id(self) -> str:
        return self.info.session_id

    def generate(self, prompt: Prompt, timeout: float | None = None, **kw) -> r.Completion:
        return self.client.generate(prompt, timeout, session_id=self.id, **kw)

    def chat(self, messages: Sequence, timeout: float | None = None, **kw) -> r.Completion:
        return self.client.chat(messages, timeout, session_id=self.id, **kw)

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw) -> Stream:
        return self.client.stream(prompt, timeout, session_id=self.id, **kw)

    def close(self) -> None:
        self.client.close_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        except NotFound:  # gone already (expired, or lost with its replica): nothing to free
            pass
