"""Batch composition never changes an output with fp32 weights (WEIGHT_DTYPE=fp32, and auto on a
model without GGUF blocks), with the default on a quantized GGUF (gguf weights: the block kernels
for every matmul, decode rows in the fused step), and every other setting at its default.

A seeded or greedy request gives the same tokens alone, submitted together with 8 other streams
(their prefills share its steps), and joining a batch of 8 that are already decoding; the others
differ in prompt length, output length and sampling. Two sessions whose turns interleave (or run
side by side) give the same tokens as the same sessions run one after the other.

Runs on a small random Llama (hidden 256, chunked prefill of its longest neighbour), in fp32 and
as a Q4_1 GGUF, in `make test`, and on the embedded SmolLM2 (the real model's matmul shapes, where a kernel's blocking
could depend on the batch's row count) in `make test-slow`: a 135M model's steps on shared CPUs
take minutes for these batches. Through the Python API's async handles on the Generator's bridge
loop.
"""

from __future__ import annotations

import asyncio

import gguf
import pytest

from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.model import Model
from kvgen.engine.request import Request
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.tokenizer import TextTokenizer
from tests.tiny import CHATML_TEMPLATE, tiny_bpe_tokenizer, tiny_config, tiny_weights, write_gguf

TARGET = "Once upon a time, in a small village by the sea,"
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=16, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
# 8 neighbours: prompts of 1 to ~120 tokens, every kind of sampling, all outliving the target by far
# (the engine decodes them while the target is still being submitted; they are cancelled after it).
OTHERS = [
    ("Hi", SamplingParams(temperature=0.0, max_new_tokens=248, ignore_eos=True)),
    ("The capital of France is", SamplingParams(temperature=1.0, seed=1, max_new_tokens=240, ignore_eos=True)),
    ("List three colours: " * 8, SamplingParams(temperature=0.7, top_k=20, seed=2, max_new_tokens=256,
                                                ignore_eos=True)),
    ("def fib(n):\n    ", SamplingParams(temperature=0.5, top_p=0.9, seed=3, max_new_tokens=244, ignore_eos=True)),
    ("A long story about a dragon and a knight who became friends. " * 10,
     SamplingParams(temperature=0.0, repetition_penalty=1.3, max_new_tokens=240, ignore_eos=True)),
    ("1 2 3 4 5 6 7 8 9", SamplingParams(temperature=1.2, seed=4, max_new_tokens=264, ignore_eos=True)),
    ([{"role": "user", "content": "Write a haiku about rain."}],
     SamplingParams(temperature=0.9, seed=5, max_new_tokens=248, ignore_eos=True)),
    ("Why is the sky blue?", SamplingParams(temperature=0.8, seed=6, logprobs=3, max_new_tokens=252,
                                            ignore_eos=True)),
]


SMALL = tiny_config(vocab=300, layers=3, hidden=256, heads=8, kv_heads=2, ffn=704, context=2048)


def small_tokenizer():
    return TextTokenizer(tiny_bpe_tokenizer(300), CHATML_TEMPLATE, bos_id=None, add_bos=False,
                         special_ids={0, 1, 2}, eos_token="<|im_end|>")


def small_model():
    return Model(SMALL, tiny_weights(SMALL, seed=17)), small_tokenizer()


def small_gguf_model(path):
    """small_model's weights in a Q4_1 GGUF, loaded with the default WEIGHT_DTYPE (auto: gguf)."""
    write_gguf(path, SMALL, tiny_weights(SMALL, seed=17), tiny_bpe_tokenizer(300),
               qtype=gguf.GGMLQuantizationType.Q4_1)
    model = load_model(str(path))[0]
    assert model.weight_dtype == "gguf"
    return model, small_tokenizer()


@pytest.fixture(scope="module", params=["small", "small-gguf", pytest.param("embedded", marks=pytest.mark.slow),
                                        pytest.param("embedded-gguf", marks=pytest.mark.slow)])
def engine(request, tmp_path_factory):
    """An engine of its own with every default setting, over an fp32 model or a Q4_1 GGUF."""
    if request.param == "small":
        pair = small_model()
    elif request.param == "small-gguf":
        pair = small_gguf_model(tmp_path_factory.mktemp("invariance") / "small.gguf")
    elif request.param == "embedded":
        pair = request.getfixturevalue("embedded_fp32")
    else:
        pair = request.getfixturevalue("embedded")  # the default: the file's blocks
    assert pair[0].weight_dtype == ("gguf" if request.param.endswith("gguf") else "fp32")
    g = Generator(*pair, EngineOptions())
    if request.param.endswith("gguf"):  # decode rows run fused, prompt chunks through the kernels
        assert g.engine.runner.fused is not None
    yield g
    g.close()


async def _finish(reqs: list[Request]) -> None:
    for r in reqs:
        r.cancel()
    for r in reqs:
        await r.released()


async def _alone(gen: Generator, params: SamplingParams) -> list[int]:
    req = await gen.request(TARGET, params)
    out = await req.result()
    await req.released()
    return out.token_ids


async def _among(gen: Generator, params: SamplingParams, join_running: bool) -> list[int]:
    others = [await gen.request(p, s) for p, s in OTHERS]
    if join_running:  # each has its first token: prefilled, and decoding when the target arrives
        for r in others:
            await r.__anext__()
    target = await gen.request(TARGET, params)
    out = await target.result()
    # the claim is about a full batch: every neighbour was still generating when the target ended
    assert not any(r.finished for r in others), [r.finished for r in others]
    await _finish([*others, target])
    assert gen.scheduler.kv.used == 0
    return out.token_ids


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["seeded", "greedy"])
def test_same_tokens_alone_and_in_a_batch(engine, params):
    run = engine.bridge.run
    alone = run(_alone(engine, params))
    assert len(alone) == params.max_new_tokens
    assert run(_among(engine, params, join_running=False)) == alone
    assert run(_among(engine, params, join_running=True)) == alone
    assert run(_alone(engine, params)) == alone  # and nothing the batches left behind changes it


TURNS = {"a": ["Hello! What is your name?", "Tell me a fun fact.", "Thanks, and another one?"],
         "b": ["Write a word that rhymes with cat.", "Now one with dog.", "And with tree?"]}
TURN = SamplingParams(temperature=0.8, seed=99, max_new_tokens=10, ignore_eos=True)


async def _turn(session, text: str) -> tuple[list[int], int]:
    req = await session.request([{"role": "user", "content": text}], TURN)
    out = await req.result()
    await req.released()
    return out.token_ids, out.usage.cached_tokens


async def _sessions(gen: Generator, order: str) -> dict[str, list]:
    """Both conversations' (tokens, cached tokens) per turn; order: one after the other,
    alternating turns, or each pair of turns at the same time."""
    sessions = {name: gen.new_session() for name in TURNS}
    got: dict[str, list] = {name: [] for name in TURNS}
    try:
        if order == "sequential":
            for name, turns in TURNS.items():
                for text in turns:
                    got[name].append(await _turn(sessions[name], text))
        else:
            for i in range(len(TURNS["a"])):
                if order == "alternating":
                    for name in TURNS:
                        got[name].append(await _turn(sessions[name], TURNS[name][i]))
                else:
                    pair = await asyncio.gather(*(_turn(sessions[n], TURNS[n][i]) for n in TURNS))
                    for name, out in zip(TURNS, pair, strict=True):
                        got[name].append(out)
    finally:
        loop = asyncio.get_running_loop()
        for s in sessions.values():
            freed = asyncio.Event()
            gen.close_session(s.session_id, on_freed=lambda f=freed: loop.call_soon_threadsafe(f.set))
            await freed.wait()
    assert gen.scheduler.kv.used == 0
    return got


def test_interleaved_sessions_equal_sequential(engine):
    run = engine.bridge.run
    sequential = run(_sessions(engine, "sequential"))
    for name, turns in sequential.items():  # later turns reused the session's cache
        # (a first turn may reuse what the prefix cache holds: the other session's start)
        assert [cached > 0 for _, cached in turns[1:]] == [True, True], (name, turns)
    def tokens(runs):  # (what the prefix cache held differs from run to run: it outlives them)
        return {name: [t for t, _ in turns] for name, turns in runs.items()}
    assert tokens(run(_sessions(engine, "alternating"))) == tokens(sequential)
    assert tokens(run(_sessions(engine, "side_by_side"))) == tokens(sequential)

