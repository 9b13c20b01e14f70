"""Channels to a kvgen server (plain, TLS or mTLS; sync or grpc.aio) and waiting for one to serve."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The server sends up to MAX_SEND_BYTES (64 MiB by default); grpc clients accept 4 MB unless told.
MAX_RECEIVE_BYTES = 64 << 20
# A channel that failed to connect waits before it tries again (1 s, growing, by grpc's default);
# calls meanwhile fail at once with UNAVAILABLE. The clients retry those with their own backoff,
# which is wasted while the channel sleeps: reconnect sooner, and never wait longer than 5 s.
OPTIONS = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
           ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
           ("grpc.max_reconnect_backoff_ms", 5000)]


def _credentials(tls: bool, ca_file: str | None, cert_file: str | None,
                 key_file: str | None) -> grpc.ChannelCredentials | None:
    if not (tls or ca_file or cert_file or key_file):
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both cert_file and key_file")
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


def open_channel(target: str, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None) -> grpc.Channel:
    """A channel to a kvgen server. TLS when tls is set or any file is given: ca_file verifies the
    server (default: the system's roots); cert_file + key_file are this client's certificate, for
    a server that requires one (mTLS)."""
    creds = _credentials(tls, ca_file, cert_file, key_file)
    if creds is None:
        return grpc.insecure_channel(target, options=OPTIONS)
    return grpc.secure_channel(target, creds, options=OPTIONS)


def open_aio_channel(target: str, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                     key_file: str | None = None) -> grpc.aio.Channel:
    """The grpc.aio twin of open_channel (make it inside the event loop that uses it)."""
    creds = _credentials(tls, ca_file, cert_file, key_file)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=OPTIONS)
    return grpc.aio.secure_channel(target, creds, options=OPTIONS)


def serving_status(value: int) -> str:
    """A health status by name: SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(value)


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
