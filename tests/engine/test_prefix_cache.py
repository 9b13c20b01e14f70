"""The prefix cache through the engine on the embedded model: a request that starts like an
earlier one prefills only the rest and generates the same tokens as with the cache off; salts
separate tenants; preempted sequences find their own blocks again."""

from __future__ import annotations

import urllib.request

import pytest

from kvgen.client import request
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.model_files import embedded_model_path
from kvgen.engine.sampling import SamplingParams
from kvgen.v1 import generate_pb2 as pb
from tests.conftest import run_together

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def shared_prompt(gen, n: int = 500) -> list[int]:
    text = " ".join(f"Rule {i}: every request to the archive must name its shelf and row." for i in range(60))
    ids = gen.tokenize(text)
    assert len(ids) >= n
    return ids[:n]


def test_a_shared_500_token_prompt_is_prefilled_once(make_gen):
    on, off = make_gen(), make_gen(prefix_cache=False)
    system = shared_prompt(on)
    first = on.generate(system + on.tokenize(" Question one: where is the map?"), GREEDY)
    second_ids = system + on.tokenize(" Question two: who keeps the keys?")
    second = on.generate(second_ids, GREEDY)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= 496  # every full block of the shared 500 tokens
    assert second.token_ids == off.generate(second_ids, GREEDY).token_ids  # same tokens, cache or not
    # the whole request again: everything but its last token is reused
    again = on.generate(second_ids, GREEDY)
    assert again.usage.cached_tokens == (len(second_ids) - 1) // on.pool.block_size * on.pool.block_size
    assert again.token_ids == second.token_ids
    stats = on.scheduler.kv.prefix.stats
    assert stats.hits == 2 and stats.misses == 1 and stats.hit_tokens >= 496 * 2
    assert on.scheduler.kv.used == 0  # only the cache holds blocks now, and they count as free


def test_salts_never_share(make_gen):
    g = make_gen()
    ids = shared_prompt(g, 200)
    assert g.bridge.run(_cached(g, ids, "tenant-a")) == 0
    assert g.bridge.run(_cached(g, ids, "tenant-b")) == 0  # the same prompt, another tenant
    assert g.bridge.run(_cached(g, ids, "tenant-a")) == (len(ids) - 1) // 16 * 16


async def _cached(g, ids, salt) -> int:
    req = g.submit(ids, GREEDY, cache_salt=salt)
    out = await req.result()
    await req.released()
    return out.usage.cached_tokens


def test_preempted_streams_recompute_from_the_cache_and_stay_correct(make_gen):
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [f"Write something about topic {i}:" for i in range(6)]
    roomy = make_gen(kv_cache_mb=16)
    solo = [roomy.generate(p, params).token_ids for p in prompts]
    tight = make_gen(kv_cache_mb=10 * roomy.pool.fmt.bytes_per_block() / 2**20)
    out = tight.batch_generate(prompts, params)
    assert [r.token_ids for r in out] == solo
    assert tight.scheduler.preemptions > 0 and tight.scheduler.kv.used == 0


def test_grpc_reports_cached_tokens_and_metrics(server, stub):
    prompt = " ".join(f"Clause {i} of the agreement covers the delivery of goods." for i in range(20))
    a = stub.Generate(request(prompt + " Summarise clause 3.", temperature=0.0, max_new_tokens=4))
    b = stub.Generate(request(prompt + " Summarise clause 7.", temperature=0.0, max_new_tokens=4))
    assert a.usage.cached_tokens == 0 or a.usage.cached_tokens < b.usage.cached_tokens
    assert b.usage.cached_tokens >= 160
    salted = stub.Generate(request(prompt + " Summarise clause 7.", cache_salt="other", temperature=0.0,
                                   max_new_tokens=4))
    assert salted.usage.cached_tokens == 0 and salted.token_ids == b.token_ids
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).prefix_cache
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.settings.metrics_port}/metrics", timeout=5).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in page.splitlines() if line.startswith("kvgen_prefix")}
    assert values["kvgen_prefix_cache_hits_total"] >= 1 and values["kvgen_prefix_cache_hit_tokens_total"] >= 160
    assert values['kvgen_prefix_cache_blocks{where="pool"}'] > 0


# ---- sessions are pinned prefixes in the same index ------------------------------------------


def test_a_session_and_stateless_requests_share_prefixes_both_ways(make_gen):
    on, off = make_gen(), make_gen(prefix_cache=False)
    system = shared_prompt(on, 200)
    # stateless first: a new session starting the same way reuses its blocks
    on.generate(system + on.tokenize(" First question?"), GREEDY)
    s = on.new_session()
    turn = s.generate(system + on.tokenize(" Session question?"), GREEDY)
    assert turn.usage.cached_tokens >= 192
    # the session's conversation then serves a stateless request that resends it
    history = s.history + on.tokenize(" And then?")
    alone = on.generate(history, GREEDY)
    assert alone.usage.cached_tokens >= len(s.history) // 16 * 16 - 16
    assert alone.token_ids == off.generate(history, GREEDY).token_ids


def test_a_chat_session_never_writes_into_a_block_the_cache_shares(make_gen):
    """A chat turn re-renders the conversation, which can part from the cached tokens inside a
    full block the prefix cache holds: the session writes into its own copy."""
    on, off = make_gen(), make_gen(prefix_cache=False)
    s = on.new_session()
    first = [{"role": "system", "content": "You answer in one short sentence. " * 6},
             {"role": "user", "content": "What is the capital of France?"}]
    s.generate(first, GREEDY)
    s.generate([{"role": "user", "content": "And of Spain?"}], GREEDY)
    s.generate([{"role": "user", "content": "And of Italy?"}], GREEDY)
    again = on.generate(first, GREEDY)  # served from blocks the session's turns shared
    assert again.usage.cached_tokens > 0
    assert again.token_ids == off.generate(first, GREEDY).token_ids


@pytest.mark.heavy
def test_a_resent_chat_history_reuses_the_reply_bit_for_bit():
    """A stateless chat client resends its history with the reply as text: the prefix cache
    gives back the earlier request's whole blocks, the reply's included, and with the default
    settings (gguf weights: every prompt and decode row runs the fused step) the next reply's
    tokens and logprobs are bit for bit those of the cache off."""
    model = load_model(embedded_model_path(), "auto")
    on, off = Generator(*model, EngineOptions()), Generator(*model, EngineOptions(prefix_cache=False))
    try:
        _resend_history(on, off)
    finally:
        on.close()
        off.close()


def _resend_history(on, off):
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=1)
    history = [{"role": "user", "content": "Tell me one fact about the sea."}]
    first = on.generate(history, params)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And another one?"}]
    again = on.generate(history, params)
    bs = on.pool.block_size
    written = first.usage.prompt_tokens + len(first.token_ids) - 1  # the first request's K/V
    assert first.usage.prompt_tokens // bs * bs < again.usage.cached_tokens <= written  # the reply's blocks too
    alone = off.generate(history, params)
    assert again.token_ids == alone.token_ids
    assert [s.logprob for s in again.logprobs] == [s.logprob for s in alone.logprobs]


def test_requests_arriving_together_compute_their_shared_start_once(make_gen):
    """8 requests submitted at once that start with the same 40 tokens: one computes them, the
    others wait a step for its whole blocks (indexed as they are written) and share them, and
    every request's tokens are those of the cache off."""
    on, off = make_gen(), make_gen(prefix_cache=False)
    system = shared_prompt(on, 40)
    prompts = [system + on.tokenize(f" Question {i}: what is on shelf {i}?") for i in range(8)]

    def together(g):  # the engine thread takes the 8 in one go
        return run_together(g, [(p, GREEDY, {}) for p in prompts])

    got = together(on)
    cached = sorted(r.usage.cached_tokens for r in got)
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:])  # the whole blocks of the 40, at least
    assert [r.token_ids for r in got] == [r.token_ids for r in together(off)]
    # with the cache off nothing can be shared: nobody waits (all 8 prefill in the first step)
    steps = []
    off.engine.on_step = lambda batch, dt: steps.append(len(batch))
    together(off)
    assert steps[0] == 8
