"""Two real replicas behind the real smg binary (the `smg` wheel: `smg launch`) on loopback, over
the replicas' OpenAI HTTP ports (deploy/mesh.py, router="smg"): smg registers them by /health and
/v1/models and routes chat, completions and streams to them; policy cache_aware keeps a stateless
multi-turn chat on the replica that holds its prefix (each replica's own prefix-cache metrics say
so); a draining replica (/health 503) gets no new work once smg's next probe has seen it; a
replica killed mid-stream loses that stream only: calls that had not started are retried on the
other replica. A replica that answered a call is told by its own HTTP request counter."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import openai
import pytest

from deploy.mesh import Mesh, Smg
from kvgen.client import wait_serving

MODEL = "tiny-llama"
ROUTE_COUNT = "http_server_request_duration_seconds_count"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def mesh(tiny_gguf, tmp_path_factory):
    """r0 and r1 behind smg (cache_aware). A replica told to stop keeps serving for DRAIN_DELAY_S=4
    while its /health says 503 (smg probes every second): the drain test reads it meanwhile."""
    m = Mesh(2, tiny_gguf, tmp_path_factory.mktemp("smg-mesh"), router="smg", policy="cache_aware",
             THREADS="1", KV_CACHE_MB="16", GRACE_S="30", DRAIN_DELAY_S="4")
    try:
        m.start()
    except Exception:
        m.stop()
        raise
    yield m
    m.stop()


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _calls(r) -> float:
    """Completions a replica has answered (its HTTP route histogram's count, observed before the
    response is written, so it has moved by the time the caller reads the answer)."""
    return sum(r.counter(ROUTE_COUNT, http_route=route) for route in ("/v1/completions", "/v1/chat/completions"))


def _served(mesh: Mesh) -> dict[str, float]:
    """Replica name -> completions it has answered, of the live replicas."""
    return {r.name: _calls(r) for r in mesh.replicas if r.alive}


def _who(before: dict[str, float], after: dict[str, float]) -> str:
    moved = [name for name in after if after[name] - before.get(name, 0) > 0]
    assert len(moved) == 1, (before, after)
    return moved[0]


def _restart(mesh: Mesh, name: str) -> None:
    r = mesh.replica(name)
    if r.alive:
        r.proc.wait(40)
    r.start()
    mesh.wait_healthy()


def test_chat_completions_and_streams_through_smg_are_the_replicas_own(mesh):
    direct, routed = _sdk(mesh.replicas[0].url), _sdk(mesh.url)
    messages = [{"role": "user", "content": "Say something about the sea."}]
    want_chat = direct.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    got_chat = routed.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    assert got_chat.usage.completion_tokens == want_chat.usage.completion_tokens == 8
    want = direct.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    got = routed.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    assert got.choices[0].text == want.choices[0].text
    chunks = list(routed.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat_chunks = list(routed.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == \
        want_chat.choices[0].message.content
    assert [m.id for m in routed.models.list().data] == [MODEL]


@contextlib.contextmanager
def _one_long_call_in_flight(mesh: Mesh, messages: list[dict] | None = None):
    """A long stream through smg, started and left open: yields the replica serving it. With
    `messages`, a chat of those (smg routes it as it routes that conversation); else a new prompt."""
    client, long = _sdk(mesh.url), {"stream": True, "max_tokens": 1500, "temperature": 0,
                                     "extra_body": {"ignore_eos": True}}
    stream = (client.chat.completions.create(model=MODEL, messages=messages, **long) if messages
              else client.completions.create(model=MODEL, prompt="Count", **long))
    try:
        next(iter(stream))  # started
        running = {r.name: r.counter("kvgen_requests_running") for r in mesh.replicas}
        assert sorted(running.values()) == [0, 1], running
        yield max(running, key=running.get)
    finally:
        stream.close()
        mesh.smg.wait_idle()
        deadline = time.monotonic() + 10  # and the replica has counted the cut call among its answers
        while any(r.counter("kvgen_requests_running") for r in mesh.replicas) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)


def _conversations(mesh: Mesh, gateway: Smg, topics: list[str], turns: int,
                   beside_long_calls: bool = False) -> list[list[tuple[str, int, int, float]]]:
    """Stateless chats (the whole conversation resent each turn, as OpenAI-style clients do),
    interleaved turn by turn, each call made when the gateway counts nothing in flight: per
    conversation, per turn, (replica that answered, prompt tokens, cached tokens the reply reported,
    that replica's prefix-cache hit tokens for the call). With `beside_long_calls`, the first
    conversation starts while a long call keeps one replica busy, and every later turn is made while
    a long call of the same conversation keeps its replica busy and the other one idle."""
    client = _sdk(gateway.url)
    history = [[{"role": "system", "content": f"You talk about {t} and nothing else, at length."}] for t in topics]
    out: list[list] = [[] for _ in topics]

    def call(i: int, msgs: list[dict]) -> tuple[str, int, int, float]:
        before = _served(mesh)
        hits_before = {r.name: r.counter("kvgen_prefix_cache_hit_tokens_total") for r in mesh.replicas}
        reply = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
        who = _who(before, _served(mesh))
        hit = mesh.replica(who).counter("kvgen_prefix_cache_hit_tokens_total") - hits_before[who]
        msgs.append({"role": "assistant", "content": reply.choices[0].message.content})
        return who, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens, hit

    for turn in range(turns):
        for i, msgs in enumerate(history):
            msgs.append({"role": "user", "content": f"Tell me more about {topics[i]}, part {turn + 1}."})
            gateway.wait_idle()
            if beside_long_calls and turn == 0 and i == 0:
                # where a conversation smg has no prefix for goes is smg's choice, not kvgen's: below its
                # cache threshold it picks the worker with the smallest prefix tree (so it depends on the
                # traffic before), unless the loads differ by more than its balance thresholds
                with _one_long_call_in_flight(mesh):
                    out[i].append(call(i, msgs))
            elif beside_long_calls and turn > 0:
                with _one_long_call_in_flight(mesh, list(msgs)) as busy:
                    assert busy == out[i][0][0], "smg sent a conversation's long call away from its prefix"
                    out[i].append(call(i, msgs))
            else:
                out[i].append(call(i, msgs))
    return out


def _kept(conversation) -> bool:
    """Every turn after the first found at least the previous turn's whole prompt (in 16-token
    blocks) in the prefix cache of the replica that answered it, by that replica's own count."""
    return all(hit >= prev_prompt // 16 * 16 for (_, prev_prompt, _, _), (_, _, _, hit)
               in zip(conversation, conversation[1:], strict=False))


def test_cache_aware_keeps_a_stateless_chat_on_the_replica_holding_its_prefix(mesh):
    # The first conversation starts while a long call keeps one replica busy; every later turn of each
    # conversation is made while a long call of that conversation keeps its replica busy and the other
    # idle: a load balancer would send the turn to the idle one, cache_aware keeps it where its prefix is.
    # (Where smg sends a conversation it has no prefix for is its own choice: the worker with the smallest
    # prefix tree, below its cache threshold; a CI run saw it send the first one to the busy replica.)
    topics = ["volcanoes", "violins", "glaciers"]
    convs = _conversations(mesh, mesh.smg, topics, turns=3, beside_long_calls=True)
    for conv in convs:
        assert len({who for who, *_ in conv}) == 1, conv  # one replica for the whole conversation
        assert _kept(conv), conv
        assert all(cached > 0 for _, _, cached, _ in conv[1:]), conv  # and the replies say so (usage)

    # the same traffic under smg round_robin over the same replicas loses prefixes (three
    # conversations: an odd number, so that round robin cannot keep one on a replica by parity)
    rr = Smg([r.url for r in mesh.replicas], mesh.workdir, policy="round_robin")
    rr.start()
    try:
        rr.wait_workers({r.url: True for r in mesh.replicas})
        convs = _conversations(mesh, rr, ["canals", "comets", "cathedrals"], turns=3)
    finally:
        rr.stop()
    assert not all(_kept(conv) for conv in convs), convs


def _keep_calling(url: str, stop: threading.Event, failures: list, done: list) -> None:
    client = _sdk(url)
    while not stop.is_set():
        try:
            out = client.completions.create(model=MODEL, prompt="The lighthouse keeper", **GREEDY)
            done.append(out.choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - every failure is the finding
            failures.append(repr(e))


def test_a_draining_replica_gets_no_new_work_once_smg_has_seen_its_503(mesh):
    stop, failures, done = threading.Event(), [], []
    caller = threading.Thread(target=_keep_calling, args=(mesh.url, stop, failures, done))
    caller.start()
    try:
        r1 = mesh.replica("r1")
        time.sleep(0.5)
        drain_at = time.monotonic()
        r1.signal(signal.SIGTERM)  # /health 503 at once; calls still served for DRAIN_DELAY_S=4
        mesh.smg.wait_workers({r1.url: False}, timeout=10)
        seen_after = time.monotonic() - drain_at
        assert seen_after < 2 * Smg.HEALTH_INTERVAL_S + 1  # one probe interval, and the probe's own time
        time.sleep(0.3)  # a call smg had routed to r1 before its probe saw the 503 is answered by now
        before = _served(mesh)
        assert set(before) == {"r0", "r1"}  # r1 still answers: it is draining, not gone
        client = _sdk(mesh.url)
        for _ in range(10):
            assert client.completions.create(model=MODEL, prompt="The lighthouse keeper", **GREEDY).choices
        after = _served(mesh)
        assert after["r1"] == before["r1"]  # no new work for the draining replica
        assert after["r0"] - before["r0"] >= 10  # (the background caller's calls land on r0 too)
    finally:
        stop.set()
        caller.join(30)
    assert not failures and len(done) > 10, (failures, len(done))
    _restart(mesh, "r1")


def test_a_replica_killed_mid_stream_loses_that_stream_only(mesh):
    prompt = "Far away, beyond the mountains, there lived"
    client = _sdk(mesh.url)
    before = _served(mesh)
    stream = client.completions.create(model=MODEL, prompt=prompt, stream=True, max_tokens=1900, temperature=0,
                                       extra_body={"ignore_eos": True})
    events = iter(stream)
    assert next(events).choices[0].finish_reason is None  # started
    running = {r.name: r.counter("kvgen_requests_running") for r in mesh.replicas}
    victim = mesh.replica(max(running, key=running.get))
    assert running[victim.name] == 1 and _calls(victim) == before[victim.name]  # still in flight
    survivor = next(r for r in mesh.replicas if r is not victim)
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    # the stream that had started is cut, and the client sees that it was (no finish, no [DONE])
    finishes = []
    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a cut stream varies by where it is cut
        for ev in events:
            finishes.extend(c.finish_reason for c in ev.choices if c.finish_reason)
        raise AssertionError(f"the stream ended cleanly: {finishes}")
    assert "length" not in finishes
    # the same prefix, which cache_aware would send to the dead replica: retried on the survivor,
    # before and after smg's probe notices
    served = _calls(survivor)
    for _ in range(10):
        out = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert out.choices[0].finish_reason == "length"
    assert _calls(survivor) - served == 10
    mesh.smg.wait_workers({victim.url: False}, timeout=10)
    victim.start()
    wait_serving(victim.target, 60)
    mesh.wait_healthy()
