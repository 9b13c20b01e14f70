"""How busy this server is, in one place: what GetLoad answers, what each response's ORCA load
report (`endpoint-load-metrics`) carries, and the rate gauges Prometheus shows.

The counts (running, waiting, KV blocks, sessions, prefix cache) are read where the Prometheus
gauges read them, at the moment they are asked for, so the two always agree. The rates are
counted on the engine thread (a step's sampled tokens, a request's release) into a window of
the last WINDOW_S seconds, behind a lock that no step waits on for more than an append.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from kvgen.v1 import generate_pb2 as pb

WINDOW_S = 10.0  # tokens/s and requests/s are averaged over this much of the recent past
# A router divides by utilization (Envoy's client-side weighted round robin: qps / utilization):
# an idle replica must not report 0, which reads as "no weight yet" rather than "very light".
MIN_UTILIZATION = 0.01


class Load:
    def __init__(self, gen, replica: str, window_s: float = WINDOW_S):
        self.gen = gen
        self.replica = replica
        self.window_s = window_s
        self._lock = threading.Lock()
        self._tokens: deque[tuple[float, int]] = deque()  # (when, tokens sampled in a step)
        self._finished: deque[float] = deque()  # when each request was released
        self._started = time.monotonic()

    # the engine thread (Engine.on_step / on_release listeners)

    def on_step(self, batch, _seconds: float = 0.0) -> None:
        """A step samples one token for every sequence whose prompt is all computed."""
        sampled = sum(1 for seq, _ in batch if seq.pending == 0)
        if sampled:
            with self._lock:
                self._tokens.append((time.monotonic(), sampled))

    def on_release(self, _seq) -> None:
        with self._lock:
            self._finished.append(time.monotonic())

    # readers, any thread

    def _span(self, now: float) -> float:
        """The window, or the time since start when that is shorter (a fresh server's rate)."""
        return max(min(self.window_s, now - self._started), 1e-3)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            _trim(self._tokens, now - self.window_s, key=lambda e: e[0])
            total = sum(n for _, n in self._tokens)
        return total / self._span(now)

    def requests_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            _trim(self._finished, now - self.window_s, key=lambda t: t)
            total = len(self._finished)
        return total / self._span(now)

    def utilization(self) -> float:
        """The busier of the KV pool and the running batch (queued requests count as running: they
        will be), in [MIN_UTILIZATION, 1]."""
        sched = self.gen.scheduler
        kv = sched.kv.used / self.gen.pool.capacity
        batch = (len(sched.running) + len(sched.waiting)) / sched.max_running
        return min(1.0, max(MIN_UTILIZATION, kv, batch))

    def snapshot(self, accepting: bool = True) -> pb.GetLoadResponse:
        gen = self.gen
        sched, pool = gen.scheduler, gen.pool
        kv = sched.kv
        out = pb.GetLoadResponse(
            replica=self.replica, running_requests=len(sched.running), waiting_requests=len(sched.waiting),
            kv_blocks_used=kv.used, kv_blocks_total=pool.capacity, kv_cache_usage=kv.used / pool.capacity,
            sessions_open=len(gen.sessions), tokens_per_second=self.tokens_per_second(),
            requests_per_second=self.requests_per_second(), window_seconds=self.window_s, accepting=accepting)
        if kv.prefix is not None:
            s = kv.prefix.stats
            out.prefix_cache.CopyFrom(pb.PrefixCacheStats(
                hits=s.hits, misses=s.misses, hit_tokens=s.hit_tokens, evictions=s.evictions,
                blocks_in_pool=kv.prefix.blocks_held, blocks_in_tiers=kv.prefix.blocks_tiered))
        return out

    def orca_text(self) -> str:
        """An ORCA load report in the native HTTP ("TEXT") form Envoy parses from an
        `endpoint-load-metrics` header or trailer; "" while no request finished in the window
        (Envoy's weighted round robin refuses a report without queries per second, with an error
        logged each time: without one it gives the replica the mean weight)."""
        rps = self.requests_per_second()
        if rps <= 0:
            return ""
        sched = self.gen.scheduler
        return (f"TEXT application_utilization:{self.utilization():.4f}, "
                f"rps_fractional:{rps:.4f}, "
                f"named_metrics.running:{len(sched.running)}, named_metrics.waiting:{len(sched.waiting)}, "
                f"named_metrics.tokens_per_second:{self.tokens_per_second():.2f}")


def _trim(events: deque, oldest: float, key) -> None:
    while events and key(events[0]) < oldest:
        events.popleft()
