"""Prometheus metrics on METRICS_PORT (/metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class Metrics:
    def __init__(self, gen, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        pool, sched = gen.pool, gen.scheduler
        Gauge("kvgen_kv_blocks_used", "KV blocks allocated", registry=r).set_function(lambda: pool.used)
        Gauge("kvgen_kv_blocks_total", "KV blocks in the pool", registry=r).set_function(lambda: pool.capacity)
        Gauge("kvgen_kv_cache_usage_ratio", "Fraction of KV blocks allocated",
              registry=r).set_function(lambda: pool.used / pool.capacity)
        Gauge("kvgen_requests_running", "Requests in the running batch",
              registry=r).set_function(lambda: len(sched.running))
        Gauge("kvgen_requests_waiting", "Requests waiting for admission",
              registry=r).set_function(lambda: len(sched.waiting))
        Gauge("kvgen_sessions_open", "Open sessions", registry=r).set_function(lambda: len(gen.sessions))
        # A counter only goes up: mirror the scheduler's count after each step.
        preempt = Counter("kvgen_preemptions", "Sequences preempted for lack of KV blocks", registry=r)
        self._preempt = preempt
        self._sched = sched
        self._seen_preemptions = 0

    def sync(self) -> None:
        delta = self._sched.preemptions - self._seen_preemptions
        if delta > 0:
            self._preempt.inc(delta)
            self._seen_preemptions += delta

    def serve(self, port: int, host: str = "0.0.0.0"):
        return start_http_server(port, addr=host, registry=self.registry)
