"""Our forward pass and engine against transformers' own loading of the same GGUF (fp32): the logits of
fp32 weights to float rounding, those of the file's blocks (the default) to their int16 activations'
rounding, and the default engine's greedy continuations token for token."""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.attention import Step
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.sampling import SamplingParams

RAW = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on",
    "Les chats et les chiens sont",
    "Here is a list of fruits: apple, banana,",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


def run_chunks(model, ids: list[int], chunks: list[int]) -> list[torch.Tensor]:
    """Feed ids in chunks through one paged cache; the logits of every chunk's last token."""
    fmt = make_format("fp32", model.cfg.num_layers, 16, model.cfg.num_kv_heads, model.cfg.head_dim)
    pool = BlockPool(fmt, 64)
    cache = PagedKVCache(pool)
    out, pos = [], 0
    for n in chunks:
        cache.reserve(n)
        blocks, offsets = cache.slots(pos, n)
        step = Step(positions=torch.arange(pos, pos + n), write_blocks=blocks, write_offsets=offsets,
                    query_lens=[n], context_lens=[pos + n], block_tables=torch.tensor([cache.blocks]),
                    logits_rows=torch.tensor([n - 1]), is_decode=n == 1)
        out.append(model.forward(torch.tensor(ids[pos:pos + n]), step, fmt, pool.store)[0])
        cache.advance(n)
        pos += n
    return out


# max |logit difference| to transformers, by weights: fp32 copies differ by float rounding only; the file's
# blocks multiply activations rounded to int16 per block (cpu/int16_rounding.py), which moved logits of
# this model by up to 1.2e-2 (a wrong weight, cache slot or rotation moves them by whole units)
LOGIT_TOLERANCE = {"embedded_fp32": 2e-3, "embedded": 3e-2}


@pytest.mark.parametrize("weights", sorted(LOGIT_TOLERANCE))
@pytest.mark.parametrize("prompt", RAW[:3])
def test_logits_match_transformers(weights, hf_model, prompt, request):
    model, tok = request.getfixturevalue(weights)
    hf, _ = hf_model
    ids = tok.encode(prompt + " and then some more words follow here, enough to cross a block")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # prefill of 10 tokens, a chunk of 7, then one token at a time: every path of attention
    chunks = [10, 7] + [1] * (len(ids) - 17)
    ours = run_chunks(model, ids, chunks)
    ends = torch.tensor(chunks).cumsum(0) - 1
    for logits, end in zip(ours, ends.tolist(), strict=True):
        err = (logits - ref[end]).abs().max().item()
        assert err < LOGIT_TOLERANCE[weights], f"position {end}: max |logit diff| {err}"


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                      top_k=None, top_p=None, temperature=None)
    return out[0, len(ids):].tolist()


def test_greedy_continuations_equal_transformers(gen, hf_model):
    """The default engine (the file's blocks, decode rows in the fused step) against transformers' fp32
    greedy decoding of the same file, token for token, prompts and chats together in one batch."""
    hf, _ = hf_model
    assert gen.model.weight_dtype == "gguf" and gen.engine.runner.fused is not None
    prompts = [gen.tokenize(p) for p in RAW] + [gen.tokenize(c) for c in CHATS]
    results = gen.batch_generate(prompts, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True))
    for ids, r in zip(prompts, results, strict=True):
        assert len(r.token_ids) == 32
        assert r.token_ids == hf_greedy(hf, ids, 32), gen.tokenizer.decode(ids)
