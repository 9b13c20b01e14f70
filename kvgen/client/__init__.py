"""kvgen.client: the Python client of a kvgen server (gRPC, kvgen.v1.Generator).

    from kvgen.client import Client, InvalidArgument

    with Client("localhost:50051", api_key="...", timeout=60) as c:
        for delta in c.stream([{"role": "user", "content": "Hi!"}], temperature=0.0):
            print(delta.text, end="", flush=True)
        done = c.generate("Once upon a time", max_new_tokens=16)   # a Completion
        print(done.text, done.finish_reason.name, done.usage.completion_tokens)
        with c.session("my-chat-1") as s:                          # KV cache kept between turns
            s.chat([{"role": "user", "content": "Hello"}])
            s.chat([{"role": "user", "content": "And then?"}])    # only the new turn is prefilled
        try:
            c.generate("x", top_p=2.0)
        except InvalidArgument as e:
            print(e.field_violations)                              # (FieldViolation('sampling.top_p', ...),)

AsyncClient (kvgen.client.aio) has the same methods as coroutines, over grpc.aio.

- Results are frozen dataclasses (kvgen.client.results): Completion, StreamDelta, ModelInfo,
  Load, AbortResult, SessionInfo; batch() gives one Completion or KvgenError per request,
  batch_stream() a BatchStream of BatchStreamDelta (entry index, and its delta or its error).
- Errors are a KvgenError hierarchy (kvgen.client.errors), each still a grpc.RpcError, with the
  google.rpc details decoded: InvalidArgument.field_violations, ResourceExhausted.retry_delay, ...
- UNAVAILABLE is retried with backoff for calls that never started (kvgen.client.retry.Retry;
  attempts=4 by default, never past the call's deadline); nothing else is retried.
- A session's id (chosen here when not given) goes with each of its calls as `x-session-id`
  metadata, for a mesh to route by; the API key as `authorization: Bearer`.

The modules: wire (requests and metadata), channels (plain/TLS channels, wait_serving), results,
errors, retry, sync (Client, Stream, BatchStream, Session), aio (AsyncClient, AsyncStream,
AsyncBatchStream, AsyncSession).
"""

from kvgen.client.aio import AsyncBatchStream, AsyncClient, AsyncSession, AsyncStream
from kvgen.client.channels import MAX_RECEIVE_BYTES, open_aio_channel, open_channel, wait_serving
from kvgen.client.errors import (
                                 Cancelled,
                                 DeadlineExceeded,
                                 FieldViolation,
                                 Internal,
                                 InvalidArgument,
                                 KvgenError,
                                 NotFound,
                                 PermissionDenied,
                                 ResourceExhausted,
                                 Unauthenticated,
                                 Unavailable,
                                 from_rpc_error,
                                 from_status,
)
from kvgen.client.results import (
                                 AbortResult,
                                 AdapterInfo,
                                 BatchStreamDelta,
                                 Completion,
                                 FinishReason,
                                 Load,
                                 ModelInfo,
                                 PrefixCacheStats,
                                 SessionInfo,
                                 StreamDelta,
                                 Timings,
                                 TokenLogprob,
                                 TopLogprob,
                                 Usage,
)
from kvgen.client.retry import NO_RETRY, Retry
from kvgen.client.sync import BatchStream, Client, Session, Stream
from kvgen.client.wire import REPLICA_TRAILER, SESSION_HEADER, replica, request, session_lost

__all__ = [
    "AbortResult", "AdapterInfo", "AsyncBatchStream", "AsyncClient", "AsyncSession", "AsyncStream", "BatchStream",
    "BatchStreamDelta", "Cancelled", "Client", "Completion",
    "DeadlineExceeded", "FieldViolation", "FinishReason", "Internal", "InvalidArgument", "KvgenError", "Load",
    "MAX_RECEIVE_BYTES", "ModelInfo", "NO_RETRY", "NotFound", "PermissionDenied", "PrefixCacheStats",
    "REPLICA_TRAILER", "ResourceExhausted", "Retry", "SESSION_HEADER", "Session", "SessionInfo", "Stream",
    "StreamDelta", "Timings", "TokenLogprob", "TopLogprob", "Unauthenticated", "Unavailable", "Usage",
    "from_rpc_error", "from_status", "open_aio_channel", "open_channel", "replica", "request", "session_lost",
    "wait_serving",
]
