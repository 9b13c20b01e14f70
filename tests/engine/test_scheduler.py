"""Continuous batching on the real model: concurrency, preemption, admission, sessions, metrics."""

from __future__ import annotations

import os
import threading
import time
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvgen.client import Client, request
from kvgen.engine.kv.tiers import Tier
from kvgen.engine.sampling import SamplingParams
from kvgen.v1 import generate_pb2 as pb
from tests.conftest import ServerThread

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
TOPICS = ["the sea", "a cat", "rain", "music", "bread", "a city", "winter", "trees", "the moon", "coffee",
          "a river", "books", "the wind", "a garden", "trains", "snow"]


def prompts(n: int) -> list[str]:
    return [f"{'Tell me' if i % 2 else 'Write'} something about {TOPICS[i % len(TOPICS)]}, part {i}:" for i in range(n)]


def test_32_concurrent_greedy_streams_equal_their_solo_output(gen):
    ps = prompts(32)
    solo = [gen.generate(p, GREEDY).token_ids for p in ps]
    steps = []
    gen.engine.on_step = lambda batch, s: steps.append(len(batch))
    try:
        out = [None] * len(ps)

        def run(i):
            out[i] = [t for ev in gen.generate_stream(ps[i], GREEDY) for t in ev.token_ids]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gen.engine.on_step = None
    assert out == solo
    assert max(steps) >= 16  # they really shared forward passes
    assert gen.scheduler.kv.used == 0


def test_preemption_keeps_every_stream_correct(make_gen):
    ps = prompts(6)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    roomy = make_gen(kv_cache_mb=16)
    solo = [roomy.generate(p, params).token_ids for p in ps]
    # each stream needs ~4 blocks of 16 tokens; 10 blocks cannot hold six at once
    tight = make_gen(kv_cache_mb=10 * roomy.pool.fmt.bytes_per_block() / 2**20)
    assert tight.pool.capacity == 10
    results = tight.batch_generate(ps, params)
    assert tight.scheduler.preemptions > 0
    assert [r.token_ids for r in results] == solo
    assert tight.scheduler.kv.used == 0


def test_long_prompt_is_prefilled_in_chunks_beside_running_streams(make_gen):
    g = make_gen(token_budget=32)
    steps = []
    g.engine.on_step = lambda batch, s: steps.append([(seq.seq_id, n) for seq, n in batch])
    short = threading.Thread(target=lambda: g.generate("Count: one, two,", SamplingParams(
        temperature=0, max_new_tokens=30, ignore_eos=True)))
    short.start()
    deadline = time.monotonic() + 60
    while not any(n == 1 for step in list(steps) for _, n in step):  # until the short stream decodes
        assert time.monotonic() < deadline, "the short stream never started decoding"
        time.sleep(0.005)
    long_ids = list(range(1000, 1200))  # 200 tokens: at least 7 chunks of <= 31
    r = g.generate(long_ids, SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
    short.join()
    assert r.usage.prompt_tokens == 200
    long_id = max(sid for step in steps for sid, _ in step)
    prefill_steps = [s for s in steps if any(sid == long_id and n > 1 for sid, n in s)]
    assert len(prefill_steps) >= 7
    assert all(sum(n for _, n in s) <= 32 for s in steps)
    # the short stream decoded in (almost) every step that prefilled the long prompt
    with_decode = [s for s in prefill_steps if any(sid != long_id and n == 1 for sid, n in s)]
    assert len(with_decode) >= len(prefill_steps) - 1


def retry_delay(err: grpc.RpcError) -> float:
    status = status_pb2.Status.FromString(dict(err.trailing_metadata())["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def test_over_the_waiting_bound_is_resource_exhausted_with_retry_info(make_gen):
    srv = ServerThread(make_gen(max_running=1, max_waiting=1))
    try:
        client = Client(srv.target)
        long = dict(max_new_tokens=200, ignore_eos=True, temperature=0.0)
        running = client.stream("Once upon a time", **long)
        next(running)  # admitted and decoding
        waiting = client.stream("Far far away", **long)
        deadline = time.time() + 10
        while not srv.gen.scheduler.waiting and time.time() < deadline:
            time.sleep(0.01)
        assert len(srv.gen.scheduler.waiting) == 1
        with pytest.raises(grpc.RpcError) as e:
            client.generate("One more", max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_delay(e.value) > 0
        running.cancel()
        waiting.cancel()
        client.close()
    finally:
        srv.stop()


def test_session_two_turns_equal_the_full_conversation(server, stub):
    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
    sampling = dict(temperature=0.0, max_new_tokens=24)
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    r1 = stub.Generate(request(turn1, session_id=sid, **sampling))
    turn2 = [{"role": "user", "content": "Now name a vegetable."}]
    r2 = list(stub.GenerateStream(request(turn2, session_id=sid, **sampling)))
    full = turn1 + [{"role": "assistant", "content": r1.text}] + turn2
    fresh = stub.Generate(request(full, cache_salt="no-session", **sampling))  # nothing cached under this salt
    assert [t for m in r2 for t in m.token_ids] == list(fresh.token_ids)
    assert r2[-1].usage.cached_tokens > r1.usage.prompt_tokens  # turn 1's prompt and reply reused
    assert fresh.usage.cached_tokens == 0
    assert server.gen.scheduler.kv.used > 0  # the session holds its blocks between calls
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert server.gen.scheduler.kv.used == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(request("hi", session_id=sid, max_new_tokens=1))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def _two_turns(g, turn1_then=None):
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    s = g.new_session()
    first = s.generate(list(range(100, 140)), greedy)
    if turn1_then:
        turn1_then(s)
    second = s.generate(list(range(140, 150)), greedy)
    return s, first, second


def _push_out(g, s):
    """A request that needs the idle session's blocks: they leave the pool, the session keeps
    its tokens (nothing waits forever, nothing is lost)."""
    big = (g.pool.capacity - 1) * g.pool.block_size - 16
    r = g.generate(list(range(200, 200 + big)), SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert r.finish_reason is not None and len(r.token_ids) == 8
    assert g.tiers.parked(s.cache) > 0


@pytest.mark.parametrize("warm_mb", [256.0, 0.0], ids=["warm", "cold"])
def test_idle_session_moves_down_a_tier_and_resumes_exactly(gen, make_gen, warm_mb):
    _, ref1, ref2 = _two_turns(gen)  # a pool that never runs short
    g = make_gen(kv_cache_mb=12 * gen.pool.fmt.bytes_per_block() / 2**20, session_ttl_s=60, kv_warm_mb=warm_mb)
    assert g.pool.capacity == 12
    cold_dirs, cached = [], []

    def squeeze(s):
        cached.append(s.cache.length)
        _push_out(g, s)
        assert s.cache.length == cached[0]
        down = Tier.WARM if warm_mb else Tier.COLD
        tiers = {g.tiers.tier(s.cache, i) for i in range(4)}  # only as many as the request needed moved
        assert down in tiers and tiers <= {Tier.HOT, down}, tiers
        if not warm_mb:
            cold_dirs.append(g.tiers.cold_dir)
            # the session's blocks, and the prefix cache's copies of its full ones (sessions are
            # prefixes in the same index), moved down too
            files = len(os.listdir(g.tiers.cold_dir))
            assert g.tiers.parked(s.cache) <= files <= g.tiers.parked(s.cache) + g.scheduler.kv.prefix.blocks_tiered

    s, first, second = _two_turns(g, squeeze)
    assert first.token_ids == ref1.token_ids
    # the next turn brought the blocks back and reused every cached token: same tokens as never moved
    assert cached[0] >= 55 and second.usage.cached_tokens == cached[0]
    assert second.token_ids == ref2.token_ids
    assert g.tiers.parked(s.cache) == 0
    assert g.expire_sessions(now=time.monotonic() + 3600) == 1
    assert not g.sessions
    deadline = time.monotonic() + 10  # closing returns at once; the engine frees the blocks next
    while g.scheduler.kv.used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.scheduler.kv.used == 0
    g.close()
    assert all(not os.path.exists(d) for d in cold_dirs)  # the temp cold dir goes with the server


def test_metrics_after_streams_end(server, stub):
    for _ in range(2):
        list(stub.GenerateStream(request("Hello there", max_new_tokens=4, temperature=0.0)))
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.settings.metrics_port}/metrics", timeout=5).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in page.splitlines() if line.startswith("kvgen_")}
    assert values["kvgen_kv_blocks_used"] == 0
    assert values["kvgen_kv_blocks_total"] == server.gen.pool.capacity
    assert values["kvgen_requests_running"] == 0 and values["kvgen_requests_waiting"] == 0
    assert "kvgen_preemptions_total" in values
