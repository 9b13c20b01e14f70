"""What a router needs of an HTTP worker, on the HTTP port: GET /health, GET /metrics and
GET /v1/loads. smg (`smg launch --worker-urls http://replica:HTTP_PORT`) registers a worker once its
/health answers 200 and /v1/models lists a model, probes /health every --health-check-interval-secs,
and polls /v1/loads (its own load schema; an engine it does not know by /v1/models' `owned_by`
has no other load source) for the load-aware policies. The Gateway API Inference Extension's
endpoint picker scrapes /metrics (the vLLM-named gauges of service/metrics.py).

/health is readiness, as the gRPC health service's "" is: 200 only while the engine serves;
503 while the model loads, from the moment a drain begins (the DRAIN_DELAY_S during which calls
are still served, so that routers stop sending first), and while the engine thread makes no
progress on pending work for LIVENESS_STALL_S. /health and /metrics need no API key (as gRPC's
health service and the metrics port need none: probes and scrapers carry none); /v1/loads does."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgen.service.http.routes import OpenAIRoutes
from kvgen.service.settings import Settings

OPEN_PATHS = ("/health", "/metrics")  # the paths the API key does not guard


class WorkerRoutes:
    def __init__(self, settings: Settings, routes: OpenAIRoutes, registry=None):
        """registry: the Prometheus registry the metrics port serves (None: no /metrics)."""
        self.settings = settings
        self.routes = routes  # the served engine (routes.gen) and whether the API drains
        self.registry = registry
        self.serving = False  # the server's readiness (Server._set_health): False again once a drain begins
        self.load = None  # service/server_load.Load, once the model is loaded: tokens/s

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        if self.registry is not None:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/loads", self.loads)

    def state(self) -> str:
        """"serving", or why not: "loading", "draining", "stalled"."""
        gen = self.routes.gen
        if gen is None:
            return "loading"
        if self.routes.draining or not self.serving:
            return "draining"
        if gen.engine.stalled_s() > self.settings.liveness_stall_s:
            return "stalled"
        return "serving"

    async def health(self, request: web.Request) -> web.Response:
        state = self.state()
        return web.json_response({"status": state}, status=200 if state == "serving" else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def loads(self, request: web.Request) -> web.Response:
        """smg's WorkerLoadResponse: one data-parallel rank, the counts the metrics gauges read."""
        gen = self.routes.ready()
        sched, pool = gen.scheduler, gen.pool
        kv = sched.kv
        prefix = kv.prefix.stats if kv.prefix is not None else None
        looked_up = (prefix.hits + prefix.misses) if prefix is not None else 0
        load = {
            "dp_rank": 0,
            "num_running_reqs": len(sched.running),
            "num_waiting_reqs": len(sched.waiting),
            "num_total_reqs": len(sched.running) + len(sched.waiting),
            "num_used_tokens": kv.used * pool.block_size,
            "max_total_num_tokens": pool.capacity * pool.block_size,
            "token_usage": kv.used / pool.capacity,
            "gen_throughput": self.load.tokens_per_second() if self.load is not None else 0.0,
            "cache_hit_rate": prefix.hits / looked_up if looked_up else 0.0,
            "utilization": self.load.utilization() if self.load is not None else 0.0,
            "max_running_requests": sched.max_running,
        }
        return web.json_response({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "dp_rank_count": 1, "loads": [load]})
