"""A small Python client for kvgen.v1.Generator."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


def request(prompt: str | list[dict] | list[int], session_id: str = "", request_id: str = "",
            cache_salt: str = "", **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text, chat messages or token ids) and sampling fields."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), session_id=session_id, request_id=request_id,
                             cache_salt=cache_salt)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.prompt_token_ids.extend(prompt)
    return req


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

    def generate(self, prompt, timeout: float | None = None, **kw) -> pb.GenerateResponse:
        return self.stub.Generate(request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    def stream(self, prompt, timeout: float | None = None, **kw) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    def batch(self, requests: list[pb.GenerateRequest], timeout: float | None = None) -> pb.BatchGenerateResponse:
        return self.stub.BatchGenerate(pb.BatchGenerateRequest(requests=requests), timeout=timeout,
                                       metadata=self.metadata)

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def create_session(self) -> str:
        return self.stub.CreateSession(pb.CreateSessionRequest(), metadata=self.metadata).session_id

    def close_session(self, session_id: str) -> None:
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


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
