"""The batched sampler: each row behaves as if sampled alone, whatever else is in the batch."""

from __future__ import annotations

import torch

from kvgen.engine.sampling import SamplingParams, sample


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 50)
    out = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4, [[]] * 4)
    assert [o.token_id for o in out] == logits.argmax(-1).tolist()


def test_a_seeded_row_is_independent_of_its_batch():
    logits = torch.randn(5, 200)
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.8)
    alone = sample(logits[2:3], [p], [gen(11)], [[]])[0].token_id
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.5), p, SamplingParams(top_p=0.3),
              SamplingParams(temperature=0.5, repetition_penalty=1.3)]
    batch = sample(logits, others, [None, gen(1), gen(11), gen(2), gen(3)], [[]] * 4 + [[1, 2, 3]])
    assert batch[2].token_id == alone


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.linspace(0, 5, 100)[None, :].repeat(2, 1)  # token 99 most likely
    draws_k, draws_p = set(), set()
    for seed in range(300):
        a, b = sample(logits, [SamplingParams(top_k=3), SamplingParams(top_p=0.2)], [gen(seed), gen(seed + 1000)],
                      [[], []])
        draws_k.add(a.token_id)
        draws_p.add(b.token_id)
    assert draws_k == {97, 98, 99}
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    n_nucleus = int(((probs.cumsum(0) - probs) < 0.2).sum())
    assert draws_p <= set(range(100 - n_nucleus, 100)) and len(draws_p) > 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    g = gen(0)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams()], [g], [[]])[0].token_id] += 1
    torch.testing.assert_close(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04, rtol=0)


def test_repetition_penalty_only_touches_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 1.9, 0.5]])
    out = sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], [None], [[0, 1]])
    assert out[0].token_id == 2  # 2.0 -> 1.0 for the seen token 0, so 1.9 wins
    none = sample(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], [None], [[3]])
    assert none[0].token_id == 0


def test_logprobs_are_of_the_model_distribution():
    logits = torch.randn(2, 30)
    out = sample(logits, [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)], [None, None],
                 [[], []])
    logp = torch.log_softmax(logits, -1)
    assert abs(out[0].logprob - logp[0].max().item()) < 1e-6
    assert [t for t, _ in out[0].top] == logp[0].topk(3).indices.tolist()
    assert out[1].top is None


def test_settings_from_env_parse_types():
    from kvgen.service.settings import Settings

    s = Settings.from_env({"PORT": "6000", "CUDA_GRAPHS": "0", "KV_DTYPE": "fp8", "KV_CACHE_MB": "64.5"})
    assert (s.port, s.engine.cuda_graphs, s.engine.kv_dtype, s.engine.kv_cache_mb) == (6000, False, "fp8", 64.5)
    assert Settings.from_env({"CUDA_GRAPHS": "true"}).engine.cuda_graphs is True


# --- the controls peers have, against transformers' logits processors (vLLM's formula where
# transformers has none) ---

def _hf(processor, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([ids]), logits.clone())


def test_adjusted_logits_match_transformers_processors():
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    from kvgen.engine.sampling import adjust

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 64, generator=g) * 3
    prompt, output = [3, 5, 5, 9], [9, 11, 11, 11, 2]
    ours = adjust(logits, [SamplingParams(repetition_penalty=1.7)], [prompt + output])
    torch.testing.assert_close(ours, _hf(RepetitionPenaltyLogitsProcessor(1.7), prompt + output, logits))
    bias = {4: 2.5, 7: -100.0, 63: 0.25}
    ours = adjust(logits, [SamplingParams(logit_bias=bias)])
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    torch.testing.assert_close(ours, _hf(hf, prompt, logits))
    for generated in (2, 5):  # below and at min_new_tokens
        out = output[:generated]
        ours = adjust(logits, [SamplingParams(min_new_tokens=5)], outputs=[out], stops=[{2, 13}])
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 5, [2, 13])
        torch.testing.assert_close(ours, _hf(hf, prompt + out, logits))


def test_presence_and_frequency_penalties_follow_vllm():
    """logits[t] -= frequency_penalty * count(t in output) + presence_penalty * (count > 0); the
    prompt does not count (vLLM's apply_penalties, OpenAI's formula)."""
    from kvgen.engine.sampling import adjust

    logits = torch.randn(1, 32)
    output = [4, 4, 4, 7]
    ours = adjust(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[1, 2] + output],
                  outputs=[output])
    want = logits.clone()
    want[0, 4] -= 3 * 0.25 + 0.5
    want[0, 7] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(ours, want)


def test_the_sampled_distribution_matches_transformers_warpers():
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from kvgen.engine.sampling import distribution

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 200, generator=g) * 2
    for t, k, p, m in [(0.7, 0, 1.0, 0.1), (1.3, 20, 1.0, 0.05), (1.0, 0, 0.8, 0.0), (0.9, 10, 0.7, 0.2),
                       (1.0, 0, 1.0, 0.3)]:
        warpers = LogitsProcessorList([TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else [])
                                      + ([TopPLogitsWarper(p)] if p < 1 else []) + ([MinPLogitsWarper(m)] if m else []))
        want = torch.softmax(warpers(torch.tensor([[0]]), logits.clone()), -1)
        got = distribution(logits, [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=str((t, k, p, m)))


def test_min_new_tokens_never_empties_a_constrained_row():
    """A constraint that allows only a stop token now wins over min_new_tokens."""
    from kvgen.engine.sampling import adjust

    logits = torch.randn(1, 64)
    only_eos = torch.zeros((1, 2), dtype=torch.int32)
    only_eos[0, 0] = 1 << 2  # token 2
    out = adjust(logits, [SamplingParams(min_new_tokens=5)], outputs=[[]], stops=[{2}], bitmask=only_eos, masked=[0])
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [2]
    either = only_eos.clone()
    either[0, 1] = 1  # token 32 too
    out = adjust(logits, [SamplingParams(min_new_tokens=5)], outputs=[[]], stops=[{2}], bitmask=either, masked=[0])
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [32]


def test_a_bitmask_masks_its_rows_as_llguidance_applies_it():
    """The constraint's mask on some rows of a batch equals llguidance's own application of the
    same words (its torch reference), and leaves the other rows as they were."""
    import llguidance.torch

    from kvgen.engine.sampling import adjust

    vocab = 49152 - 7  # the last word covers past the vocabulary
    logits = torch.randn(5, vocab)
    words = torch.randint(-2**31, 2**31 - 1, (2, -(-vocab // 32)), dtype=torch.int32, generator=gen(3))
    words[1, :10] = -1  # whole words allowed, and whole words banned
    words[1, 10:20] = 0
    out = adjust(logits, [SamplingParams()] * 5, bitmask=words, masked=[1, 3])
    want = logits.clone()
    rows = want[[1, 3]]
    llguidance.torch.apply_token_bitmask_inplace(rows, words)
    want[[1, 3]] = rows
    assert torch.equal(out, want)
    assert torch.equal(logits[[0, 2, 4]], out[[0, 2, 4]])


def test_inverse_cdf_sampling_keeps_the_warped_distribution_and_never_draws_zero_mass():
    """One uniform draw per row against the row's cumulative mass: over 20,000 draws from a
    top-k-10 distribution of 64 tokens (with a rare token of 0.4% inside it), the counts pass a
    chi-square test (df 9, p 0.001: 27.88) and no token outside the top 10 is ever drawn."""
    logits = torch.randn(1, 64, generator=gen(5)) * 2
    p = SamplingParams(temperature=0.7, top_k=10, seed=1)
    from kvgen.engine.sampling import distribution

    want = distribution(logits, [p])[0]
    support = want.nonzero()[:, 0]
    assert len(support) == 10 and want[support].min() < 0.01
    g = gen(2)
    counts = torch.zeros(64)
    for _ in range(2000):
        picked = sample(logits.repeat(10, 1), [p] * 10, [g] * 10, [[]] * 10)
        for s in picked:
            counts[s.token_id] += 1
    assert counts[want == 0].sum() == 0
    expected = want[support] * counts.sum()
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert chi2 < 27.88, chi2


def test_plain_greedy_is_greedy_asking_for_nothing_else():
    """The rows whose argmax the engine may take on the GPU: any other ask needs sample()."""
    assert SamplingParams(temperature=0).plain_greedy
    assert SamplingParams(temperature=0, max_new_tokens=9, stop_strings=["x"], ignore_eos=True, seed=4).plain_greedy
    for other in (dict(temperature=0.7), dict(logprobs=1), dict(logit_bias={3: 1.0}), dict(repetition_penalty=1.1),
                  dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(min_new_tokens=2),
                  dict(prompt_logprobs=0), dict(n=2)):
        assert not SamplingParams(**{"temperature": 0, **other}).plain_greedy, other
