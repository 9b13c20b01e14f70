"""API-key authentication: with API_KEY set, every call but health and reflection (probes, tools)
needs `authorization: Bearer <key>` metadata. A refused call is answered before its body is
parsed, so garbage from a caller without the key gets UNAUTHENTICATED, never a parse error."""

from __future__ import annotations

import hashlib
import hmac

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
DENIED = "missing or wrong authorization bearer token"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, key: str):
        """key: one API key, or several separated by commas (one per tenant: sessions are
        owned and counted per key)."""
        self.expected = [f"Bearer {k.strip()}".encode() for k in key.split(",") if k.strip()]

    def allows(self, metadata) -> bool:
        given = [v for k, v in metadata or () if k == "authorization"]
        if len(given) != 1:
            return False
        value = given[0] if isinstance(given[0], bytes) else given[0].encode("utf-8", "surrogateescape")
        ok = False
        for expected in self.expected:  # every key compared, in constant time: no key or prefix by timing
            ok |= hmac.compare_digest(value, expected)
        return ok

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS) or self.allows(details.invocation_metadata):
            return handler
        return _deny(handler)


def _deny(handler):
    """A handler of the same shape that refuses at once; no deserializer: the body stays bytes."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
        yield  # pragma: no cover  (makes this an async generator, as a streaming handler must be)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


def caller_key(context) -> str:
    """Who is calling, for session ownership and limits: the bearer token the auth interceptor
    let through ("" without API keys), as a digest so no key is kept in memory."""
    if context is None:
        return ""
    for k, v in context.invocation_metadata() or ():
        if k == "authorization" and v.startswith("Bearer "):
            return hashlib.sha256(v[7:].encode()).hexdigest()
    return ""
