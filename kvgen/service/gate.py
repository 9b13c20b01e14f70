"""The gate every call passes before its servicer: a body that does not parse (invalid UTF-8 in a
string, corrupt or truncated bytes) is INVALID_ARGUMENT with a BadRequest, on every method, and
a kvgen.v1 request that breaks a limit needing no model (entry count, prompt bytes, id format,
sampling ranges) is refused the same way before any work is done for it.

grpc parses a body with the handler's request_deserializer, outside any servicer code; a parser
that raises there becomes UNKNOWN with a logged traceback. So the gate swaps in a deserializer
that never raises (it hands back a Malformed marker) and a behaviour that turns the marker into
a clean abort."""

from __future__ import annotations

import grpc
from grpc_status import rpc_status

from kvgen.errors import InvalidRequest
from kvgen.service import control, convert, lora_admin, routing
from kvgen.service.errors import clip, to_status
from kvgen.service.settings import Settings

_PREFIX = "/kvgen.v1.Generator/"
# The checks of each kvgen.v1 method's request that need no model; the servicer repeats what it
# needs (they are cheap), the gate makes sure they run before anything else does.
CHECKS = {
    _PREFIX + "Generate": convert.check_request,
    _PREFIX + "GenerateStream": convert.check_request,
    _PREFIX + "BatchGenerate": convert.check_batch,
    _PREFIX + "BatchGenerateStream": convert.check_batch,
    _PREFIX + "CloseSession": lambda req, settings: convert.check_session_id(req.session_id),
    _PREFIX + "CreateSession": routing.check_create_session,
    _PREFIX + "Abort": control.check_abort,
    _PREFIX + "LoadAdapter": lambda req, settings: lora_admin.check_load(req.name, req.path),
    _PREFIX + "UnloadAdapter": lambda req, settings: lora_admin.check_unload(req.name, req.timeout_seconds),
}


class Malformed:
    """What the gate's deserializer returns for bytes that do not parse."""

    __slots__ = ("violation",)

    def __init__(self, violation: tuple[str, str]):
        self.violation = violation


def _never_raising(deserializer, method: str):
    cls = getattr(deserializer, "__self__", None)  # Message.FromString is a classmethod
    name = cls.DESCRIPTOR.full_name if hasattr(cls, "DESCRIPTOR") else method

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as e:  # DecodeError, or anything a parser raises on hostile bytes
            return Malformed(("request", f"the body is not a valid {name}: {clip(e, 200)}"))

    return parse


class GateInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, settings: Settings):
        self.settings = settings

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        check = CHECKS.get(details.method)
        settings = self.settings

        async def admit(request, context) -> None:
            """Abort unless request is a parsed message within the limits."""
            if isinstance(request, Malformed):
                await _refuse(context, InvalidRequest([request.violation]))
            if check is not None:
                try:
                    check(request, settings)
                except InvalidRequest as e:
                    await _refuse(context, e)

        deserializer = _never_raising(handler.request_deserializer, details.method)
        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary

            async def admitted(requests, context):
                async for request in requests:
                    await admit(request, context)
                    yield request

            if handler.response_streaming:
                async def stream_stream(requests, context):
                    async for response in _responses(behavior(admitted(requests, context), context)):
                        yield response

                return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, handler.response_serializer)

            async def stream_unary(requests, context):
                return await behavior(admitted(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, handler.response_serializer)

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                await admit(request, context)
                async for response in _responses(behavior(request, context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, handler.response_serializer)

        behavior = handler.unary_unary

        async def unary_unary(request, context):
            await admit(request, context)
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)


async def _responses(out):
    """A streaming behaviour's responses, whether it yields them or writes them through
    context.write and returns (grpc's health Watch does)."""
    if hasattr(out, "__aiter__"):
        async for response in out:
            yield response
    else:
        await out


async def _refuse(context, e: InvalidRequest) -> None:
    await context.abort_with_status(rpc_status.to_status(to_status(e)))
