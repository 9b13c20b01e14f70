"""`make bench-soak`: requests/s held over a long run at a fixed concurrency, with cancellations.

Starts `make serve` (the embedded model, default settings) as a subprocess, then CONCURRENCY
client threads stream chat requests back to back for --duration seconds; a share of them
(--cancel-rate) cancel after a few tokens, as impatient clients do. Per --window seconds it
records requests finished per second, p50/p99 time to first token (as the client sees it), the
server process's RSS and the KV blocks used (from /metrics). A server that leaks shows here as a
rising RSS or block line, one that degrades as falling requests/s or rising TTFT.

Writes OUT_DIR/soak.md (a table, labelled with the duration it ran) and OUT_DIR/soak.png.
    .venv/bin/python bench/soak.py --duration 600            # the 10-minute figures
    .venv/bin/python bench/soak.py --duration 60 --out-dir /tmp/soak   # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from kvgen.client import request, wait_serving  # noqa: E402
from kvgen.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "Give me three names for a cat.", "How do I boil an egg?", "What is 12 times 7?",
             "Summarize the plot of Hamlet in two sentences.", "Why is the sky blue?"]


@dataclass
class Done:
    start: float
    end: float
    ttft: float | None  # None: no token arrived
    tokens: int
    cancelled: bool
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_pid(root: int) -> int:
    """The python process under `make serve` (make may run it through a shell)."""
    for _ in range(100):
        todo = [root]
        while todo:
            pid = todo.pop()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            if b"kvgen.service.server" in cmd:
                return pid
            todo += [int(k) for k in kids]
        time.sleep(0.1)
    raise RuntimeError("no kvgen.service.server process under make serve")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(page) for s in fam.samples if not s.labels}




def client(target: str, seed: int, until: float, args, out: list[Done], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        while time.monotonic() < until:
            cancel_after = rng.randint(1, 8) if rng.random() < args.cancel_rate else 0
            req = request([{"role": "user", "content": rng.choice(QUESTIONS)}], temperature=0.7,
                          seed=rng.randint(0, 2**31), max_new_tokens=args.max_new_tokens)
            t0 = time.monotonic()
            ttft, tokens, msgs, error = None, 0, 0, ""
            call = stub.GenerateStream(req, timeout=args.call_timeout)
            try:
                for m in call:
                    if ttft is None and m.token_ids:
                        ttft = time.monotonic() - t0
                    tokens += len(m.token_ids)
                    msgs += 1
                    if cancel_after and msgs >= cancel_after:
                        call.cancel()
                        break
            except grpc.RpcError as e:
                error = e.code().name
            with lock:
                out.append(Done(t0, time.monotonic(), ttft, tokens, bool(cancel_after), error))


def monitor(pid: int, metrics_port: int, until: float, every: float, samples: list) -> None:
    """(t, RSS MiB, KV blocks used, running, waiting) every `every` seconds."""
    while time.monotonic() < until:
        try:
            m = scrape(metrics_port)
            samples.append((time.monotonic(), rss_mib(pid), m["kvgen_kv_blocks_used"],
                            m["kvgen_requests_running"], m["kvgen_requests_waiting"]))
        except (OSError, KeyError):
            pass
        time.sleep(every)  # a sampling period


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]


def windows(done: list[Done], samples: list, t0: float, duration: float, width: float) -> list[dict]:
    rows = []
    for i in range(math.ceil(duration / width)):
        lo, hi = t0 + i * width, min(t0 + (i + 1) * width, t0 + duration)
        fin = [d for d in done if lo <= d.end < hi]
        ttfts = [d.ttft for d in done if d.ttft is not None and lo <= d.start + d.ttft < hi]
        inside = [s for s in samples if lo <= s[0] < hi]
        rows.append({"t": hi - t0, "rps": len(fin) / (hi - lo), "tps": sum(d.tokens for d in fin) / (hi - lo),
                     "cancelled": sum(d.cancelled for d in fin), "errors": sum(bool(d.error) for d in fin),
                     "p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99),
                     "rss": inside[-1][1] if inside else float("nan"),
                     "blocks_mean": sum(s[2] for s in inside) / len(inside) if inside else float("nan"),
                     "blocks_max": max((s[2] for s in inside), default=float("nan"))})
    return rows


def write_table(path: Path, rows: list[dict], done: list[Done], samples: list, args, total: int, idle: dict) -> None:
    ttfts = [d.ttft for d in done if d.ttft is not None]
    errors = sorted({d.error for d in done if d.error})
    rss = [s[1] for s in samples]
    lines = [
        f"# Soak: {args.duration:.0f} s at concurrency {args.concurrency}, {args.cancel_rate:.0%} cancelled",
        "",
        f"`bench/soak.py --duration {args.duration:.0f}` against `make serve` (embedded SmolLM2-135M, default "
        f"settings), {datetime.date.today()}, {peers.cpu_name()} with "
        f"{os.cpu_count()} CPUs. Each client streams a chat question (temperature 0.7, at most "
        f"{args.max_new_tokens} tokens) and sends the next at once; {args.cancel_rate:.0%} cancel after 1-8 "
        "messages. TTFT as the client sees it; RSS of the server process; blocks from /metrics.",
        "",
        f"Load average (1 min) at the start {idle['load'][0]:.2f}, at the end {idle['load'][1]:.2f}: a start "
        "above ~0.5 means something else shared the cores, and torch's threads then slow down far more than "
        "in proportion.",
        "",
        f"- requests finished: {len(done)} ({len(done) / args.duration:.2f}/s), cancelled "
        f"{sum(d.cancelled for d in done)}, errors {sum(bool(d.error) for d in done)} {errors or ''}",
        f"- TTFT p50 {pct(ttfts, 0.5) * 1e3:.0f} ms, p99 {pct(ttfts, 0.99) * 1e3:.0f} ms",
        f"- server RSS {rss[0]:.0f} MiB at the first sample, {rss[-1]:.0f} MiB at the last, max {max(rss):.0f} MiB"
        if rss else "- server RSS: no samples",
        f"- KV blocks: pool of {total}, max used {max((s[2] for s in samples), default=0):.0f}; after the clients "
        f"left: {idle['blocks']:.0f} used, {idle['running']:.0f} running, {idle['waiting']:.0f} waiting",
        "",
        "| until (s) | requests/s | tokens/s | cancelled | errors | TTFT p50 (ms) | TTFT p99 (ms) | RSS (MiB) "
        "| KV blocks mean | KV blocks max |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['t']:.0f} | {r['rps']:.2f} | {r['tps']:.1f} | {r['cancelled']} | {r['errors']} "
                     f"| {r['p50'] * 1e3:.0f} | {r['p99'] * 1e3:.0f} | {r['rss']:.0f} | {r['blocks_mean']:.1f} "
                     f"| {r['blocks_max']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict], samples: list, t0: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    t = [r["t"] for r in rows]
    a.bar(t, [r["rps"] for r in rows], width=-args.window * 0.8, align="edge", color="tab:blue")
    a.set_ylabel("requests/s")
    a.set_title(f"kvgen soak: {args.duration:.0f} s, concurrency {args.concurrency}, "
                f"{args.cancel_rate:.0%} cancelled")
    b.plot(t, [r["p99"] * 1e3 for r in rows], "o-", label="p99")
    b.plot(t, [r["p50"] * 1e3 for r in rows], "o--", label="p50")
    b.set_ylabel(f"TTFT (ms, per {args.window:.0f} s)")
    b.legend()
    st = [s[0] - t0 for s in samples]
    c.plot(st, [s[1] for s in samples], color="tab:red")
    c.set_ylabel("server RSS (MiB)", color="tab:red")
    c.set_xlabel("seconds")
    k = c.twinx()
    k.plot(st, [s[2] for s in samples], color="tab:green", alpha=0.6)
    k.set_ylabel("KV blocks used", color="tab:green")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cancel-rate", type=float, default=0.2)
    p.add_argument("--window", type=float, default=30, help="seconds per row of the table")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--call-timeout", type=float, default=300)
    p.add_argument("--sample-s", type=float, default=2, help="RSS and /metrics sampling period")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()

    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PORT": str(port), "METRICS_PORT": str(metrics_port)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.out_dir / "soak-server.log", "w")  # lives as long as the server
    proc = subprocess.Popen(["make", "serve"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    target = f"127.0.0.1:{port}"
    try:
        wait_serving(target, timeout=300, alive=lambda: proc.poll() is None)
        pid = server_pid(proc.pid)
        with grpc.insecure_channel(target) as ch:  # warm-up: first steps pay for lazy init
            list(pb_grpc.GeneratorStub(ch).GenerateStream(request("Hello", max_new_tokens=8), timeout=120))
        total = scrape(metrics_port)["kvgen_kv_blocks_total"]
        done: list[Done] = []
        samples: list = []
        lock = threading.Lock()
        load_start = os.getloadavg()[0]
        t0 = time.monotonic()
        until = t0 + args.duration
        threads = [threading.Thread(target=client, args=(target, i, until, args, done, lock), daemon=True)
                   for i in range(args.concurrency)]
        threads.append(threading.Thread(target=monitor, args=(pid, metrics_port, until, args.sample_s, samples),
                                        daemon=True))
        for th in threads:
            th.start()
        for th in threads:
            th.join(args.duration + args.call_timeout + 30)
        time.sleep(1)  # the last cancellations reach the engine; then the idle state is read
        m = scrape(metrics_port)
        idle = {"blocks": m["kvgen_kv_blocks_used"], "running": m["kvgen_requests_running"],
                "waiting": m["kvgen_requests_waiting"], "load": (load_start, os.getloadavg()[0])}
        done = [d for d in done if d.end <= until]  # the window rows count what ended inside the run
        rows = windows(done, samples, t0, args.duration, args.window)
        write_table(args.out_dir / "soak.md", rows, done, samples, args, int(total), idle)
        plot(args.out_dir / "soak.png", rows, samples, t0, args)
        print((args.out_dir / "soak.md").read_text())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


if __name__ == "__main__":
    main()
