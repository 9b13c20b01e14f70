"""Soak: many careless clients at once, then the server must be as it was before them.

Issue 12's wedge took ~2 minutes of this mix to show (a cancelled session turn left a lock held,
and the next turn of that session blocked the event loop). Client threads each loop over: unary
Generate, streams read to the end, streams cancelled after a few tokens, deadlines that expire
mid-stream, BatchGenerate, GetModelInfo, and sessions (several turns, some cancelled or cut by a
deadline mid-stream, some closed while a turn streams, some left open). Afterwards every RPC
answers within a second, the KV pool holds exactly what the open sessions hold (0 once they are
closed), nothing is running or waiting, and RSS grew less than 10% after warm-up (the server runs
in the test's process, so that RSS is the server's plus the clients').

The 30 s version runs in `make test`; the 150 s one is `slow` (`make test-slow`).
"""

from __future__ import annotations

import random
import resource
import sys
import threading
import time
import traceback
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgen.client import request
from kvgen.engine.kv.tiers import Tier
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

THREADS = 12
CALL_TIMEOUT_S = 20  # far above any call's real time on the tiny model: hitting it means a stall
MAX_ITERATIONS = 100_000  # per thread; the clock ends the loop long before
CODE = grpc.StatusCode


@dataclass
class Tally:
    """What the client threads saw, shared between them."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: Counter = field(default_factory=Counter)  # action -> completed as expected
    unexpected: list[str] = field(default_factory=list)  # action: what happened instead
    kept_sessions: list[str] = field(default_factory=list)  # left open on purpose
    probe_s: list[float] = field(default_factory=list)  # GetModelInfo latencies from the probe thread

    def good(self, action: str) -> None:
        with self.lock:
            self.ok[action] += 1

    def bad(self, action: str, what: str) -> None:
        with self.lock:
            if len(self.unexpected) < 200:
                self.unexpected.append(f"{action}: {what}")


def rpc_error(e: grpc.RpcError) -> str:
    return f"{e.code().name} {e.details()!r}"


class Client:
    """One client thread's traffic: a channel of its own and a seeded choice of actions."""

    def __init__(self, target: str, seed: int, tally: Tally):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.rng = random.Random(seed)
        self.tally = tally

    def prompt(self, most_words: int = 40) -> str:
        words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
        return " ".join(self.rng.choices(words, k=self.rng.randint(1, most_words)))

    def sampling(self, n: int) -> dict:
        if self.rng.random() < 0.5:
            return dict(max_new_tokens=n, temperature=0.0)
        return dict(max_new_tokens=n, temperature=0.9, seed=self.rng.randint(0, 1000), top_k=50)

    # the actions: each returns normally, having reported its outcome

    def unary(self) -> None:
        n = self.rng.randint(1, 32)
        r = self.stub.Generate(request(self.prompt(), **self.sampling(n)), timeout=CALL_TIMEOUT_S)
        if not (0 < len(r.token_ids) <= n and r.finish_reason in (pb.FINISH_REASON_LENGTH,
                                                                   pb.FINISH_REASON_STOP_TOKEN)):
            return self.tally.bad("unary", f"{len(r.token_ids)} tokens of {n}, finish {r.finish_reason}")
        self.tally.good("unary")

    def stream(self) -> None:
        n = self.rng.randint(1, 48)
        msgs = list(self.stub.GenerateStream(request(self.prompt(), **self.sampling(n)), timeout=CALL_TIMEOUT_S))
        if not msgs or msgs[-1].finish_reason == 0 or sum(len(m.token_ids) for m in msgs) > n:
            return self.tally.bad("stream", f"{len(msgs)} messages, last {msgs[-1] if msgs else None}")
        self.tally.good("stream")

    def _cut(self, call, reads: int) -> None:
        """Read a few messages of a long stream, then cancel it."""
        for _ in range(reads):
            next(call)
        call.cancel()

    def cancelled_stream(self) -> None:
        call = self.stub.GenerateStream(request(self.prompt(), max_new_tokens=1500, ignore_eos=True),
                                        timeout=CALL_TIMEOUT_S)
        self._cut(call, self.rng.randint(1, 4))
        self.tally.good("cancelled_stream")

    def deadline_stream(self, session_id: str = "", messages=None, most: int = 1500) -> None:
        req = request(messages or self.prompt(), session_id=session_id, max_new_tokens=most, ignore_eos=True)
        try:
            for _ in self.stub.GenerateStream(req, timeout=self.rng.uniform(0.05, 0.4)):
                pass
        except grpc.RpcError as e:
            if e.code() == CODE.DEADLINE_EXCEEDED:
                return self.tally.good("deadline_stream")
            return self.tally.bad("deadline_stream", rpc_error(e))
        self.tally.bad("deadline_stream", f"{most} tokens within the deadline")

    def batch(self) -> None:
        k = self.rng.randint(2, 6)
        reqs = [request(self.prompt(), **self.sampling(self.rng.randint(1, 16))) for _ in range(k)]
        out = self.stub.BatchGenerate(pb.BatchGenerateRequest(requests=reqs), timeout=CALL_TIMEOUT_S)
        kinds = [r.WhichOneof("result") for r in out.results]
        if kinds != ["response"] * k:
            return self.tally.bad("batch", f"{kinds} {[r.error.message for r in out.results]}")
        self.tally.good("batch")

    def info(self) -> None:
        self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
        self.tally.good("info")

    def session(self) -> None:
        sid = self.stub.CreateSession(pb.CreateSessionRequest(), timeout=CALL_TIMEOUT_S).session_id
        # Every turn's tokens stay in the session: at most 4 turns of 10 words and 200 tokens fit
        # the tiny model's 2048-token context whatever the dice say.
        turn = lambda: [{"role": "user", "content": self.prompt(10)}]  # noqa: E731
        for _ in range(self.rng.randint(2, 4)):
            kind = self.rng.random()
            if kind < 0.3:  # a turn cancelled mid-stream; the next turn comes at once
                call = self.stub.GenerateStream(request(turn(), session_id=sid, max_new_tokens=200, ignore_eos=True),
                                                timeout=CALL_TIMEOUT_S)
                self._cut(call, self.rng.randint(1, 3))
            elif kind < 0.45:
                self.deadline_stream(sid, turn(), most=200)
            elif kind < 0.7:
                list(self.stub.GenerateStream(request(turn(), session_id=sid, **self.sampling(16)),
                                              timeout=CALL_TIMEOUT_S))
            else:
                r = self.stub.Generate(request(turn(), session_id=sid, **self.sampling(16)), timeout=CALL_TIMEOUT_S)
                if r.usage.prompt_tokens == 0:
                    self.tally.bad("session", f"turn without a prompt: {r.usage}")
        end = self.rng.random()
        if end < 0.15:  # closed while a turn streams: the stream must end, not hang
            call = self.stub.GenerateStream(request(turn(), session_id=sid, max_new_tokens=200, ignore_eos=True),
                                            timeout=CALL_TIMEOUT_S)
            next(call)
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
            try:
                for _ in call:
                    pass
            except grpc.RpcError as e:
                if e.code() == CODE.DEADLINE_EXCEEDED:
                    return self.tally.bad("session", "a closed session's turn streamed on until its deadline")
        elif end < 0.25:
            with self.tally.lock:
                self.tally.kept_sessions.append(sid)
        else:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
        self.tally.good("session")

    def run(self, until: float) -> None:
        actions = [(self.unary, 3), (self.stream, 3), (self.cancelled_stream, 2), (self.deadline_stream, 2),
                   (self.batch, 1), (self.info, 1), (self.session, 3)]
        fns, weights = zip(*actions, strict=True)
        try:
            for _ in range(MAX_ITERATIONS):
                if time.monotonic() >= until:
                    return
                fn = self.rng.choices(fns, weights)[0]
                try:
                    fn()
                except grpc.RpcError as e:
                    self.tally.bad(fn.__name__, rpc_error(e))
                except Exception as e:  # the test's own bug must show, not kill the thread quietly
                    self.tally.bad(fn.__name__, f"{type(e).__name__}: {e}")
        finally:
            self.channel.close()


def probe(target: str, until: float, tally: Tally) -> None:
    """GetModelInfo twice a second while the soak runs: how long any client waits for the loop."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
                tally.probe_s.append(time.monotonic() - t0)
            except grpc.RpcError as e:
                tally.bad("probe", rpc_error(e))
            time.sleep(0.5)  # a sampling period, not synchronization


def scrape(port: int) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(page) for s in fam.samples if not s.labels}


def wait_for(cond, timeout: float, what: str):
    """Poll cond() until it is truthy (returns it) or fail after timeout with its last value."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got or time.monotonic() > deadline:
            assert got, f"{what}: still {got!r} after {timeout}s"
            return got
        time.sleep(0.05)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def all_stacks() -> str:
    """Every thread's stack, for a failure message: where a wedged server sits."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(tid, tid)}\n" + "".join(traceback.format_stack(frame))
                     for tid, frame in sys._current_frames().items())


def held_by_sessions(gen) -> int:
    """Distinct blocks the open sessions' tables hold in the pool (a demoted block is -1, not
    counted; sessions that start alike share blocks through the prefix cache, counted once)."""
    return len({b for s in list(gen.sessions.values()) for b in s.cache.blocks if b >= 0})


def answers_within(target: str, timeout: float = 1.0) -> None:
    """Each RPC, once, with a deadline of timeout."""
    t = timeout
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t)
        stub.Generate(request("hello world", max_new_tokens=4), timeout=t)
        assert list(stub.GenerateStream(request("hello", max_new_tokens=4), timeout=t))[-1].finish_reason
        stub.BatchGenerate(pb.BatchGenerateRequest(requests=[request("a b", max_new_tokens=2)] * 2), timeout=t)
        sid = stub.CreateSession(pb.CreateSessionRequest(), timeout=t).session_id
        stub.Generate(request([{"role": "user", "content": "hi"}], session_id=sid, max_new_tokens=4), timeout=t)
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=t)


@pytest.fixture(scope="module")
def soak_server(start_server):
    # MAX_SESSIONS_PER_KEY only counts API keys, none here; the tiny pool has room for every
    # kept session, so nothing is demoted and "held" is what the pool shows.
    return start_server()


@pytest.mark.parametrize("duration", [20, pytest.param(150, marks=pytest.mark.slow)])
@pytest.mark.timeout(600)
def test_soak(soak_server, duration):
    server, tally = soak_server, Tally()
    metrics_port = server.settings.metrics_port
    answers_within(server.target, timeout=CALL_TIMEOUT_S)  # up and warm before the clock starts
    start = time.monotonic()
    until = start + duration
    threads = [threading.Thread(target=Client(server.target, seed, tally).run, args=(until,), name=f"soak-{seed}",
                                daemon=True) for seed in range(THREADS)]
    threads.append(threading.Thread(target=probe, args=(server.target, until, tally), daemon=True))
    for t in threads:
        t.start()
    # RSS after warm-up: allocator pools, grpc's and torch's caches have reached their size.
    warm_at = start + max(10.0, duration / 3)
    time.sleep(max(0.0, warm_at - time.monotonic()))  # a point on the clock, not synchronization
    rss_warm = rss_bytes()
    warm_tier = server.gen.tiers.nbytes(Tier.WARM)
    blocks_seen = []
    while time.monotonic() < until:
        blocks_seen.append(scrape(metrics_port)["kvgen_kv_blocks_used"])
        time.sleep(1.0)
    for t in threads:
        t.join(CALL_TIMEOUT_S + 10)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"client threads still in a call: {hung}\n{all_stacks()}"

    print(f"\nsoak {duration}s: {dict(tally.ok)}; {len(tally.kept_sessions)} sessions left open; "
          f"blocks used max {max(blocks_seen, default=0):.0f}; "
          f"probe max {max(tally.probe_s, default=0):.3f}s over {len(tally.probe_s)}")
    assert not tally.unexpected, "\n".join(tally.unexpected)
    assert min(tally.ok[a] for a in ("unary", "stream", "cancelled_stream", "deadline_stream", "batch", "session")) > 0
    assert tally.probe_s and max(tally.probe_s) < 5, tally.probe_s  # never a wedged loop, even under load

    # The clients have left: whatever they cancelled is retired, nothing runs or waits.
    gen = server.gen
    wait_for(lambda: (m := scrape(metrics_port))["kvgen_requests_running"] == 0
             and m["kvgen_requests_waiting"] == 0, 10, "requests running or waiting")
    try:
        answers_within(server.target)
    except grpc.RpcError as e:
        pytest.fail(f"after the soak: {rpc_error(e)}\n{all_stacks()}")

    # The pool holds exactly what the sessions left open hold, and nothing once they close.
    kept = tally.kept_sessions
    assert scrape(metrics_port)["kvgen_sessions_open"] == len(kept) == len(gen.sessions)
    used = scrape(metrics_port)["kvgen_kv_blocks_used"]
    assert used == held_by_sessions(gen), (used, held_by_sessions(gen))
    assert (used > 0) == any(s.cache.length for s in gen.sessions.values())
    with grpc.insecure_channel(server.target) as ch:
        stub = pb_grpc.GeneratorStub(ch)
        for sid in kept:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=1)
    m = scrape(metrics_port)  # CloseSession answers once the blocks are back
    assert (m["kvgen_kv_blocks_used"], m["kvgen_sessions_open"]) == (0, 0)

    # host memory the prefix cache's warm tier holds by design (PREFIX_CACHE_TIER_MB bounds it;
    # parked session turns are indexed too) is not growth
    rss_end = rss_bytes() - (gen.tiers.nbytes(Tier.WARM) - warm_tier)
    growth = (rss_end - rss_warm) / rss_warm
    print(f"RSS {rss_warm / 2**20:.0f} MiB after warm-up, {rss_end / 2**20:.0f} MiB at the end ({growth:+.1%})")
    assert growth < 0.10
