"""Calls with raw bytes through a real channel (no client-side serialization), and readers of the
google.rpc details that an error carries."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

GENERATOR = "/kvgen.v1.Generator/"
# every kvgen.v1 method, and whether it streams its responses
METHODS = {GENERATOR + "Generate": False, GENERATOR + "GenerateStream": True, GENERATOR + "BatchGenerate": False,
           GENERATOR + "BatchGenerateStream": True, GENERATOR + "GetModelInfo": False,
           GENERATOR + "CreateSession": False, GENERATOR + "CloseSession": False}


def call_raw(channel: grpc.Channel, method: str, body: bytes, streaming: bool = False, timeout: float = 30,
             metadata=()) -> list[bytes]:
    """Send body as the request of method; the response bytes (all of a stream's)."""
    if streaming:
        return list(channel.unary_stream(method)(body, timeout=timeout, metadata=metadata))
    return [channel.unary_unary(method)(body, timeout=timeout, metadata=metadata)]


def code_of(channel: grpc.Channel, method: str, body: bytes, streaming: bool = False, **kw) -> grpc.StatusCode:
    try:
        call_raw(channel, method, body, streaming, **kw)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def bad_request(err: grpc.RpcError) -> list[tuple[str, str]]:
    """The google.rpc.BadRequest field violations an INVALID_ARGUMENT error carries ([] if none)."""
    md = dict(err.trailing_metadata() or ())
    if "grpc-status-details-bin" not in md:
        return []
    status = status_pb2.Status.FromString(md["grpc-status-details-bin"])
    br = error_details_pb2.BadRequest()
    for d in status.details:
        if d.Unpack(br):
            return [(v.field, v.description) for v in br.field_violations]
    return []
