"""The errors the clients raise: one class per gRPC status code that means something to a caller,
with the google.rpc details the server sends decoded (grpcio-status):

    KvgenError                  any failed call; .code(), .details(), .message, .status
    ├─ InvalidArgument          .field_violations: the BadRequest's (field, description) pairs
    ├─ Unauthenticated          no API key, or a wrong one
    ├─ PermissionDenied
    ├─ NotFound                 an unknown, closed or expired session
    ├─ ResourceExhausted        .retry_delay: RetryInfo's delay in seconds (None when not sent)
    ├─ Unavailable              loading, draining, unreachable; .retry_delay as above
    ├─ Cancelled                an Abort call or the caller's own cancel()
    ├─ DeadlineExceeded         the call's timeout passed
    └─ Internal

Each is also a grpc.RpcError with the same code(), details() and trailing_metadata(), so code
written against the raw stubs (`except grpc.RpcError as e: e.code()`) keeps working. A batch's
failed entry is one of these too (made from its google.rpc.Status, with no trailers).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class KvgenError(grpc.RpcError):
    """A call that failed with a gRPC status (other than OK)."""

    def __init__(self, code: grpc.StatusCode, message: str, status: status_pb2.Status | None = None,
                 trailers: tuple = ()):
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self.message = message
        self.status = status  # the google.rpc.Status the server sent, None when it sent none
        self._trailers = trailers
        self.field_violations: tuple[FieldViolation, ...] = ()
        self.retry_delay: float | None = None
        for detail in status.details if status is not None else ():
            bad, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
            if detail.Unpack(bad):
                self.field_violations += tuple(FieldViolation(v.field, v.description) for v in bad.field_violations)
            elif detail.Unpack(retry):
                self.retry_delay = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def trailing_metadata(self) -> tuple:
        return self._trailers


class InvalidArgument(KvgenError):
    """The request is wrong; field_violations name the fields (`sampling.top_p`, ...)."""


class Unauthenticated(KvgenError):
    pass


class PermissionDenied(KvgenError):
    pass


class NotFound(KvgenError):
    """An unknown session (closed, expired, another API key's, or lost with its replica)."""


class ResourceExhausted(KvgenError):
    """The server is full (queue, sessions) or a stream's reader fell behind: try again after
    retry_delay seconds. Never retried by the clients: that is the caller's decision."""


class Unavailable(KvgenError):
    """The server is loading, draining or unreachable. The clients retry it for calls that never
    started; this is what is left when the retries ran out."""


class Cancelled(KvgenError):
    pass


class DeadlineExceeded(KvgenError):
    pass


class Internal(KvgenError):
    pass


BY_CODE: dict[grpc.StatusCode, type[KvgenError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied, grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted, grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled, grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.INTERNAL: Internal,
}
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def from_rpc_error(e: grpc.RpcError) -> KvgenError:
    """The KvgenError for a failed call (sync or grpc.aio), its google.rpc details decoded."""
    if isinstance(e, KvgenError):
        return e
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    try:
        status = rpc_status.from_call(e)
    except ValueError:  # details that disagree with the status (rewritten by a proxy): ignore them
        status = None
    trailers = tuple(e.trailing_metadata() or ()) if callable(getattr(e, "trailing_metadata", None)) else ()
    return BY_CODE.get(code, KvgenError)(code, e.details() or "", status, trailers)


def from_status(status: status_pb2.Status) -> KvgenError:
    """The KvgenError for a google.rpc.Status (a batch entry's error)."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return BY_CODE.get(code, KvgenError)(code, status.message, status)
