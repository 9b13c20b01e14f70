"""The HTTP server (aiohttp, on the gRPC server's event loop): the OpenAI routes behind the same
API keys, traced and counted like the RPCs, and drained with them.

Middlewares, outermost first: observe (a server span continuing the caller's W3C traceparent,
and the http_server_request_duration_seconds histogram), answer errors (OpenAI's error JSON),
authenticate (`Authorization: Bearer <key>` when API_KEY is set, checked as for gRPC; /health and
/metrics are open, as gRPC's health service and the metrics port are: worker_routes.py).
A client that disconnects cancels its handler (handler_cancellation), and so its generation."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import nullcontext

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Histogram

from kvgen.engine.generator import Generator
from kvgen.service import tracing as tracing_mod
from kvgen.service.auth import DENIED, AuthInterceptor
from kvgen.service.http import errors
from kvgen.service.http.errors import HttpError
from kvgen.service.http.lora_routes import LoraRoutes
from kvgen.service.http.routes import OpenAIRoutes
from kvgen.service.http.tokenize_routes import TokenizerRoutes
from kvgen.service.http.worker_routes import OPEN_PATHS, WorkerRoutes
from kvgen.service.metrics import DURATION_BUCKETS, Metrics
from kvgen.service.settings import Settings
from kvgen.service.tracing import Tracing

log = logging.getLogger("kvgen.http")
CLIENT_CLOSED = 499  # the status recorded for a call whose client went away (nginx's)


class HttpApi:
    def __init__(self, settings: Settings, tracing: Tracing | None = None, metrics: Metrics | None = None,
                 owners: dict[str, str] | None = None):
        """owners: the gRPC servicer's session owners, so that either API reaches the other's
        sessions (without it, HTTP keeps its own: with API keys, a session is then only usable
        through the API that opened it)."""
        self.settings = settings
        self.routes = OpenAIRoutes(settings, owners)
        self.tracing = tracing
        self.auth = AuthInterceptor(settings.api_key) if settings.api_key else None
        self.duration = None
        if metrics is not None:
            self.duration = Histogram("http_server_request_duration", "HTTP requests by route and status",
                                      ["http_request_method", "http_route", "http_response_status_code"],
                                      unit="seconds", buckets=DURATION_BUCKETS, registry=metrics.registry)
        app = web.Application(middlewares=[self._observe, self._answer_errors, self._authenticate],
                              client_max_size=settings.max_receive_bytes)
        self.routes.add_to(app)
        TokenizerRoutes(settings, self.routes.ready).add_to(app)  # what lm-eval's remote tokenizer reads
        LoraRoutes(settings, self.routes.ready).add_to(app)  # vLLM's run-time LoRA loading
        # what a router (smg, the GIE endpoint picker) reads: /health, /metrics, /v1/loads
        self.worker = WorkerRoutes(settings, self.routes, metrics.registry if metrics is not None else None)
        self.worker.add_to(app)
        # shutdown_timeout: in-flight calls may finish within the grace period, as RPCs do
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=settings.grace_s,
                                    access_log=None)
        self.port: int | None = None

    def bind(self, gen: Generator, load=None) -> None:
        """Serve gen (until then every call is 503: the model is loading); load: the server's
        service/server_load.Load, for the rates /v1/loads reports."""
        self.routes.gen = gen
        self.worker.load = load

    @property
    def serving(self) -> bool:
        """The server's readiness, which GET /health reports (set with the gRPC health status)."""
        return self.worker.serving

    @serving.setter
    def serving(self, value: bool) -> None:
        self.worker.serving = value

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.settings.host, self.settings.http_port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        log.info("OpenAI-compatible HTTP on port %d", self.port)

    def refuse(self) -> None:
        """New calls get 503 from now on; in-flight ones go on."""
        self.routes.draining = True

    async def stop(self) -> None:
        """Refuse new calls (503), stop listening, let in-flight ones finish within GRACE_S."""
        self.refuse()
        await self.runner.cleanup()

    @web.middleware
    async def _observe(self, request: web.Request, handler):
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        started = time.perf_counter()
        status = 500
        span_cm = nullcontext(None)
        if self.tracing:
            span_cm = self.tracing.tracer.start_as_current_span(
                f"{request.method} {route}", context=propagate.extract(request.headers), kind=SpanKind.SERVER,
                attributes={"http.request.method": request.method, "http.route": route, "url.path": request.path})
        with span_cm as span:
            try:
                response = await handler(request)
                status = response.status
                return response
            except asyncio.CancelledError:
                status = CLIENT_CLOSED
                if span is not None:
                    tracing_mod.record_error(span, asyncio.CancelledError())
                raise
            finally:
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500 and status != CLIENT_CLOSED:
                        span.set_status(Status(StatusCode.ERROR, str(status)))
                if self.duration is not None:
                    self.duration.labels(request.method, route, str(status)).observe(time.perf_counter() - started)

    @web.middleware
    async def _answer_errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own: no route (404), wrong method (405), too big (413)
            if e.status < 400:
                raise
            e = HttpError(e.status, e.reason)
            error = e
        except Exception as e:
            error = e
            if not isinstance(e, HttpError):
                span = trace.get_current_span()
                if span.is_recording():
                    tracing_mod.record_error(span, e)
                if errors.answer(e)[0] >= 500:
                    log.exception("%s %s failed", request.method, request.path)
        status, body, headers = errors.answer(error)
        return web.json_response(body, status=status, headers=headers)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        if self.auth is not None and request.path not in OPEN_PATHS:
            given = [("authorization", v) for v in request.headers.getall("Authorization", [])]
            if not self.auth.allows(given):
                raise HttpError(401, DENIED, code="invalid_api_key")
        return await handler(request)
