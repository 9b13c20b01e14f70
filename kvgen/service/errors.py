"""Engine exceptions -> gRPC status with google.rpc details."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from kvgen.errors import Cancelled, InvalidRequest, NotFound, Overloaded, Unavailable

# A status travels in trailing metadata, which clients cap (16 KiB by default): an error that
# echoes a client's input must stay far below that, whatever the input was.
MAX_MESSAGE = 1024
MAX_DESCRIPTION = 256


def clip(text: str, limit: int = 64) -> str:
    """text's first `limit` characters and how many more there were: for echoing a client's input
    (a session id, a stop string) into an error message."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more)"


def to_status(e: Exception) -> status_pb2.Status:
    """A google.rpc.Status for any exception a request can raise; messages clipped."""
    status = _to_status(e)
    status.message = clip(status.message, MAX_MESSAGE)
    return status


def _to_status(e: Exception) -> status_pb2.Status:
    if isinstance(e, InvalidRequest):
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=clip(f, MAX_DESCRIPTION),
                                                        description=clip(d, MAX_DESCRIPTION))
            for f, d in e.violations[:32]])
        return _status(code_pb2.INVALID_ARGUMENT, str(e), bad)
    if isinstance(e, Overloaded):
        seconds = max(e.retry_after, 0.001)
        retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=int(seconds), nanos=int((seconds % 1) * 1e9)))
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(e), retry)
    if isinstance(e, NotFound):
        return _status(code_pb2.NOT_FOUND, str(e))
    if isinstance(e, Unavailable):
        return _status(code_pb2.UNAVAILABLE, str(e))
    if isinstance(e, Cancelled):
        return _status(code_pb2.CANCELLED, str(e))
    return _status(code_pb2.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _status(code: int, message: str, detail=None) -> status_pb2.Status:
    details = []
    if detail is not None:
        a = any_pb2.Any()
        a.Pack(detail)
        details.append(a)
    return status_pb2.Status(code=code, message=message, details=details)


async def abort(context: grpc.aio.ServicerContext, e: Exception):
    from grpc_status import rpc_status

    await context.abort_with_status(rpc_status.to_status(to_status(e)))
