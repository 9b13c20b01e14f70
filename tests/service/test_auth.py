"""API_KEY: checked before the body is parsed, in constant time; probes and reflection stay open."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvgen.client import Client
from kvgen.service.auth import AuthInterceptor
from kvgen.v1 import generate_pb2 as pb

from .wire import GENERATOR, METHODS, code_of

KEY = "s3cret-key"
GARBAGE = [b"\x0a\x02\xff\xfe", b"\x0f", b"\x0a\x05ab"]


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server(api_key=KEY)


def bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


@pytest.mark.parametrize("method", list(METHODS))
def test_garbage_without_the_key_is_unauthenticated(keyed, method):
    with keyed.channel() as ch:
        for body in GARBAGE:
            assert code_of(ch, method, body, METHODS[method]) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(ch, method, body, METHODS[method], metadata=bearer("wrong")) == \
                grpc.StatusCode.UNAUTHENTICATED
        # with the key, the bytes reach the gate, which refuses what does not parse as malformed
        assert code_of(ch, method, b"\x0f", METHODS[method], metadata=bearer(KEY)) == grpc.StatusCode.INVALID_ARGUMENT


def test_calls_need_the_exact_key(keyed):
    body = pb.GetModelInfoRequest().SerializeToString()
    method = GENERATOR + "GetModelInfo"
    with keyed.channel() as ch:
        for md in ((), bearer(""), bearer(KEY[:-1]), bearer(KEY + "x"), (("authorization", KEY),),
                   bearer(KEY) + bearer(KEY)):  # a repeated header is refused, not guessed at
            assert code_of(ch, method, body, metadata=md) == grpc.StatusCode.UNAUTHENTICATED, md
        assert code_of(ch, method, body, metadata=bearer(KEY)) == grpc.StatusCode.OK


def test_client_with_the_key_streams(keyed):
    c = Client(keyed.target, api_key=KEY)
    try:
        msgs = list(c.stream("Hello", max_new_tokens=3, temperature=0.0, ignore_eos=True, timeout=30))
        assert sum(len(m.token_ids) for m in msgs) == 3
    finally:
        c.close()
    c = Client(keyed.target)
    with pytest.raises(grpc.RpcError) as e:
        list(c.stream("Hello", max_new_tokens=3, timeout=30))
    c.close()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_need_no_key(keyed):
    with keyed.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)
        assert h.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        replies = list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert "kvgen.v1.Generator" in {s.name for s in replies[0].list_services_response.service}


def test_key_comparison_is_constant_time(monkeypatch):
    """Every check goes through hmac.compare_digest (no early exit at the first differing byte)."""
    from kvgen.service import auth as auth_module

    seen = []
    real = auth_module.hmac.compare_digest
    monkeypatch.setattr(auth_module.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    auth = AuthInterceptor(KEY)
    assert auth.allows(bearer(KEY)) and not auth.allows(bearer("é" + KEY)) and not auth.allows(bearer("x"))
    assert seen == [(f"Bearer {k}".encode(), f"Bearer {KEY}".encode()) for k in (KEY, "é" + KEY, "x")]
