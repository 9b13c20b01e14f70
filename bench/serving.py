"""Serving next to llama.cpp's own server: kvgen (its OpenAI-compatible HTTP API, `make serve`
with HTTP_PORT) and `llama-server` (built by bench/setup_llama_server.sh from the same
llama.cpp that bench/cpu.py's peer uses), on the same Q4_1 GGUF, the same machine, all started
at once and each measured while the others idle, through the same client. Writes bench/results/serving.md.

Workloads (greedy; EOS banned where a fixed length is measured):
- streams N = 1, 4, 16: N concurrent /v1/completions of 64 tokens each; aggregate generated
  tokens / wall time. llama-server runs 16 slots (continuous batching).
- prefix TTFT: 16 requests, one after another, sharing a ~1,000-token system prompt, each with
  its own question (after one warm-up request): mean time to the first streamed token.
  llama-server reuses its prompt cache (cache_prompt); kvgen its prefix cache, and again with
  PREFIX_CACHE=0.
- chat: 8 stateless clients x 4 turns, concurrent, each turn resending the whole history plus a
  new question (32 new tokens per turn): wall time, the best of CHAT_ROUNDS rounds that share
  nothing, alternating between the servers.

    make bench-serving   (or .venv/bin/python bench/serving.py [--skip-llama-server])
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "serving.md"
LLAMA_SERVER = ROOT / "bench" / ".cache" / "llama-server" / "llama-server"
SLOTS = 16
SYSTEM = ("You are the archivist of a coastal town. You answer questions about its lighthouse, its harbour, "
          "its fishing fleet and the people who kept them, briefly and exactly. ") * 28
QUESTIONS = [f"Question {i}: what happened in the year {1850 + 7 * i}?" for i in range(17)]
CHAT_ROUNDS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server process answering the OpenAI API at `url` until stop()."""

    def __init__(self, name: str, cmd: list[str], env: dict | None, port: int):
        self.name, self.url, self.model = name, f"http://127.0.0.1:{port}", ""
        self.log = tempfile.TemporaryFile(mode="w+")  # a pipe would fill up and stall a chatty server
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    async def ready(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    self.log.seek(0)
                    raise RuntimeError(f"{self.name} exited: {self.log.read()[-2000:]}")
                try:
                    async with s.get(self.url + "/v1/models") as r:
                        if r.status == 200:
                            self.model = (await r.json())["data"][0]["id"]  # kvgen asks for it
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        self.log.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def kvgen(prefix_cache: bool, model: str = "", activations: str = "") -> Served:
    """activations: CPU_ACTIVATIONS for this server (empty: the default, int16)."""
    port = _free_port()
    env = {**os.environ, "PORT": str(_free_port()), "HTTP_PORT": str(port), "METRICS_PORT": "0",
           "PREFIX_CACHE": "1" if prefix_cache else "0", "MAX_RUNNING": str(SLOTS)}
    env.pop("CPU_ACTIVATIONS", None)
    if activations:
        env["CPU_ACTIVATIONS"] = activations
    if model:
        env["MODEL"] = model
    name = f"kvgen{'' if prefix_cache else ' PREFIX_CACHE=0'}{' CPU_ACTIVATIONS=' + activations if activations else ''}"
    return Served(name, [sys.executable, "-m", "kvgen.service.server"], env, port)


def llama_server(model: str = "") -> Served:
    port = _free_port()
    cmd = [str(LLAMA_SERVER), "-m", model or peers.model_path(), "--port", str(port), "--host", "127.0.0.1",
           "-np", str(SLOTS), "-c", str(SLOTS * 2048), "-t", str(peers.cores()), "--cont-batching"]
    return Served("llama-server", cmd, None, port)


def _session() -> aiohttp.ClientSession:
    """A new connection per request, for both servers: llama-server's HTTP library closes a kept-alive
    connection after a few requests, which a pooled client sees as a dropped request."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=1800))


async def complete(s: aiohttp.ClientSession, srv: Served, body: dict) -> tuple[float, float, int, str]:
    """(seconds to the first streamed token, seconds in all, completion tokens, text)."""
    t0 = time.perf_counter()
    first, n, text = None, 0, ""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "model": srv.model, "stream": True, "stream_options": {"include_usage": True}}
    async with s.post(srv.url + path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{srv.name}: HTTP {r.status}: {(await r.text())[:500]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices") or []:
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    text += piece
                    if first is None:
                        first = time.perf_counter() - t0
            if chunk.get("usage"):
                n = chunk["usage"].get("completion_tokens", n)
    return first or 0.0, time.perf_counter() - t0, n, text


def _fixed(n: int) -> dict:
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True}


async def streams(url: Served, n: int) -> float:
    async with _session() as s:
        await complete(s, url, {"prompt": "Warm-up:", **_fixed(4)})
        t0 = time.perf_counter()
        out = await asyncio.gather(*(complete(s, url, {"prompt": f"Story {i}: once upon a time,", **_fixed(64)})
                                     for i in range(n)))
        return sum(o[2] for o in out) / (time.perf_counter() - t0)


async def prefix_ttft(url: Served) -> float:
    async with _session() as s:
        def body(q):
            return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                    **_fixed(8)}
        await complete(s, url, body(QUESTIONS[-1]))  # warm-up: the system prompt is computed once
        ttfts = [(await complete(s, url, body(q)))[0] for q in QUESTIONS[:16]]
        return sum(ttfts) / len(ttfts)


async def chat_round(url: Served, r: int, clients: int = 8, turns: int = 4) -> float:
    """Wall time of one round of the 8 x 4 conversations; round r's system prompt names it, so a
    round reuses nothing of an earlier one's conversations."""
    async def client(s, c: int) -> None:
        history = [{"role": "system", "content": f"Round {r}. " + "You are a helpful assistant. " * 4}]
        for t in range(turns):
            history.append({"role": "user", "content": f"Client {c}, turn {t}: tell me one more fact about the sea."})
            _, _, _, text = await complete(s, url, {"messages": history, **_fixed(32)})
            history.append({"role": "assistant", "content": text})
    async with _session() as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s, c) for c in range(clients)))
        return time.perf_counter() - t0


async def warm_up(url: Served) -> None:
    async with _session() as s:
        await complete(s, url, {"prompt": "Warm-up:", **_fixed(4)})


async def measure(servers: list[Served], workloads: list[str], rounds: int = CHAT_ROUNDS) -> dict[str, dict]:
    """Every server is started at once and stays up; each is measured alone (the others idle).
    Streams and prefix TTFT run server after server; the chat rounds alternate between the
    servers, so a burst of load on the shared cores costs them alike, and each keeps its best
    round (the ratio of two servers' walls measured minutes apart moved by 20%)."""
    out: dict[str, dict] = {srv.name: {} for srv in servers}
    try:
        for srv in servers:
            await srv.ready()
        for srv in servers:
            res = out[srv.name]
            if "streams" in workloads and "PREFIX_CACHE=0" not in srv.name:
                for n in (1, 4, 16):
                    res[f"streams {n}"] = await streams(srv, n)
                    print(f"{srv.name}: {n} streams {res[f'streams {n}']:.1f} tok/s", flush=True)
            if "prefix" in workloads and "CPU_ACTIVATIONS" not in srv.name:
                res["prefix ttft s"] = await prefix_ttft(srv)
                print(f"{srv.name}: prefix TTFT {res['prefix ttft s']:.3f} s", flush=True)
        if "chat" in workloads:
            walls: dict[str, list[float]] = {srv.name: [] for srv in servers}
            for srv in servers:
                await warm_up(srv)
            for r in range(rounds):
                for srv in servers:
                    walls[srv.name].append(await chat_round(srv, r))
                    print(f"{srv.name}: chat round {r}: {walls[srv.name][-1]:.2f} s", flush=True)
            for srv in servers:
                out[srv.name]["chat 8x4 s"] = min(walls[srv.name])
        return out
    finally:
        for srv in servers:
            srv.stop()


def render(results: dict[str, dict], seconds: float, model: str = "") -> str:
    names = list(results)
    base = "llama-server" if "llama-server" in results else names[0]
    rows = [k for k in ("streams 1", "streams 4", "streams 16", "prefix ttft s", "chat 8x4 s")
            if any(k in r for r in results.values())]
    lines = [
        "# Serving next to llama-server",
        "",
        f"Generated by `make bench-serving` (bench/serving.py) on {datetime.date.today().isoformat()}: "
        f"{peers.cores()} cores ({peers.cpu_name()}), {seconds:.0f} s in all. "
        f"{'`--model ' + Path(model).name + '`' if model else 'The embedded SmolLM2-135M Q4_1 GGUF'}; "
        "kvgen with its defaults (WEIGHT_DTYPE=auto: gguf on a CPU) through its OpenAI-compatible "
        "HTTP API, "
        f"MAX_RUNNING={SLOTS}; llama-server (same llama.cpp as llama-cpp-python's sdist) with {SLOTS} slots, "
        "continuous batching, prompt cache; the same client for both. Streams: aggregate generated tok/s "
        "(higher is better); prefix TTFT: seconds (lower is better); chat wall time: seconds, the best of "
        f"{CHAT_ROUNDS} rounds that alternate between the servers (all started at once, each measured while the "
        "others idle). In parentheses: "
        f"against {base}, >1 means better than it.",
        "",
        "| workload | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    for k in rows:
        cells = []
        for n in names:
            v, b = results[n].get(k), results[base].get(k)
            if v is None:
                cells.append("-")
                continue
            ratio = (v / b if k.startswith("streams") else b / v) if b else float("nan")
            cells.append(f"{v:.2f} ({ratio:.2f}x)")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="streams,prefix,chat")
    ap.add_argument("--skip-llama-server", action="store_true")
    ap.add_argument("--model", default="", help="a GGUF file for both servers (default: the embedded Q4_1)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--int8", action="store_true", help="also a kvgen with CPU_ACTIVATIONS=int8 (streams only)")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    t0 = time.perf_counter()
    servers = []
    if not args.skip_llama_server:
        if LLAMA_SERVER.exists():
            servers.append(llama_server(args.model))
        else:
            print(f"llama-server skipped: {LLAMA_SERVER} missing (bash bench/setup_llama_server.sh)")
    servers.append(kvgen(True, args.model))
    if args.int8:
        servers.append(kvgen(True, args.model, "int8"))
    if "prefix" in workloads or "chat" in workloads:
        servers.append(kvgen(False, args.model))
    results = asyncio.run(measure(servers, workloads))
    text = render(results, time.perf_counter() - t0, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
