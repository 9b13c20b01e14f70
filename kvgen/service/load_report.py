"""Every kvgen.v1 call that succeeds ends with two trailers: `x-kvgen-replica`, which server
answered (behind a mesh a client cannot otherwise tell), and `endpoint-load-metrics`, this
server's load as an ORCA report, from which Envoy's client-side weighted round robin weighs the
replicas (once the server has finished a request in the last seconds). Trailers, not headers: a
call refused before its first message must stay a trailers-only response, which is what lets a
proxy retry it on another replica.
"""

from __future__ import annotations

import grpc

from kvgen.service.server_load import Load

REPLICA_TRAILER = "x-kvgen-replica"
ORCA_TRAILER = "endpoint-load-metrics"
_PREFIX = "/kvgen.v1.Generator/"


class LoadReportInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, replica: str, load: Load | None = None):
        """load: None until the model is loaded (then the replica trailer goes alone)."""
        self.replica = replica
        self.load = load

    def _trailers(self) -> tuple[tuple[str, str], ...]:
        out = [(REPLICA_TRAILER, self.replica)]
        orca = self.load.orca_text() if self.load is not None else ""
        if orca:
            out.append((ORCA_TRAILER, orca))
        return tuple(out)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_PREFIX) or handler.request_streaming:
            return handler  # health, reflection, and (none yet) client-streaming methods go as they are
        trailers = self._trailers
        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                async for response in behavior(request, context):
                    yield response
                context.set_trailing_metadata(trailers())

            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        behavior = handler.unary_unary

        async def unary_unary(request, context):
            response = await behavior(request, context)
            context.set_trailing_metadata(trailers())
            return response

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                   handler.response_serializer)
