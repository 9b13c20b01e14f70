"""`python -m kvgen.service.server`: serve kvgen.v1.Generator on PORT, metrics on METRICS_PORT, the OpenAI-compatible
HTTP API on HTTP_PORT."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from kvgen.engine.generator import Generator
from kvgen.engine.model_config import UnsupportedModel
from kvgen.service import transport
from kvgen.service.auth import AuthInterceptor
from kvgen.service.gate import GateInterceptor
from kvgen.service.http.app import HttpApi
from kvgen.service.liveness import LIVENESS, Watchdog
from kvgen.service.load_report import LoadReportInterceptor
from kvgen.service.metrics import Metrics
from kvgen.service.server_load import Load
from kvgen.service.servicer import GeneratorServicer
from kvgen.service.settings import Settings
from kvgen.service.tracing import Tracing
from kvgen.service.vllm import servicer as vllm
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger("kvgen.server")
SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name
REFUSE_BEFORE_STOP_S = 0.5  # a drain's refusals before grpc.stop; see Server.drain


def listen(engine, hook: str, fn) -> None:
    """Add fn to one of the engine's hooks (on_step, on_submit, on_release), after what is there.
    A failing listener is logged, never allowed to break the engine or the other listeners."""

    def guarded(*args):
        try:
            fn(*args)
        except Exception:
            log.exception("engine %s listener %s failed", hook, getattr(fn, "__qualname__", fn))

    prev = getattr(engine, hook)
    setattr(engine, hook, guarded if prev is None else lambda *args: (prev(*args), guarded(*args)))


class Server:
    def __init__(self, settings: Settings, gen: Generator | None = None, tracing: Tracing | None = None):
        """tracing: None reads OTEL_* from the environment (usually: off)."""
        self.settings = settings
        creds = transport.credentials(settings)  # first: a half-configured TLS fails before anything starts
        self._gen = gen  # tests hand in a ready engine
        self.tracing = tracing if tracing is not None else Tracing.from_env()
        self.metrics = Metrics() if settings.metrics_port else None
        self.metrics_server = None
        interceptors = []
        if self.tracing:  # outermost: the server span covers everything, refusals included
            interceptors.append(self.tracing.interceptor())
        if self.metrics:
            interceptors.append(self.metrics.interceptor())
        self.load_report = LoadReportInterceptor(settings.replica_id)  # trailers: replica, ORCA load
        interceptors.append(self.load_report)
        if settings.api_key:  # before the gate: a caller without the key gets nothing parsed
            interceptors.append(AuthInterceptor(settings.api_key))
        interceptors.append(GateInterceptor(settings))  # innermost: it wraps the real deserializers
        self.grpc = grpc.aio.server(interceptors=interceptors, options=transport.server_options(settings))
        self.servicer = GeneratorServicer()
        self.servicer.tracing = self.tracing
        self.servicer.settings = settings  # limits for convert.prompt_of / check_request / check_batch
        pb_grpc.add_GeneratorServicer_to_server(self.servicer, self.grpc)
        # vLLM's worker service (smg's grpc:// workers) beside it, through the same interceptors
        self.vllm = vllm.VllmEngineServicer(self.servicer)
        vllm.vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm, self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE, vllm.SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                           self.grpc)
        address = f"{settings.host}:{settings.port}"
        self.port = self.grpc.add_secure_port(address, creds) if creds else self.grpc.add_insecure_port(address)
        self.tls = creds is not None
        # the OpenAI-compatible API on its own port, over the same engine, keys, metrics and traces
        self.http = (HttpApi(settings, self.tracing, self.metrics, owners=self.servicer.owners)
                     if settings.http_port else None)  # one table of session owners for both APIs
        self.replica = self.load_report.replica = settings.replica_id or f"{socket.gethostname()}:{self.port}"
        self._watchdog: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    async def _set_health(self, status) -> None:
        """Readiness: "" and the service's name. Liveness (LIVENESS) is the watchdog's."""
        for name in ("", SERVICE):
            await self.health.set(name, status)
        if self.http:  # and the HTTP API's GET /health (http/worker_routes.py)
            self.http.serving = status == health_pb2.HealthCheckResponse.SERVING

    async def start(self) -> None:
        await self.grpc.start()
        if self.http:
            await self.http.start()  # 503 until the model is loaded, as gRPC is UNAVAILABLE
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)  # loading is alive
        log.info("listening on port %d; loading the model", self.port)
        gen = self._gen or await asyncio.to_thread(Generator.load, self.settings.model or None, self.settings.engine)
        load = Load(gen, self.replica)
        listen(gen.engine, "on_step", load.on_step)
        listen(gen.engine, "on_release", load.on_release)
        self.servicer.load = self.load_report.load = load
        self.servicer.gen = gen
        self.vllm.bind(gen)
        if self.http:
            self.http.bind(gen, load)
        if self.metrics:
            self.metrics.bind(gen)
            self.metrics.bind_load(load)
            listen(gen.engine, "on_step", self.metrics.sync)
            listen(gen.engine, "on_release", self.metrics.observe)
            self.metrics_server = self.metrics.serve(self.settings.metrics_port, self.settings.host)
        if self.tracing:
            self.tracing.bind(gen)
            listen(gen.engine, "on_submit", self.tracing.on_submit)
            listen(gen.engine, "on_step", self.tracing.on_step)
            listen(gen.engine, "on_release", self.tracing.on_release)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap_sessions())
        watchdog = Watchdog(self.health, gen.engine.stalled_s, self.settings.liveness_stall_s)
        self._watchdog = asyncio.create_task(watchdog.run())
        log.info("serving %s on port %d (%s; metrics on %s, tracing %s)", gen.cfg.name, self.port,
                 "TLS" if self.tls else "plaintext", self.settings.metrics_port, "on" if self.tracing else "off")

    async def _reap_sessions(self) -> None:
        while True:
            await asyncio.sleep(5)
            self.servicer.expire_sessions()

    async def drain(self) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        log.info("draining (grace %.1fs)", self.settings.grace_s)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Calls are still served until the proxy's health check has seen NOT_SERVING and sends
        # nothing more: refused meanwhile, a call routed by a session's hash would be retried on
        # this same replica; arriving as grpc.stop begins, it would be CANCELLED.
        await asyncio.sleep(self.settings.drain_delay_s)
        self.servicer.draining = True
        if self.http:
            self.http.refuse()
        # A call that reaches the servicer now is refused UNAVAILABLE, which clients and proxies retry
        # elsewhere; one that lands as grpc.stop begins is CANCELLED instead, which they do not. So the
        # servicer alone refuses for a moment first, taken out of the grace period.
        refusing = min(REFUSE_BEFORE_STOP_S, self.settings.grace_s / 4)
        await asyncio.sleep(refusing)
        grace = self.settings.grace_s - refusing
        # both APIs drain at once, within the one grace period
        await asyncio.gather(self.grpc.stop(grace), *([self.http.stop()] if self.http else []))
        if getattr(self, "_reaper", None):
            self._reaper.cancel()
        if self._watchdog:  # liveness stays SERVING through the drain; the watchdog ends with it
            self._watchdog.cancel()
        if self.servicer.gen:
            await asyncio.to_thread(self.servicer.gen.close)
        if self.metrics_server:
            self.metrics_server[0].shutdown()
        if self.tracing:
            await asyncio.to_thread(self.tracing.shutdown)  # exports what is still buffered
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(settings: Settings) -> int:
    """The process's exit status: 0 after a drain, 2 when the model is one kvgen does not run."""
    server = Server(settings)
    if server.tracing:  # the process's tracer provider too, for anything else instrumented in it
        trace.set_tracer_provider(server.tracing.provider)
    loop = asyncio.get_running_loop()
    draining = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: draining or draining.append(asyncio.ensure_future(server.drain())))
    try:
        await server.start()
    except UnsupportedModel as e:
        # a file the user chose that kvgen cannot run: one line saying so, not a traceback; the
        # listening ports close here, inside the loop (grpc's own shutdown would run after it closed)
        log.error("not starting: %s", e)
        await server.grpc.stop(0)
        if server.http:
            await server.http.stop()
        return 2
    await server.wait()
    return 0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(serve(Settings.from_env())))


if __name__ == "__main__":
    main()
