"""Speculative decoding inside the engine changes no output: greedy tokens equal plain decoding
for every drafter, alone and among 8 concurrent streams; sampled tokens keep the target's
distribution; rejected drafts, preemption and cancellation leave no KV block behind.

A small random fp32 Llama carries the breadth (40 prompts, a draft model that agrees with it and
one that mostly does not); the embedded SmolLM2 carries the oracle prompts (with its own int4
weights as the draft model, the case the issue names), all of them under `make test-slow`."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from safetensors.torch import save_file

from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.model import Model
from kvgen.engine.model_files import embedded_model_path
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_batch_invariance import small_model
from tests.engine.test_oracle import CHATS, RAW, hf_greedy
from tests.tiny import tiny_config, tiny_weights

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
WORDS = "the cat sat on a mat and then the dog ran to the cat while it sat on the mat".split()


def _prompts(n: int) -> list[str]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 40))]
        out.append(" ".join(words * (1 + i % 3)))  # some repeat themselves: prompt lookup has matches
    return out


@pytest.fixture(scope="module")
def small():
    return small_model()


def _draft_of(model: Model, seed: int | None) -> Model:
    """The target's own weights (seed None: a draft that always agrees), or another random
    model with its vocabulary (mostly disagrees)."""
    if seed is None:
        return model
    cfg = tiny_config(vocab=model.cfg.vocab_size, layers=1, hidden=64, heads=4, kv_heads=2, ffn=128,
                      context=model.cfg.context_length)
    return Model(cfg, tiny_weights(cfg, seed=seed))


def _generate(gen: Generator, prompts, params, concurrent: int) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), concurrent):
        for r in gen.batch_generate(prompts[i:i + concurrent], params):
            assert not isinstance(r, Exception), r
            out.append(r.token_ids)
    return out


def eagle_head(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random head in EAGLE-1's layout for a model of config cfg (no trained one exists here)."""
    g = torch.Generator().manual_seed(seed)
    h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05
    p = "layers.0."
    return {"fc.weight": w(h, 2 * h), p + "self_attn.q_proj.weight": w(cfg.num_heads * hd, h),
            p + "self_attn.k_proj.weight": w(cfg.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": w(cfg.num_kv_heads * hd, h), p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(ffn, h), p + "mlp.up_proj.weight": w(ffn, h),
            p + "mlp.down_proj.weight": w(h, ffn), p + "post_attention_layernorm.weight": torch.ones(h)}


@pytest.fixture(scope="module")
def head_file(small, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eagle") / "head.safetensors"
    save_file(eagle_head(small[0].cfg), str(path))
    return str(path)


def _spec_options(drafter: str, head_file: str, **kw) -> tuple[EngineOptions, str]:
    mode = drafter.split("-")[0]
    return EngineOptions(speculative=mode, eagle_head=head_file if mode == "eagle" else "", **kw), mode


@pytest.mark.parametrize("concurrent", [1, 8])
@pytest.mark.parametrize("drafter", ["ngram", "draft-agrees", "draft-random", "eagle-random"])
def test_greedy_equals_plain_decoding_small_model(small, head_file, drafter, concurrent):
    prompts = _prompts(40)
    plain = Generator(*small, EngineOptions())
    opts, mode = _spec_options(drafter, head_file)
    draft = _draft_of(small[0], 5 if "random" in drafter else None) if mode == "draft" else None
    spec = Generator(*small, opts, draft_model=draft)
    try:
        want = _generate(plain, prompts, GREEDY, concurrent)
        got = _generate(spec, prompts, GREEDY, concurrent)
        seqs_drafted = spec.engine.steps < plain.engine.steps
        assert spec.engine.drafted_tokens > 0  # every drafter proposed, and was checked
    finally:
        plain.close()
        spec.close()
    assert got == want
    if "random" not in drafter:
        assert seqs_drafted  # drafts were accepted: fewer steps for the same tokens


def test_stops_max_tokens_and_logprobs_behave_the_same(small):
    prompt = _prompts(3)[2]
    plain = Generator(*small, EngineOptions())
    spec = Generator(*small, EngineOptions(speculative="draft"), draft_model=small[0])
    try:
        base = plain.generate(prompt, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
        stop_id = base.token_ids[7]
        stop_text = plain.tokenizer.decode(base.token_ids[10:12])
        for params in (SamplingParams(temperature=0, max_new_tokens=13, ignore_eos=True, logprobs=2),
                       SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=[stop_id]),
                       SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop_strings=[stop_text])):
            a, b = plain.generate(prompt, params), spec.generate(prompt, params)
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            # logprobs: a verified row is computed in a chunk of rows, so its last bits may differ
            assert [(s.token_id, [t for t, _ in s.top]) for s in b.logprobs] == \
                [(s.token_id, [t for t, _ in s.top]) for s in a.logprobs]
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-3)
                assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-3)
        assert spec.engine.scheduler.kv.used == 0
    finally:
        plain.close()
        spec.close()


def _pair_counts(gen: Generator, prompt: str, params: list[SamplingParams]) -> dict:
    counts: dict = {}
    for i in range(0, len(params), 64):
        for r in gen.batch_generate([prompt] * len(params[i:i + 64]), params[i:i + 64]):
            key = tuple(r.token_ids[1:3])
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("drafter", ["draft-random", "eagle-random"])
def test_sampled_output_keeps_the_target_distribution_with_a_bad_draft(small, head_file, drafter):
    """The 2nd and 3rd tokens (the first ones a draft decides on) of 1,200 seeded requests with
    a draft model that mostly disagrees, against 1,200 without speculation: a chi-square test of
    homogeneity over the (2nd, 3rd) pairs."""
    prompt = "the cat sat on"
    n = 1200
    params = [SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    plain = Generator(*small, EngineOptions(speculative_max_batch=n))
    opts, mode = _spec_options(drafter, head_file, speculative_max_batch=n, speculative_tokens=2)  # all queued draft
    spec = Generator(*small, opts, draft_model=_draft_of(small[0], 9) if mode == "draft" else None)
    try:
        a = _pair_counts(plain, prompt, params)
        b = _pair_counts(spec, prompt, [SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, ignore_eos=True,
                                                       seed=10_000 + s) for s in range(n)])
        assert spec.engine.drafter.pool.used == 0
    finally:
        plain.close()
        spec.close()
    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 10]
    stat = 0.0
    for k in keys:
        tot = a.get(k, 0) + b.get(k, 0)
        for obs in (a.get(k, 0), b.get(k, 0)):
            exp = tot / 2
            stat += (obs - exp) ** 2 / exp
    dof = max(1, len(keys) - 1)
    # 99.9% quantile of chi-square(dof) (Wilson-Hilferty)
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert stat < limit, (stat, limit, dof)


@pytest.mark.parametrize("drafter", ["draft-random", "eagle-random"])
def test_no_block_is_left_behind(small, head_file, drafter):
    """Small pool (preemptions), drafts of every kind of acceptance, half the requests cancelled
    mid-flight: afterwards only the prefix cache holds blocks, and the draft pool none."""
    opts, mode = _spec_options(drafter, head_file, kv_cache_mb=1.0, max_running=16, speculative_max_batch=16)
    gen = Generator(*small, opts, draft_model=_draft_of(small[0], 11) if mode == "draft" else None)
    try:
        async def run():
            reqs = [await gen.request(p, SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i,
                                                        max_new_tokens=40, ignore_eos=True))
                    for i, p in enumerate(" ".join(p.split()[:60]) for p in _prompts(16))]
            await asyncio.sleep(0.05)
            for r in reqs[::2]:
                r.cancel()
            for r in reqs:
                await r.result()
                await r.released()
        gen.bridge.run(run())
        assert gen.scheduler.preemptions > 0
        assert gen.scheduler.kv.used == 0
        assert gen.engine.drafter.pool.used == 0 and gen.engine.drafter.sequences == 0
    finally:
        gen.close()


# ---- the embedded model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_draft():
    return load_model(embedded_model_path(), "int4")[0]


def _oracle_check(embedded, int4_draft, prompts, concurrent, hf_model):
    """Each drafter's greedy tokens equal plain decoding's (the draft model at int4 weights, and at
    the default DRAFT_WEIGHT_DTYPE, gguf blocks); they also equal transformers' greedy generate on
    the same GGUF (the oracle), prompt by prompt."""
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    plain = Generator(*embedded, EngineOptions())
    gens = [Generator(*embedded, EngineOptions(speculative="ngram")),
            Generator(*embedded, EngineOptions(speculative="draft"), draft_model=int4_draft),
            Generator(*embedded, EngineOptions(speculative="draft"))]  # the default draft: its own Q4_1 blocks
    try:
        assert gens[2].engine.drafter.model.weight_dtype == "gguf"
        want = _generate(plain, prompts, params, concurrent)
        for g in gens:
            got = _generate(g, prompts, params, concurrent)
            assert got == want
            assert g.scheduler.kv.used == 0
        for g in gens[1:]:  # each draft model did draft, and was right
            assert g.engine.drafted_tokens > 0 and g.engine.accepted_tokens > 0
        for prompt, tokens in zip(prompts, got, strict=True):
            assert tokens == hf_greedy(hf_model[0], plain.tokenize(prompt), 32), prompt
    finally:
        for g in [plain, *gens]:
            g.close()


@pytest.mark.slow  # for CI's time: test_prompt_lookup_over_the_default_weights_equals_plain_decoding stays
def test_greedy_equals_plain_on_the_embedded_model(embedded, int4_draft, hf_model):
    _oracle_check(embedded, int4_draft, [RAW[4], RAW[1]], 1, hf_model)


@pytest.mark.slow
@pytest.mark.parametrize("concurrent", [1, 8])
def test_greedy_equals_plain_on_oracle_prompts_and_32_more(embedded, int4_draft, hf_model, concurrent):
    prompts = RAW + CHATS + [f"Item {i}: " + " ".join(WORDS[i % 7:i % 7 + 9]) + ". Repeat it:" for i in range(32)]
    _oracle_check(embedded, int4_draft, prompts, concurrent, hf_model)


def test_a_request_may_opt_in_or_out(embedded):
    prompt = "Copy: red, green, blue, cyan, magenta, yellow. Copy: red, green, blue,"
    off_server = Generator(*embedded, EngineOptions())
    on_server = Generator(*embedded, EngineOptions(speculative="ngram"))
    try:
        base = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        opt_in = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, speculative=True)
        opt_out = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, speculative=False)
        a = off_server.generate(prompt, base)
        plain_steps = off_server.engine.steps
        b = off_server.generate(prompt, opt_in)
        assert b.token_ids == a.token_ids and off_server.engine.steps - plain_steps < plain_steps  # drafted
        c = on_server.generate(prompt, opt_out)
        assert c.token_ids == a.token_ids and on_server.engine.steps == plain_steps  # one token per step
    finally:
        off_server.close()
        on_server.close()


def test_bad_speculative_setting_is_refused(small, tmp_path):
    with pytest.raises(ValueError, match="SPECULATIVE"):
        Generator(*small, EngineOptions(speculative="eagle2"))
    other = Model(tiny_config(vocab=64, layers=1, hidden=64, heads=4, kv_heads=2, ffn=128),
                  tiny_weights(tiny_config(vocab=64, layers=1, hidden=64, heads=4, kv_heads=2, ffn=128)))
    with pytest.raises(ValueError, match="vocabulary"):
        Generator(*small, EngineOptions(speculative="draft"), draft_model=other)
    with pytest.raises(ValueError, match="EAGLE_HEAD"):
        Generator(*small, EngineOptions(speculative="eagle"))
    wrong = tmp_path / "wrong.safetensors"
    save_file(eagle_head(other.cfg), str(wrong))
    with pytest.raises(ValueError, match="fc.weight"):
        Generator(*small, EngineOptions(speculative="eagle", eagle_head=str(wrong)))
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in eagle_head(small[0].cfg).items() if "down_proj" not in k}, str(partial))
    with pytest.raises(ValueError, match="down_proj"):
        Generator(*small, EngineOptions(speculative="eagle", eagle_head=str(partial)))
    bf16 = Model(small[0].cfg, tiny_weights(small[0].cfg), weight_dtype="bf16")  # refused at start, not mid-request
    head = tmp_path / "head.safetensors"
    save_file(eagle_head(small[0].cfg), str(head))
    with pytest.raises(ValueError, match="fp32"):
        Generator(bf16, small[1], EngineOptions(speculative="eagle", eagle_head=str(head)))


def test_prompt_lookup_over_the_default_weights_equals_plain_decoding():
    """The default weights (gguf blocks) verify drafts in the fused decode step (k + 1 rows of one
    sequence): greedy tokens equal plain decoding, alone and among 4 streams, drafts were verified,
    and no block is left behind."""
    model = load_model(embedded_model_path(), "auto")
    assert model[0].weight_dtype == "gguf"
    prompts = ["Copy: red, green, blue, cyan, magenta, yellow, black. Copy: red, green,",
               "The list: apple pear plum fig kiwi lime. The list again: apple pear", RAW[1], RAW[4]]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    plain = Generator(*model, EngineOptions())
    ngram = Generator(*model, EngineOptions(speculative="ngram"))
    try:
        for concurrent in (1, 4):
            want = _generate(plain, prompts, params, concurrent)
            assert _generate(ngram, prompts, params, concurrent) == want
        assert ngram.engine.drafted_tokens > 0 and ngram.engine.accepted_tokens > 0
        assert ngram.scheduler.kv.used == 0
    finally:
        plain.close()
        ngram.close()
