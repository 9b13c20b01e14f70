"""Start-up next to llama-server (issue #41): seconds from starting the server to its first
200 on GET /health (kvgen: SERVING, the engine loaded and warmed; llama-server: the model
loaded), and to the first reply of a short completion after that, on the same GGUF files.

kvgen runs as `make serve` does (`python -m kvgen.service.server`, MODEL=<file>, defaults),
  - warm: its kernel cache and tile cache filled (the Numba disk cache and WEIGHT_CACHE_DIR under
    ~/.cache/kvgen, filled by an untimed start first): a restart of a server;
  - new file: the kernel cache warm, WEIGHT_CACHE_DIR an empty folder, so the file's blocks are
    converted to tiles (and saved, from a thread): the first start of a model file;
  - cold: NUMBA_CACHE_DIR and WEIGHT_CACHE_DIR empty folders, so every kernel it uses is compiled, as
    on a fresh machine's first start. The cold minus the new-file start is what compiling costs.
llama-server (bench/setup_llama_server.sh) maps the file and has nothing to compile.

Runs alternate between the servers, each alone on the machine; best and median of the rounds.
Writes bench/results/startup.md (--out; a partial run, --servers or --no-cold, writes nowhere unless
--out says where: its table has "-" for what it did not run).

    .venv/bin/python bench/startup.py [--models PATH,...] [--rounds 3] [--servers kvgen] [--no-cold]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from bench.serving import LLAMA_SERVER, _free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "startup.md"
MODELS = ROOT / "bench" / ".cache" / "models"
DEFAULT_FILES = ("embedded", str(MODELS / "shaped-1.7b.Q4_K_M.gguf"))


def _get(url: str, timeout: float = 2) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def _complete(url: str) -> None:
    """One short greedy completion (4 tokens); raises on a non-200."""
    import json

    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]  # the name the server serves under
    body = json.dumps({"model": model, "prompt": "The lighthouse", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        r.read()


def start(server: str, model: str, cache_dir: str | None = None, tile_dir: str | None = None,
          timeout: float = 900) -> dict:
    """Start `server` on `model`, time its first /health 200 and first reply, stop it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    if server == "kvgen":
        env = {**os.environ, "PORT": str(_free_port()), "HTTP_PORT": str(port), "METRICS_PORT": "0"}
        if model != "embedded":
            env["MODEL"] = model
        if cache_dir:
            env["NUMBA_CACHE_DIR"] = cache_dir
        if tile_dir:
            env["WEIGHT_CACHE_DIR"] = tile_dir
        cmd = [sys.executable, "-m", "kvgen.service.server"]
    else:
        env = None
        path = peers.model_path() if model == "embedded" else model
        cmd = [str(LLAMA_SERVER), "-m", path, "--port", str(port), "--host", "127.0.0.1",
               "-t", str(peers.cores()), "-c", "4096"]
    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while _get(url + "/health") != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                log.seek(0)
                raise RuntimeError(f"{server} on {model}: not serving ({proc.poll()}): {log.read()[-2000:]}")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        _complete(url)
        return {"ready": ready, "first": time.perf_counter() - t0}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _label(model: str) -> str:
    return "embedded Q4_1" if model == "embedded" else Path(model).name


RUNS = ("kvgen warm", "llama-server", "kvgen new file", "kvgen cold")


def measure(models: list[str], rounds: int, runs: tuple = RUNS) -> dict:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "kvgen")], check=True,
                   stdout=subprocess.DEVNULL)  # kvgen's bytecode, as `make serve` writes it
    out = {}
    for model in models:
        size = os.path.getsize(peers.model_path() if model == "embedded" else model)
        res = {"MiB": size / 2**20, **{name: [] for name in RUNS}}
        if "kvgen warm" in runs or "kvgen new file" in runs:
            start("kvgen", model)  # fills the kernel cache and the tile cache (untimed)
        for r in range(rounds):
            for name in runs:
                if name == "llama-server" and not LLAMA_SERVER.exists():
                    continue
                if name == "kvgen cold":
                    if r > 0:  # one cold start per file: it is minutes, and its spread says little
                        continue
                    with tempfile.TemporaryDirectory(prefix="kvgen-cold-numba-") as cold:
                        res[name].append(start("kvgen", model, cold, os.path.join(cold, "tiles")))
                elif name == "kvgen new file":
                    with tempfile.TemporaryDirectory(prefix="kvgen-new-tiles-") as tiles:
                        res[name].append(start("kvgen", model, tile_dir=tiles))
                else:
                    res[name].append(start("llama-server" if name == "llama-server" else "kvgen", model))
                print(f"{_label(model)} round {r + 1} {name}: {res[name][-1]}", flush=True)
        out[model] = res
    return out


def render(results: dict, rounds: int, seconds: float, load: tuple, flags: str = "") -> str:
    lines = ["# Start-up next to llama-server", "",
             f"{datetime.date.today().isoformat()} · {peers.cpu_name()} · {peers.cores()} cores · "
             f"`bench/startup.py --rounds {rounds}{flags}` ({seconds:.0f} s; load average at the start {load[0]:.2f}, "
             f"at the end {os.getloadavg()[0]:.2f}).", "",
             "Seconds from starting the server to its first 200 on GET /health (kvgen: SERVING, after the "
             "model is loaded and its kernels are ready; llama-server: the model loaded), and to the reply of a "
             "first 4-token completion. kvgen as `make serve` runs it (MODEL=<file>, defaults); warm: its "
             "Numba kernel cache and its tile cache (WEIGHT_CACHE_DIR) filled by an earlier start, a restart "
             "(best and median of the rounds); new file: the tile cache empty, the file's blocks converted, "
             "a model's first start; cold: both caches empty, every kernel compiled, as on a fresh machine's "
             "first start (one run). llama-server built by bench/setup_llama_server.sh from the same llama.cpp "
             "as llama-bench.", "",
             "| file | MiB | llama-server ready s | kvgen warm ready s | warm / llama-server | kvgen new file ready s "
             "| kvgen cold ready s | llama-server first reply s | kvgen warm first reply s "
             "| kvgen cold first reply s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def best(xs, key, digits=2):
        return f"{min(x[key] for x in xs):.{digits}f}" if xs else "-"

    def med(xs, key):
        return f"{best(xs, key)} (median {statistics.median(x[key] for x in xs):.2f})" if xs else "-"

    for model, r in results.items():
        ls, w, n, c = r["llama-server"], r["kvgen warm"], r["kvgen new file"], r["kvgen cold"]
        ratio = f"{float(best(w, 'ready')) / float(best(ls, 'ready')):.2f}x" if w and ls else "-"
        lines.append(f"| {_label(model)} | {r['MiB']:.0f} | {med(ls, 'ready')} | {med(w, 'ready')} | {ratio} "
                     f"| {med(n, 'ready')} | {best(c, 'ready', 1)} | {best(ls, 'first')} | {best(w, 'first')} "
                     f"| {best(c, 'first', 1)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--models", default=",".join(DEFAULT_FILES), help="GGUF paths, or 'embedded'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="kvgen,llama-server", help="which of kvgen, llama-server to start")
    ap.add_argument("--no-cold", action="store_true", help="no cold kvgen start (minutes a file: it compiles)")
    ap.add_argument("--out", type=Path, default=None, help=f"where the table goes (default {RESULTS.relative_to(ROOT)} "
                    "for a whole run, nowhere for a partial one)")
    a = ap.parse_args()
    servers = a.servers.split(",")
    if "llama-server" in servers and not LLAMA_SERVER.exists():
        print(f"llama-server missing ({LLAMA_SERVER}): bash bench/setup_llama_server.sh; kvgen only")
    runs = tuple(n for n in RUNS if n.split()[0] in servers and not (n == "kvgen cold" and a.no_cold))
    models = [m for m in a.models.split(",") if m == "embedded" or Path(m).exists()]
    load, t0 = os.getloadavg(), time.perf_counter()
    results = measure(models, a.rounds, runs)
    flags = "".join(f" {f}" for f, on in ((f"--servers {a.servers}", a.servers != "kvgen,llama-server"),
                                            ("--no-cold", a.no_cold)) if on)
    text = render(results, a.rounds, time.perf_counter() - t0, load, flags)
    out = a.out or (RESULTS if len(runs) == len(RUNS) else None)
    if out:
        out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
