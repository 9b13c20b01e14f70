"""A small Python client for kvgen.v1.Generator."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


def request(prompt: str | list[dict] | list[int], session_id: str = "", request_id: str = "",
            cache_salt: str = "", **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text, chat messages or token ids) and sampling fields
    (json_schema may be a dict, choice a list of strings)."""
    if isinstance(sampling.get("json_schema"), dict):
        sampling["json_schema"] = json.dumps(sampling["json_schema"])
    if isinstance(sampling.get("choice"), list | tuple):
        sampling["choice"] = pb.ChoiceList(choices=sampling["choice"])
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), session_id=session_id, request_id=request_id,
                             cache_salt=cache_salt)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.prompt_token_ids.extend(prompt)
    return req


# Behind a mesh every call of a session carries its id as metadata, and the proxy routes by it to
# the replica that holds the session (deploy/envoy); the server checks it agrees with the body.
SESSION_HEADER = "x-session-id"
REPLICA_TRAILER = "x-kvgen-replica"  # which replica answered a call (a trailer of every success)


def replica(call) -> str:
    """The replica that answered: from a finished call (a stream read to its end, or the call of
    a `.with_call` unary)."""
    return dict(call.trailing_metadata() or ()).get(REPLICA_TRAILER, "")


def session_lost(e: grpc.RpcError) -> bool:
    """A session call failed because its session is gone: NOT_FOUND (closed, expired, or its
    replica died and the mesh routed the call to another one) or UNAVAILABLE (its replica is
    unreachable). The remedy is to open the session again (Client.create_session(same id)) and
    resend the conversation."""
    return e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


# The server sends up to MAX_SEND_BYTES (64 MiB by default); grpc clients accept 4 MB unless told.
MAX_RECEIVE_BYTES = 64 << 20


def open_channel(target: str, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None) -> grpc.Channel:
    """A channel to a kvgen server. TLS when tls is set or any file is given: ca_file verifies the
    server (default: the system's roots); cert_file + key_file are this client's certificate, for
    a server that requires one (mTLS)."""
    options = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    if not (tls or ca_file or cert_file or key_file):
        return grpc.insecure_channel(target, options=options)
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both cert_file and key_file")
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))
    return grpc.secure_channel(target, creds, options=options)


class Client:
    def __init__(self, target: str = "localhost:50051", api_key: str = "", channel: grpc.Channel | None = None,
                 *, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None):
        """tls, ca_file, cert_file, key_file: see open_channel (ignored when a channel is given)."""
        self.channel = channel or open_channel(target, tls, ca_file, cert_file, key_file)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def _metadata(self, session_id: str = "") -> tuple[tuple[str, str], ...]:
        """The API key, and a session's id for the mesh to route by."""
        return (*self.metadata, (SESSION_HEADER, session_id)) if session_id else self.metadata

    def generate(self, prompt, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        return self.stub.Generate(request(prompt, **kw), timeout=timeout,
                                  metadata=self._metadata(kw.get("session_id", "")))

    def stream(self, prompt, timeout: float | None = None, **kw) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(request(prompt, **kw), timeout=timeout,
                                        metadata=self._metadata(kw.get("session_id", "")))

    def batch(self, requests: list[pb.GenerateRequest], timeout: float | None = None) -> pb.BatchGenerateResponse:
        return self.stub.BatchGenerate(pb.BatchGenerateRequest(requests=requests), timeout=timeout,
                                       metadata=self.metadata)

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def create_session(self, session_id: str = "") -> str:
        """Open a session under session_id (default: a fresh random id, chosen here so that the
        CreateSession call itself is routed by it, to the replica its later turns go to)."""
        sid = session_id or uuid.uuid4().hex
        return self.stub.CreateSession(pb.CreateSessionRequest(session_id=sid),
                                       metadata=self._metadata(sid)).session_id

    def close_session(self, session_id: str) -> None:
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), metadata=self._metadata(session_id))

    def abort(self, request_ids: list[str], routing_key: str = "") -> pb.AbortResponse:
        """End running requests by id (on the server this channel reaches; behind a mesh, send the
        routing_key the requests were sent with)."""
        return self.stub.Abort(pb.AbortRequest(request_ids=request_ids), metadata=self._metadata(routing_key))

    def load(self) -> pb.GetLoadResponse:
        return self.stub.GetLoad(pb.GetLoadRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_serving(target: str, timeout: float = 180, alive: Callable[[], bool] = lambda: True) -> None:
    """Return once the server at target reports SERVING on its health service (the model is
    loaded); TimeoutError after `timeout` seconds, RuntimeError as soon as alive() is False (a
    server process that exited, say)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"the server at {target} is gone")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the server at {target} never became SERVING")
