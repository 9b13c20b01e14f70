"""Sessions that outgrow the context keep going (llama.cpp's context shift): a raw session drops
its oldest whole blocks after the kept head and re-rotates the keys after them, reusing their KV;
a chat session drops its oldest exchanges after the system prompt. The turn's output equals a
fresh request over the same shortened tokens."""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.model import Model
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.tokenizer import TextTokenizer
from tests.tiny import CHATML_TEMPLATE, tiny_bpe_tokenizer, tiny_config, tiny_weights

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
TEXT = "the cat sat on a mat and then the dog ran to the cat while it sat on the mat again "


def _model(context: int = 256):
    tok = TextTokenizer(tiny_bpe_tokenizer(300), CHATML_TEMPLATE, bos_id=None, add_bos=False,
                        special_ids={0, 1, 2}, eos_token="<|im_end|>")
    cfg = tiny_config(vocab=300, layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, context=context)
    return Model(cfg, tiny_weights(cfg, seed=23)), tok


def _shift_twice(gen: Generator, params: SamplingParams):
    """A session with a short head, fed turns until its history got shorter twice (two shifts).
    Returns the session and its last turn's output."""
    s = gen.new_session()
    s.generate("system: be brief. " * 2, GREEDY)
    shifts, last = 0, 0
    while shifts < 2:
        out = s.generate(" and then " + TEXT, params)
        shifts += out.usage.prompt_tokens < last  # the history got shorter: a shift
        last = out.usage.prompt_tokens
    return s, out


def _kv(gen: Generator, cache, n: int) -> torch.Tensor:
    """The first n positions' K/V of a table, every layer: [layers, 2, n, kv heads, head dim]."""
    x = gen.pool.store["kv"][torch.tensor(cache.blocks)].permute(1, 2, 0, 3, 4, 5)
    return x.reshape(*x.shape[:2], -1, *x.shape[-2:])[:, :, :n].clone()


@pytest.mark.parametrize("kv", ["fp32", "q4"])
def test_a_raw_session_shifts_and_matches_a_fresh_request(kv):
    model, tok = _model()
    gen = Generator(model, tok, EngineOptions(kv_dtype=kv, prefix_cache=False))
    try:
        s = gen.new_session()
        first = s.generate("system: be brief. " * 2, GREEDY)
        head = first.usage.prompt_tokens
        lengths = []
        for turn in range(12):
            out = s.generate(f" turn {turn}: " + TEXT, GREEDY)  # never INVALID_ARGUMENT
            assert len(out.token_ids) == 24
            assert out.usage.prompt_tokens + 24 <= model.cfg.context_length
            lengths.append(out.usage.prompt_tokens)
        assert any(b < a for a, b in zip(lengths, lengths[1:], strict=False))  # it shifted
        assert s.history[:head] == tok.encode("system: be brief. " * 2)  # the head survives every shift
        # the last turn again from scratch, over the same (shifted) tokens: the same continuation
        prompt = s.history[:-24]
        fresh = gen.generate(prompt, GREEDY)
        assert fresh.token_ids == s.history[-24:]
        if kv == "fp32":  # re-rotated keys: the shifted history's KV was reused, not recomputed
            assert out.usage.cached_tokens > 64
    finally:
        gen.close()


def test_re_rotated_keys_are_a_fresh_prefills_at_the_first_layer():
    """fp32, no prefix cache: after shifts, the kept positions' layer-0 keys and values equal a
    fresh prefill's of the shortened tokens at their new positions (1e-5): the move and the RoPE
    re-rotation are exact. Deeper layers' K/V still carry what was dropped (their attention saw it
    when they were computed), as in llama.cpp, so a continuation after a re-rotating shift is
    close to a fresh request's, not equal to it (a recomputing shift is equal)."""
    model, tok = _model()
    gen = Generator(model, tok, EngineOptions(kv_dtype="fp32", prefix_cache=False))
    try:
        s, out = _shift_twice(gen, GREEDY)
        assert out.usage.cached_tokens > 64  # the kept history's KV was moved, not recomputed
        n = s.cache.length
        tokens = s.tokens
        assert len(tokens) == n + 1  # every token but the last generated one is cached
        fresh = gen.new_session()
        fresh.generate(tokens[:n], SamplingParams(temperature=0, max_new_tokens=1))
        moved, want = _kv(gen, s.cache, n), _kv(gen, fresh.cache, n)
        torch.testing.assert_close(moved[0], want[0], rtol=1e-5, atol=1e-5)
        assert (moved[-1] - want[-1]).abs().max() > 1e-3  # the deepest layer
    finally:
        gen.close()


def test_a_recomputing_shift_equals_a_fresh_prefill_at_every_layer():
    """With the prefix cache on (the default), a session's blocks are shared with the index, so a
    shift keeps the head and computes what follows it again: every layer's kept K/V then equals a
    fresh prefill's of the shortened tokens at their new positions, and the turn's logprobs a
    fresh request's over the same prompt (fp32, 1e-4; the fresh runs in an engine without the
    prefix cache, so nothing of the session's is reused)."""
    model, tok = _model()
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=5)
    gen = Generator(model, tok, EngineOptions(kv_dtype="fp32"))
    try:
        s, out = _shift_twice(gen, params)
        tokens, n = s.tokens, s.cache.length
        kept = _kv(gen, s.cache, n)
    finally:
        gen.close()
    gen = Generator(model, tok, EngineOptions(kv_dtype="fp32", prefix_cache=False))
    try:
        fresh = gen.generate(tokens[:out.usage.prompt_tokens], params)  # the last turn, from scratch
        assert fresh.token_ids == out.token_ids
        for a, b in zip(out.logprobs, fresh.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-4
        again = gen.new_session()
        again.generate(tokens[:n], SamplingParams(temperature=0, max_new_tokens=1))
        torch.testing.assert_close(kept, _kv(gen, again.cache, n), rtol=1e-4, atol=1e-4)
    finally:
        gen.close()


def test_a_chat_session_drops_its_oldest_exchanges_and_keeps_the_system_prompt():
    model, tok = _model()
    gen = Generator(model, tok, EngineOptions())
    try:
        s = gen.new_session()
        system = {"role": "system", "content": "You are terse."}
        s.generate([system, {"role": "user", "content": TEXT}], GREEDY)
        for turn in range(6):
            out = s.generate([{"role": "user", "content": f"again {turn}: {TEXT}"}], GREEDY)
            assert out.usage.prompt_tokens + 24 <= model.cfg.context_length
        s.generate([{"role": "user", "content": "last"}], GREEDY)  # takes turn 5's reply in
        assert s.messages[0] == system and len(s.messages) < 14
        assert s.messages[-2]["content"].startswith("again 5")
    finally:
        gen.close()


def test_a_new_prompt_longer_than_the_context_is_still_refused():
    from kvgen.errors import InvalidRequest

    model, tok = _model()
    gen = Generator(model, tok, EngineOptions())
    try:
        s = gen.new_session()
        s.generate("hello", GREEDY)
        with pytest.raises(InvalidRequest, match="max_new_tokens"):
            s.generate(TEXT * 20, GREEDY)
    finally:
        gen.close()
