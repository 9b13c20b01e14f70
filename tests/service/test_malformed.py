"""Bodies that do not parse are INVALID_ARGUMENT with a BadRequest on every method, without a
logged traceback; the server goes on answering."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

from .wire import GENERATOR, METHODS, bad_request, call_raw

# structurally broken for any message type
CORRUPT = {
    "truncated length-delimited field": b"\x0a\x05ab",
    "wire type 7": b"\x0f",
    "varint never ends": b"\x08" + b"\xff" * 11,
    "end-group without a start": b"\x0c",
}
# a string field 1 holding invalid UTF-8: prompt, session_id, and the health check's service
BAD_UTF8 = b"\x0a\x02\xff\xfe"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def cases():
    for method, streaming in METHODS.items():
        for name, body in CORRUPT.items():
            yield pytest.param(method, streaming, body, id=f"{method.rsplit('/', 1)[1]}-{name}")
    for method in (*[m for m in METHODS if m.endswith(("/Generate", "/GenerateStream", "/CloseSession"))],
                   HEALTH_CHECK):
        yield pytest.param(method, method.endswith("Stream"), BAD_UTF8, id=f"{method.rsplit('/', 1)[1]}-utf8")
    yield pytest.param(HEALTH_CHECK, False, CORRUPT["wire type 7"], id="Check-corrupt")


@pytest.mark.parametrize("method, streaming, body", list(cases()))
def test_unparseable_body_is_invalid_argument(tiny_server, caplog, method, streaming, body):
    with caplog.at_level(logging.WARNING), tiny_server.channel() as ch:
        with pytest.raises(grpc.RpcError) as e:
            call_raw(ch, method, body, streaming)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    fields = bad_request(e.value)
    assert [f for f, _ in fields] == ["request"]
    assert "not a valid" in fields[0][1]
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def test_bad_utf8_inside_a_batch_entry(tiny_server):
    entry = pb.GenerateRequest(prompt_token_ids=[1]).SerializeToString() + BAD_UTF8
    body = b"\x0a" + bytes([len(entry)]) + entry
    with tiny_server.channel() as ch, pytest.raises(grpc.RpcError) as e:
        call_raw(ch, GENERATOR + "BatchGenerate", body)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_reflection_stream_with_a_bad_message(tiny_server):
    """A request stream (reflection's bidi call) whose second message does not parse."""
    good = b"\x3a\x00"  # list_services: ""
    with tiny_server.channel() as ch, pytest.raises(grpc.RpcError) as e:
        list(ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
            iter([good, CORRUPT["wire type 7"]]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_server_still_answers_after_garbage(tiny_server):
    with tiny_server.channel() as ch:
        for method, streaming in METHODS.items():
            with pytest.raises(grpc.RpcError):
                call_raw(ch, method, CORRUPT["truncated length-delimited field"], streaming)
        r = pb_grpc.GeneratorStub(ch).Generate(request("Hello", max_new_tokens=3, temperature=0.0), timeout=30)
    assert len(r.token_ids) == 3
