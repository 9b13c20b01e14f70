"""The engine loop (kvgen/engine/engine.py): where a step's tokens are picked.

On a GPU a batch whose every row is plain greedy takes its argmaxes on the device and copies one id
a row back (Engine.device_argmax, set from the model's device). Here the switch is turned on over a
CPU model, so the same branch runs on host tensors: its tokens must equal sample()'s, and one row
that asks for more (logprobs, sampling) sends the whole batch through sample() again.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.model import Model
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.tokenizer import TextTokenizer
from tests.conftest import run_together
from tests.tiny import CHATML_TEMPLATE, tiny_bpe_tokenizer, tiny_config, tiny_weights

PROMPTS = ["the cat sat on", "a b c d e f", "once upon a time there", "zz yy"]


@pytest.fixture(scope="module")
def tiny():
    tok = TextTokenizer(tiny_bpe_tokenizer(300), CHATML_TEMPLATE, bos_id=None, add_bos=False,
                        special_ids={0, 1, 2}, eos_token="<|im_end|>")
    cfg = tiny_config(vocab=300, layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, context=256)
    return Model(cfg, tiny_weights(cfg, seed=7)), tok


def _run(tiny, device_argmax: bool, params: list[SamplingParams]):
    gen = Generator(*tiny, EngineOptions(kv_dtype="fp32"))
    try:
        assert gen.engine.device_argmax is False  # a CPU model samples on the host
        gen.engine.device_argmax = device_argmax
        calls = []
        run = gen.engine.runner.run
        gen.engine.runner.run = lambda batch, on_host=True: (calls.append(on_host), run(batch, on_host))[1]
        # one engine batch (alone, a row would sum its floats otherwise, and might sample another token)
        requests = [(gen.tokenizer.encode(p), q, {}) for p, q in zip(PROMPTS, params, strict=True)]
        return run_together(gen, requests), calls
    finally:
        gen.close()


def test_a_plain_greedy_batch_takes_its_argmaxes_where_the_logits_are(tiny):
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    host, host_calls = _run(tiny, False, [greedy] * 4)
    there, there_calls = _run(tiny, True, [greedy] * 4)
    assert all(host_calls) and not any(there_calls)  # the decode steps left the logits where they were
    assert [e.token_ids for e in there] == [e.token_ids for e in host]


def test_a_row_asking_for_more_than_the_argmax_samples_the_whole_batch_on_the_host(tiny):
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    logprobs = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=3, max_new_tokens=8, ignore_eos=True)
    params = [greedy, logprobs, seeded, greedy]
    host, _ = _run(tiny, False, params)
    there, calls = _run(tiny, True, params)
    assert all(calls)
    assert [e.token_ids for e in there] == [e.token_ids for e in host]
    assert there[1].logprobs and len(there[1].logprobs) == 8


def test_threads_caps_the_kernels_threads_on_the_engine_thread(tiny):
    """THREADS=1 holds the kernels (Numba's pool, counted per launching thread) to one thread on the thread
    that launches them, as it holds torch's ops: co-located replicas must not spin against each other."""
    import numba

    seen = []
    gen = Generator(*tiny, EngineOptions(kv_dtype="fp32", threads=1))
    try:
        gen.engine.on_step = lambda batch, dt: seen.append(numba.get_num_threads())
        gen.generate("the cat", SamplingParams(temperature=0, max_new_tokens=2))
    finally:
        gen.close()
    assert seen and set(seen) == {1}


def test_a_finished_request_is_freed_when_its_caller_lets_go_not_by_the_cycle_collector(tiny):
    """A request and its sequence held each other (the sequence's callbacks are the request's, the request's
    cancel a closure over the sequence), so every finished one, with its sequence's table and events, lived until
    Python's cycle collector ran. Finished, read to the end, cancelled or not: gone with the caller's reference."""
    gen = Generator(*tiny, EngineOptions(kv_dtype="fp32"))

    async def one(how: str):
        req = await gen.request("the cat sat on", SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        if how == "cancelled":
            await req.__anext__()
            req.cancel()
        async for _ in req:
            pass
        await req.released()
        return weakref.ref(req), weakref.ref(req.seq)

    gc.collect()
    gc.disable()
    try:
        for how in ("read", "cancelled"):
            refs = gen.bridge.run(one(how))
            gen.bridge.run(asyncio.sleep(0.05))  # (the loop's own reference to the last callback goes)
            assert [r() for r in refs] == [None, None], how
    finally:
        gc.enable()
        gen.close()
