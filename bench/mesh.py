"""Two replicas behind Envoy against one replica direct, under the same session traffic from
locust's gRPC user; Envoy's own latency per call; and whether Envoy's client-side weighted round
robin, fed by the ORCA load report in every kvgen response, steers calls away from a busy replica.
Writes bench/results/mesh.md (its first section; bench/mesh_chat.py's stays).

    make bench-mesh                       # the embedded model, 30 s per setup
    .venv/bin/python bench/mesh.py --duration 10 --model tiny.gguf

Both setups get the machine's cores: one replica with THREADS=cores, or N replicas with
THREADS=cores/N; the load generator runs on the same machine (its CPU is in the numbers).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from deploy.mesh import Envoy, Mesh, Replica  # noqa: E402
from kvgen.client import replica, request  # noqa: E402
from kvgen.v1 import generate_pb2 as pb  # noqa: E402
from kvgen.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

LOCUSTFILE = ROOT / "bench" / "mesh_locustfile.py"
TURNS_PER_SESSION, MAX_NEW_TOKENS = 4, 32  # the chat each locust user runs (passed to the locustfile)


def drive(target: str, users: int, duration: float, out: Path) -> dict:
    """locust, headless, in its own process (it runs on gevent): `users` chat users against target
    for `duration` seconds; the numbers from its CSV stats."""
    locust = Path(sys.executable).with_name("locust")
    cmd = [str(locust), "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", str(users),
           "-t", f"{int(duration)}s", "-H", target, "--csv", str(out), "--only-summary", "--loglevel", "WARNING"]
    env = {**os.environ, "MESH_TURNS": str(TURNS_PER_SESSION), "MESH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120, cwd=ROOT, env=env)
    if p.returncode not in (0, 1):  # 1: some requests failed, which the table shows
        raise RuntimeError(f"locust failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = {r["Name"]: r for r in csv.DictReader(open(f"{out}_stats.csv"))}
    none = {"Request Count": "0", "Failure Count": "0", "Average Content Size": "0", "50%": "nan", "99%": "nan"}
    turn, ttft = rows.get("turn", none), rows.get("TTFT", none)  # a warm-up may finish no turn
    n = int(turn["Request Count"])
    return {"turns/s": n / duration, "tokens/s": n * float(turn["Average Content Size"]) / duration,
            "ttft p50 ms": float(ttft["50%"]), "ttft p99 ms": float(ttft["99%"]), "turn p50 ms": float(turn["50%"]),
            "turn p99 ms": float(turn["99%"]), "turns": n, "failures": int(turn["Failure Count"])}


def envoy_overhead(direct: str, via: str, calls: int = 400) -> dict:
    """Median and p99 of GetModelInfo (no model work), straight to a replica and through Envoy."""
    out = {}
    for name, target in (("direct", direct), ("envoy", via)):
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.GeneratorStub(ch)
            for _ in range(50):  # warm the connections
                stub.GetModelInfo(pb.GetModelInfoRequest())
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                stub.GetModelInfo(pb.GetModelInfoRequest())
                times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        out[name] = (statistics.median(times), times[int(0.99 * len(times))])
    return out


def orca_steering(mesh: Mesh, calls: int = 200) -> dict[str, Counter]:
    """Make r0 busy behind Envoy's back (long streams sent to it directly), then count where
    stateless calls land: through least request (Envoy sees none of r0's load) and through client
    side weighted round robin (x-kvgen-balance: orca; weights from the ORCA trailers)."""
    busy = mesh.replica("r0").target
    stop = threading.Event()

    def hog() -> None:
        with grpc.insecure_channel(busy) as ch:
            stub = pb_grpc.GeneratorStub(ch)
            while not stop.is_set():
                call = stub.GenerateStream(request("keep busy", max_new_tokens=200, ignore_eos=True), timeout=120)
                for _ in call:
                    if stop.is_set():
                        call.cancel()
                        break

    hogs = [threading.Thread(target=hog) for _ in range(8)]
    for t in hogs:
        t.start()
    time.sleep(3)
    out = {}
    with grpc.insecure_channel(mesh.target) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        for route, md in (("least request", ()), ("weighted (ORCA)", (("x-kvgen-balance", "orca"),))):
            seen = Counter()
            deadline = time.monotonic() + 4  # the weighted balancer's blackout and first weights
            while time.monotonic() < deadline:
                stub.Generate(request("hi", max_new_tokens=2), metadata=md, timeout=30)
            for _ in range(calls):
                _, call = stub.Generate.with_call(request("hi", max_new_tokens=2), metadata=md, timeout=30)
                seen[replica(call)] += 1
            out[route] = seen
    stop.set()
    for t in hogs:
        t.join(30)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=30, help="seconds of traffic per setup")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--model", default="", help="MODEL for the replicas (default: the embedded one)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mesh.md"))
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="kvgen-bench-mesh-"))

    # One replica with every core, and with as many as each of the two replicas gets: torch's
    # threads can cost more than they give on a small, shared machine.
    direct = {}
    for threads in dict.fromkeys((cores, max(1, cores // 2))):
        single = Replica(f"solo-{threads}", a.model, work, THREADS=str(threads))
        single.start(timeout=300)
        try:
            drive(single.target, a.users, min(5, a.duration), work / f"warm-{threads}")
            direct[threads] = drive(single.target, a.users, a.duration, work / f"direct-{threads}")
            if threads == cores:  # the same replica through an Envoy of its own: Envoy's cost alone
                alone = Envoy([single.target], work / "solo-envoy")
                alone.start()
                alone.wait_hosts({single.target: "healthy"})
                overhead = envoy_overhead(single.target, alone.target)
                alone.stop()
        finally:
            single.stop()

    mesh = Mesh(2, a.model, work / "mesh", THREADS=str(max(1, cores // 2)))
    mesh.start()
    try:
        drive(mesh.target, a.users, min(5, a.duration), work / "warm2")
        behind = drive(mesh.target, a.users, a.duration, work / "mesh-load")
        steering = orca_steering(mesh)
    finally:
        mesh.stop()
    a.load_avg = os.getloadavg()[1]  # the machine is shared: say how busy it was (5-minute average)
    write(a, cores, direct, behind, overhead, steering)


def write(a, cores: int, direct: dict[int, dict], behind: dict, overhead: dict, steering: dict) -> None:
    keys = ["turns/s", "tokens/s", "ttft p50 ms", "ttft p99 ms", "turn p50 ms", "turn p99 ms", "turns", "failures"]
    cols = [*direct.values(), behind]
    rows = "\n".join(f"| {k} | " + " | ".join(f"{c[k]:.4g}" for c in cols) + " |" for k in keys)
    head = " | ".join(f"1 replica direct, THREADS={t}" for t in direct)
    steer = "\n".join(f"| {route} | {seen.get('r0', 0)} | {seen.get('r1', 0)} |" for route, seen in steering.items())
    text = f"""# Mesh: 2 replicas behind Envoy vs 1 replica direct

{datetime.date.today()}, {peers.cpu_name()}, {cores} cores; model: {a.model or 'embedded SmolLM2-135M'};
`bench/mesh.py --duration {a.duration:g} --users {a.users}`. Load: locust gRPC users
(bench/mesh_locustfile.py), each a chat session (client-chosen id in `x-session-id`,
{TURNS_PER_SESSION} streamed turns of {MAX_NEW_TOKENS} tokens, then closed), {a.users} users, 50 ms
between turns. The load generator and Envoy share the machine's cores with the replicas (5-minute load
average at the end: {a.load_avg:.1f}).

| | {head} | 2 replicas behind Envoy, THREADS={max(1, cores // 2)} each |
| --- |{" --- |" * len(cols)}
{rows}

Envoy's own cost per call (GetModelInfo, no model work; one replica, direct vs through Envoy):
median {overhead['direct'][0]:.3f} ms direct, {overhead['envoy'][0]:.3f} ms through Envoy
(+{overhead['envoy'][0] - overhead['direct'][0]:.3f} ms); p99 {overhead['direct'][1]:.3f} vs
{overhead['envoy'][1]:.3f} ms.

Where 200 stateless calls land while r0 runs 8 long streams sent to it directly (Envoy does not
see them; r0's ORCA reports do):

| route | r0 (busy) | r1 |
| --- | --- | --- |
{steer}
"""
    out = Path(a.out)
    # the sections other scripts append (bench/mesh_chat.py's "## ..."): kept as they are
    old = out.read_text() if out.exists() else ""
    rest = old[old.find("\n## ") + 1:] if "\n## " in old else ""
    out.write_text(text + ("\n" + rest if rest else ""))
    print(text)


if __name__ == "__main__":
    main()
