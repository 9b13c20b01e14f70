"""SamplingParams.n: the prompt is computed once and the other samples fork from its KV blocks
(full blocks shared, the last one copied); each sample is what a request of its own with
seed + index would give; cancelling the first before the fork ends them all; nothing leaks."""

from __future__ import annotations

import pytest

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.sequence import FinishReason
from kvgen.errors import InvalidRequest
from tests.engine.test_batch_invariance import small_model

PROMPT = "the cat sat on the mat and the dog ran to the cat while it sat on the mat " * 3  # past one block


@pytest.fixture(scope="module")
def gen():
    g = Generator(*small_model(), EngineOptions())
    yield g
    g.close()


async def _all(gen: Generator, params: SamplingParams, prompt=PROMPT):
    reqs = await gen.requests(prompt, params)
    out = [await r.result() for r in reqs]
    for r in reqs:
        await r.released()
    return out


def test_each_sample_equals_a_request_of_its_own(gen):
    params = SamplingParams(temperature=0.9, seed=40, max_new_tokens=12, ignore_eos=True, n=4)
    samples = gen.bridge.run(_all(gen, params))
    assert [len(s.token_ids) for s in samples] == [12] * 4
    alone = [gen.generate(PROMPT, SamplingParams(temperature=0.9, seed=40 + i, max_new_tokens=12,
                                                 ignore_eos=True)).token_ids for i in range(4)]
    assert [s.token_ids for s in samples] == alone
    assert len({tuple(t) for t in alone}) > 1  # different seeds, different samples
    prompt_len = samples[0].usage.prompt_tokens
    assert [s.usage.cached_tokens for s in samples[1:]] == [prompt_len] * 3  # the prompt computed once
    assert gen.scheduler.kv.used == 0


def test_greedy_samples_agree_and_stop_on_their_own(gen):
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, n=3)
    samples = gen.bridge.run(_all(gen, params))
    assert len({tuple(s.token_ids) for s in samples}) == 1
    assert all(s.finish_reason == FinishReason.LENGTH for s in samples)


def test_cancelling_the_first_before_its_prompt_is_computed_ends_them_all(gen):
    async def run():
        reqs = await gen.requests(PROMPT * 6, SamplingParams(temperature=0.5, max_new_tokens=50, n=3))
        reqs[0].cancel()
        out = [await r.result() for r in reqs]
        for r in reqs:
            await r.released()
        return out
    out = gen.bridge.run(run())
    assert all(o.finish_reason == FinishReason.CANCELLED for o in out)
    assert gen.scheduler.kv.used == 0


def test_a_sample_cancelled_alone_leaves_the_others_running(gen):
    async def run():
        reqs = await gen.requests(PROMPT, SamplingParams(temperature=0.5, seed=1, max_new_tokens=30,
                                                         ignore_eos=True, n=3))
        reqs[1].cancel()
        out = [await r.result() for r in reqs]
        for r in reqs:
            await r.released()
        return out
    out = gen.bridge.run(run())
    assert out[1].finish_reason == FinishReason.CANCELLED
    assert [len(out[i].token_ids) for i in (0, 2)] == [30, 30]
    assert gen.scheduler.kv.used == 0


def test_n_is_checked(gen):
    with pytest.raises(InvalidRequest, match="sampling.n"):
        gen.bridge.run(_all(gen, SamplingParams(n=0)))
    with pytest.raises(InvalidRequest, match="sampling.n"):
        gen.bridge.run(_all(gen, SamplingParams(n=17)))
    with pytest.raises(InvalidRequest, match="sampling.n"):
        gen.generate(PROMPT, SamplingParams(n=2))  # one Request cannot carry two samples
