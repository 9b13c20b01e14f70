"""Stateless chat over two replicas, three routers, one run (issue #43): 8 clients, each a 4-turn
chat that resends the whole conversation every turn (as OpenAI-style clients do), through
  - Envoy least request (deploy/envoy: it fronts the replicas' gRPC port only, so this chat runs
    over kvgen.v1 Generate with the messages and no x-session-id: the stateless route),
  - smg round_robin and smg cache_aware (OpenAI HTTP, /v1/chat/completions, the openai SDK), smg
    reaching the replicas' HTTP API, and smg cache_aware over their vLLM gRPC worker service, where
    it routes on the KV events each replica streams.
Per router: the turns after the first whose reply reports cached prompt tokens, the prefix-cache
hit tokens by the replicas' own counters, wall time and turn latency. The replicas are started
afresh for each router (no cache carries over) and warmed directly first. Appends (or replaces)
its section of bench/results/mesh.md, after bench/mesh.py's.

    make bench-mesh                                   # bench/mesh.py, then this
    .venv/bin/python bench/mesh_chat.py --rounds 2    # each router twice, orders rotated
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from deploy.mesh import Mesh, Replica  # noqa: E402
from kvgen.client import request  # noqa: E402
from kvgen.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

HEADING = "## Stateless chat: Envoy least request, smg round_robin, smg cache_aware"
ROUTERS = {  # name -> (Mesh router, smg policy, how smg reaches the replicas)
    "Envoy least request (gRPC)": ("envoy", "", ""),
    "smg round_robin (HTTP)": ("smg", "round_robin", "http"),
    "smg cache_aware (HTTP)": ("smg", "cache_aware", "http"),
    "smg cache_aware (gRPC workers, KV events)": ("smg", "cache_aware", "grpc"),
}
# A system prompt each: their first words differ, so no two conversations share a 16-token block
# and a turn's cached tokens can only come from its own earlier turns.
PERSONAS = [
    ("Ahoy! You are an old sailor who answers with sea stories.", "What was your worst storm?"),
    ("Bonjour. You are a French baker explaining bread to beginners.", "Why does dough need to rest?"),
    ("Greetings, traveller: you are a mountain guide in the Alps.", "How do I prepare for a glacier walk?"),
    ("Hello from the observatory; you are an astronomer on night shift.", "Which planet is easiest to see?"),
    ("Listen closely, for you are a jazz pianist teaching chords.", "What makes a chord sound sad?"),
    ("Quiet please, you are a librarian who loves old maps.", "What is the oldest map you know of?"),
    ("Well now, you are a beekeeper with forty hives.", "How do bees decide where to swarm?"),
    ("Zoom in: you are a botanist studying ferns in a rainforest.", "How do ferns reproduce without seeds?"),
]
FOLLOW_UPS = ["Tell me more about that.", "Why is that so?", "Give me one example, briefly."]
# The house rules an application puts after its persona (real system prompts run to hundreds of
# tokens): --system-words of them, cycled, after the persona's own first sentence, so they are the
# client's own prefix too. The longer the prefix a turn resends, the more a cache hit saves.
HOUSE_RULES = ["Answer in plain words a beginner can follow.", "Keep every answer short and concrete.",
               "Never invent dates, names or numbers you are not sure of.", "Say so when you do not know.",
               "Prefer one good example to three vague ones.", "Stay in character, kindly and calmly.",
               "Do not repeat the question back to the user.", "Use no lists unless the user asks for one.",
               "Mention safety whenever an activity carries risk.", "End with a short friendly sentence."]
COLUMNS = ["router", "turns after the first with cached_tokens > 0", "cached_tokens (replies)",
           "prefix-cache hit tokens (replicas' counters)", "prompt tokens", "calls r0 / r1", "wall s (per round)",
           "replicas' CPU s (per round)",
           "turn mean s", "p50 s", "p95 s"]
# The replicas' own counts: prompt tokens the prefix cache gave back (whole blocks and the rows of a
# block matched in part, so more than the replies' cached_tokens, which count whole blocks only),
# and requests finished (which replica took how many turns).
COUNTERS = ("kvgen_prefix_cache_hit_tokens_total", "kvgen_requests_finished_total")


@dataclass
class Turn:
    client: int
    turn: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str


def house_rules(words: int) -> str:
    """About `words` words of HOUSE_RULES, numbered, cycled."""
    out, n, i = [], 0, 0
    while n < words:
        rule = f"Rule {i + 1}: {HOUSE_RULES[i % len(HOUSE_RULES)]}"
        out.append(rule)
        n, i = n + len(rule.split()), i + 1
    return " ".join(out)


def conversation(client: int, turns: int, system_words: int = 0) -> tuple[list[dict], list[str]]:
    """The client's system message and its user messages, one a turn."""
    system, first = PERSONAS[client % len(PERSONAS)]
    if client >= len(PERSONAS):  # more clients than personas: still a prefix of its own
        system = f"Client {client}. {system}"
    if system_words:
        system = f"{system} {house_rules(system_words)}"
    return [{"role": "system", "content": system}], [first, *(FOLLOW_UPS * turns)][:turns]


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


def chat_http(url: str, client: int, turns: int, max_new_tokens: int, start: threading.Barrier,
              system_words: int = 0) -> list[Turn]:
    sdk = _sdk(url)
    model = sdk.models.list().data[0].id  # what the replicas serve, by the name they give it
    history, asks = conversation(client, turns, system_words)
    out = []
    start.wait()
    for i, ask in enumerate(asks):
        history.append({"role": "user", "content": ask})
        t0 = time.perf_counter()
        r = sdk.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=max_new_tokens,
                                        extra_body={"ignore_eos": True})
        seconds = time.perf_counter() - t0
        details = r.usage.prompt_tokens_details
        text = r.choices[0].message.content
        out.append(Turn(client, i, seconds, r.usage.prompt_tokens, details.cached_tokens if details else 0,
                        r.usage.completion_tokens, text))
        history.append({"role": "assistant", "content": text})
    return out


def chat_grpc(target: str, client: int, turns: int, max_new_tokens: int, start: threading.Barrier,
              system_words: int = 0) -> list[Turn]:
    """The same chat over kvgen.v1 Generate (unary, the messages rendered by the replica's chat
    template, as over HTTP), with no session header: Envoy's least request route."""
    history, asks = conversation(client, turns, system_words)
    out = []
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        start.wait()
        for i, ask in enumerate(asks):
            history.append({"role": "user", "content": ask})
            t0 = time.perf_counter()
            r, _ = stub.Generate.with_call(request(history, max_new_tokens=max_new_tokens, temperature=0.0,
                                                   ignore_eos=True), timeout=600)
            seconds = time.perf_counter() - t0
            out.append(Turn(client, i, seconds, r.usage.prompt_tokens, r.usage.cached_tokens,
                            r.usage.completion_tokens, r.text))
            history.append({"role": "assistant", "content": r.text})
    return out


def run_clients(mesh: Mesh, clients: int, turns: int, max_new_tokens: int,
                system_words: int = 0) -> tuple[float, list[Turn]]:
    """Every client in its own thread, released together; wall time until the last turn's reply."""
    chat, where = (chat_grpc, mesh.target) if mesh.router == "envoy" else (chat_http, mesh.url)
    start = threading.Barrier(clients + 1)
    results: dict[int, list[Turn]] = {}
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            results[i] = chat(where, i, turns, max_new_tokens, start, system_words)
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            errors.append(f"client {i}: {e!r}")
            start.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    return wall, [t for i in sorted(results) for t in results[i]]


def warm(r: Replica) -> None:
    """One short chat straight to the replica: the first call's one-off costs (kernel compiles,
    allocations) are not any router's. Its prompt shares no block with the workload's."""
    sdk = _sdk(r.url)
    sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=[{"role": "user", "content": "Warm up."}],
                                temperature=0, max_tokens=8)


def counters(mesh: Mesh) -> dict[str, dict[str, float]]:
    return {r.name: {c: r.counter(c) for c in COUNTERS} | {"cpu s": cpu_seconds(r)} for r in mesh.replicas}


def cpu_seconds(r: Replica) -> float:
    """CPU time the replica's process has used (user + system, every thread): the work a router
    costs the replicas. Other load on a shared machine stretches it too (cache and core sharing),
    but it does not count the time a replica waited for a core, as wall time does."""
    fields = Path(f"/proc/{r.proc.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat fields 14, 15)


def settled(mesh: Mesh, before: dict, calls: int, timeout: float = 10) -> dict[str, dict[str, float]]:
    """The counters once the replicas have counted every call finished (a reply may reach the
    client a moment before its replica's counters move)."""
    deadline = time.monotonic() + timeout
    while True:
        now = counters(mesh)
        done = sum(now[r]["kvgen_requests_finished_total"] - before[r]["kvgen_requests_finished_total"] for r in now)
        if done >= calls or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def bench_router(name: str, a, work: Path, threads: int) -> dict:
    router, policy, workers = ROUTERS[name]
    mesh = Mesh(2, a.model, work / f"{router}-{policy or 'lr'}-{workers}-{time.monotonic_ns()}", router=router,
                policy=policy or "cache_aware", workers=workers or "http", THREADS=str(threads))
    try:
        mesh.start()
        for r in mesh.replicas:
            warm(r)
        before = counters(mesh)
        wall, turns = run_clients(mesh, a.clients, a.turns, a.max_new_tokens, a.system_words)
        after = settled(mesh, before, len(turns))
    finally:
        mesh.stop()
    delta = {r: {c: after[r][c] - before[r][c] for c in after[r]} for r in after}
    return {"wall": wall, "turns": turns, "replicas": delta}


def summary(runs: list[dict]) -> dict:
    """One router's rounds: hit rates over the turns after the first, the replicas' counters,
    wall times, and latency over every turn of every round."""
    turns = [t for run in runs for t in run["turns"]]
    later = [t for t in turns if t.turn > 0]
    seconds = sorted(t.seconds for t in turns)
    calls = {r: sum(run["replicas"][r]["kvgen_requests_finished_total"] for run in runs) / len(runs)
             for r in runs[0]["replicas"]}
    return {
        "cached %": 100 * sum(t.cached_tokens > 0 for t in later) / max(1, len(later)),
        "cached tokens": sum(t.cached_tokens for t in turns) / len(runs),
        "hit tokens": sum(sum(rep["kvgen_prefix_cache_hit_tokens_total"] for rep in run["replicas"].values())
                          for run in runs) / len(runs),
        "prompt tokens": sum(t.prompt_tokens for t in turns) / len(runs),
        "completion tokens": sum(t.completion_tokens for t in turns) / len(runs),
        "calls": calls,
        "walls": [run["wall"] for run in runs],
        "cpu": [sum(rep["cpu s"] for rep in run["replicas"].values()) for run in runs],
        "mean": statistics.fmean(seconds), "p50": statistics.median(seconds),
        "p95": seconds[min(len(seconds) - 1, round(0.95 * (len(seconds) - 1)))],
    }


def replace_section(text: str, heading: str, section: str) -> str:
    """text with the section that starts at `heading` (up to the next "## " heading, or the end)
    replaced by `section`; appended when text has none."""
    start = ("\n" + text).find(f"\n{heading}\n")  # a line of its own, the first line included
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section if text.strip() else section
    end = text.find("\n## ", start + len(heading))
    return text[:start] + section.rstrip("\n") + "\n" + (text[end:] if end >= 0 else "")


def table(a, cores: int, threads: int, stats: dict[str, dict], same_text: bool, load_avg: float) -> str:
    rows = []
    for name, s in stats.items():
        calls = " / ".join(f"{c:.0f}" for c in s["calls"].values())
        walls = " / ".join(f"{w:.1f}" for w in s["walls"])
        cpu = " / ".join(f"{c:.1f}" for c in s["cpu"])
        rows.append(f"| {name} | {s['cached %']:.0f}% | {s['cached tokens']:.0f} | {s['hit tokens']:.0f} | "
                    f"{s['prompt tokens']:.0f} | {calls} | {walls} | {cpu} | {s['mean']:.2f} | {s['p50']:.2f} | "
                    f"{s['p95']:.2f} |")
    rows = "\n".join(rows)
    totals = {name: (sum(s["walls"]), sum(s["cpu"])) for name, s in stats.items()}
    best_wall, best_cpu = min(w for w, _ in totals.values()), min(c for _, c in totals.values())
    ranking = "; ".join(f"{name}: {w:.0f} s ({w / best_wall:.2f}x the fastest), CPU {c:.0f} s ({c / best_cpu:.2f}x)"
                        for name, (w, c) in sorted(totals.items(), key=lambda kv: kv[1][0]))
    header = "| " + " | ".join(COLUMNS) + " |"
    n_turns = a.clients * a.turns
    return f"""{HEADING}

{datetime.date.today()}, {peers.cpu_name()}, {cores} cores; model: {a.model or 'embedded SmolLM2-135M'};
`bench/mesh_chat.py --clients {a.clients} --turns {a.turns} --rounds {a.rounds} --system-words {a.system_words}`.
{a.clients} clients at once, each a {a.turns}-turn chat with a system prompt of its own (a persona's sentence
and {a.system_words} words of house rules, as applications' system prompts run to hundreds of tokens) and a
first question of its own, the whole conversation resent every turn, greedy, {a.max_new_tokens} new tokens a
turn (ignore_eos): {n_turns} turns a round. Two replicas, THREADS={threads} each, started afresh for every
router (no cache carries over) and warmed with one short call each, straight to the replica. Envoy
(deploy/envoy) fronts only the replicas' gRPC port, so its run is the same chat over kvgen.v1 Generate with
no `x-session-id` (its least request route). smg's runs are OpenAI HTTP through the openai SDK, smg reaching
the replicas over their OpenAI HTTP API (`http://` workers: smg routes on the request's text) or over the vLLM
gRPC worker service (`grpc://` workers: smg tokenizes and renders the chat template itself, and cache_aware
routes on the replicas' SubscribeKvEvents streams, the blocks each really holds). Everything shares the
machine's cores (5-minute load average at the end: {load_avg:.1f}).

{header}
| --- |{' --- |' * (len(COLUMNS) - 1)}
{rows}

Token counts and calls are per round (a mean when rounds > 1); latency over every turn of every
round; prompt tokens: of all turns, the first included; CPU s: both replica processes' user + system
time over the run. cached_tokens is what the replies reported
(whole 16-token blocks); the replicas' hit tokens also count the rows of a block matched in part
(a resent turn's last, partly filled block), so they run a little higher. The replies were
{"the same" if same_text else "NOT all the same"} under every router (greedy, the same model), so every router did
the same work but for what the cache saved.

Wall time and the replicas' CPU time summed over the {a.rounds} round(s), fastest first: {ranking}.
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--system-words", type=int, default=300,
                   help="house rules after each persona, in words (0: the persona's sentence alone)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every router, the order rotated each round")
    p.add_argument("--model", default="", help="MODEL for the replicas (default: the embedded one)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mesh.md"))
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 2)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgen-bench-mesh-chat-{os.getpid()}"
    names = list(ROUTERS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for k in range(a.rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            print(f"round {k + 1}: {name}", flush=True)
            runs[name].append(bench_router(name, a, work, threads))
            print(f"  wall {runs[name][-1]['wall']:.1f} s", flush=True)
    stats = {n: summary(runs[n]) for n in names}
    texts = {n: [t.text for run in runs[n] for t in run["turns"]] for n in names}
    same_text = all(texts[n] == texts[names[0]] for n in names)
    section = table(a, cores, threads, stats, same_text, os.getloadavg()[1])
    out = Path(a.out)
    out.write_text(replace_section(out.read_text() if out.exists() else "", HEADING, section))
    print(section)


if __name__ == "__main__":
    main()
