"""Decode tokens/s with tracing off and on, one engine, one run: `python bench/tracing.py`.

On means everything a traced request pays: the caller's span (sampling ratio 1.0), the KV
wrapper on its cache, its phase spans and KV events, and a BatchSpanProcessor exporting them to
a console exporter writing to /dev/null (--exporter otlp: to an OTLP/gRPC receiver in this
process, on loopback). Off means no hooks at all, as a server without OTEL_TRACES_EXPORTER runs.
Rounds alternate off / on so a busy machine's drift hits both; medians are reported, as a
markdown row for bench/results, with what tracing itself spent (its hooks, timed where they run,
the exporter's CPU time and the KV wrapper's cost per step) as a share of the traced rounds'
wall time: on a shared machine that share is the steadier measure of the overhead.
bench/cpu.py can call `measure(gen)` on the engine it already has.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased  # noqa: E402

from kvgen.engine.generator import EngineOptions, Generator  # noqa: E402
from kvgen.engine.kv.manager import KVManager  # noqa: E402
from kvgen.engine.kv.record import KVInfo, KVRecorder  # noqa: E402
from kvgen.engine.kv.tiers import TieredKV  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402
from kvgen.service.tracing import Tracing  # noqa: E402


def otlp_receiver():
    """An OTLP/gRPC trace receiver on loopback that counts spans; returns (server, endpoint, count)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got = [0]

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, req, context):
            got[0] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}", got


class TimedExporter:
    """Wraps a span exporter and adds up the CPU time its export() takes (the batch processor's
    thread: GIL time taken from the engine, at worst)."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = 0.0

    def export(self, spans):
        t = time.thread_time()
        try:
            return self.inner.export(spans)
        finally:
            self.seconds += time.thread_time() - t

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_tracing(exporter: str):
    provider = TracerProvider(sampler=TraceIdRatioBased(1.0))
    receiver = None
    if exporter == "console":
        devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the run
        timed = TimedExporter(ConsoleSpanExporter(out=devnull))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        receiver = otlp_receiver()
        timed = TimedExporter(OTLPSpanExporter(endpoint=receiver[1], insecure=True))
    provider.add_span_processor(BatchSpanProcessor(timed))
    return Tracing(provider), timed, receiver


class Hooks:
    """The engine hooks of one mode, timed where they run (caller's thread, engine thread)."""

    def __init__(self, tracing: Tracing | None):
        self.tracing = tracing
        self.seconds = 0.0

    def install(self, engine) -> None:
        if self.tracing is None:
            engine.on_submit = engine.on_release = engine.on_step = None
            return
        engine.on_submit = self._timed(self.tracing.on_submit)
        engine.on_release = self._timed(self.tracing.on_release)
        engine.on_step = self._timed(self.tracing.on_step)

    def _timed(self, fn):
        def hook(*args):
            t = time.perf_counter()
            fn(*args)
            self.seconds += time.perf_counter() - t

        return hook


def run_round(gen: Generator, hooks: Hooks, streams: int, prompt: list[int], new_tokens: int):
    """`streams` requests together; returns (decode tokens/s, decode steps, wall seconds)."""
    hooks.install(gen.engine)
    tracing = hooks.tracing
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    async def together():
        reqs = []
        for i in range(streams):
            ids = [(t + i) % 1000 + 100 for t in prompt]  # distinct prompts
            if tracing:
                with tracing.tracer.start_as_current_span("bench request"):
                    reqs.append(gen.submit(ids, params))
            else:
                reqs.append(gen.submit(ids, params))
        for r in reqs:
            await r.result()
            await r.released()
        return [r.seq for r in reqs]

    seqs = gen.bridge.run(together())
    t0 = max(s.first_token_at for s in seqs)
    t1 = max(s.finished_at for s in seqs)
    tokens = sum(len(s.output_ids) - 1 for s in seqs)
    return tokens / (t1 - t0), tokens, t1 - min(s.arrival for s in seqs)


def events_cost_per_step(gen: Generator, n: int = 20000) -> float:
    """Seconds KV events add to one traced sequence's decode step (reserve, advance, the step's
    record), against a KV manager nobody listens to. Run while the engine is idle (its pool)."""

    def run(traced: bool) -> float:
        tiers = TieredKV(gen.pool)
        kv = KVManager(gen.pool, tiers, 0)
        table = kv.new_table()
        seq = SimpleNamespace(seq_id=0, prompt_ids=[0], cache=table, keep_kv=False, draft=[])
        recorder = KVRecorder(KVInfo.of(gen.pool.fmt))
        if traced:
            kv.listen(recorder.on_event)
            recorder.attach(seq)
        t = time.perf_counter()
        for i in range(n):
            kv.reserve(table, 1)
            kv.advance(table, 1)
            if traced:
                recorder.on_step([(seq, 1)], 1e-6)
            if i % 256 == 255:
                kv.release(table)
        kv.release(table)
        tiers.close()
        return time.perf_counter() - t

    plain = min(run(False) for _ in range(3))
    return max(0.0, min(run(True) for _ in range(3)) - plain) / n


def measure(gen: Generator, exporter: str = "console", streams: int = 8, new_tokens: int = 32,
            pairs: int = 12) -> dict:
    """Decode tokens/s off and on over `pairs` alternating rounds on gen (its hooks are left
    unset afterwards). Returns the medians, the change, tracing's own time and a markdown row."""
    tracing, timed, receiver = make_tracing(exporter)
    off, on = Hooks(None), Hooks(tracing)
    saved = gen.engine.on_submit, gen.engine.on_release, gen.engine.on_step
    prompt = list(range(16))
    rates = {"off": [], "on": []}
    per_step = events_cost_per_step(gen)
    tracing.bind(gen)
    ratios, on_tokens, on_wall = [], 0, 0.0
    try:
        for hooks in (on, off):  # warm up both paths
            run_round(gen, hooks, streams, prompt, 8)
        on.seconds = timed.seconds = 0.0
        for i in range(pairs):
            pair = {}
            for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                rate, tokens, wall = run_round(gen, on if name == "on" else off, streams, prompt, new_tokens)
                pair[name] = rate
                rates[name].append(rate)
                if name == "on":
                    on_tokens += tokens
                    on_wall += wall
            ratios.append(pair["on"] / pair["off"])
        tracing.provider.force_flush()
    finally:
        gen.engine.on_submit, gen.engine.on_release, gen.engine.on_step = saved
        tracing.provider.shutdown()
        if receiver:
            receiver[0].stop(0)
    r = {"off": statistics.median(rates["off"]), "on": statistics.median(rates["on"]),
         "change_pct": (statistics.median(ratios) - 1) * 100, "rounds": rates,
         # what tracing itself spent during the traced rounds, against their wall time
         "hooks_s": on.seconds, "export_s": timed.seconds, "events_s_per_step": per_step,
         "own_pct": (on.seconds + timed.seconds + per_step * on_tokens) / on_wall * 100}
    where = ("console exporter to /dev/null" if exporter == "console"
             else f"OTLP/gRPC to a loopback receiver ({receiver[2][0]} spans received)")
    r["row"] = (f"| {streams} streams x {new_tokens} tokens, sampling 1.0, {where} | {r['off']:.1f} | "
                f"{r['on']:.1f} | {r['change_pct']:+.1f}% | {r['own_pct']:.2f}% |")
    return r


HEADER = ("| decode tok/s (median of rounds) | tracing off | tracing on | change (median of paired rounds) "
          "| tracing's own time / wall |\n|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exporter", choices=("console", "otlp"), default="console")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=12, help="off/on round pairs, order alternating")
    args = ap.parse_args()
    gen = Generator.load(None, EngineOptions(kv_cache_mb=128))
    try:
        r = measure(gen, args.exporter, args.streams, args.new_tokens, args.pairs)
    finally:
        gen.close()
    print(f"off: {' '.join(f'{x:.1f}' for x in r['rounds']['off'])}\n"
          f"on:  {' '.join(f'{x:.1f}' for x in r['rounds']['on'])}\n"
          f"tracing's own time in traced rounds: hooks {r['hooks_s'] * 1e3:.1f} ms, "
          f"export {r['export_s'] * 1e3:.1f} ms, KV events {r['events_s_per_step'] * 1e6:.2f} us per "
          "sequence-step", file=sys.stderr)
    print(HEADER)
    print(r["row"])


if __name__ == "__main__":
    main()
