"""Each KV storage format keeps the embedded model's perplexity (the model as served: the file's blocks)
within issue 4's bounds of the fp32 cache's.

A short version of bench/kv.py (same evaluation functions): the first TOKENS tokens of the
bench text, teacher-forced in 16-token chunks so attention reads the quantized cache, and
greedy agreement of fp16 / fp8 with fp32 on two prompts (reported, not asserted: one near-tie
in the logits can end an agreeing prefix early without anything being wrong).
"""

from __future__ import annotations

import pytest
import torch

from bench.kv import BOUNDS, agreement, eval_format, greedy, perplexity
from bench.kv_text import EVAL_TEXT, PROMPTS

TOKENS = 352
GREEDY_PROMPTS = PROMPTS[:2]
GREEDY_TOKENS = 64


@pytest.fixture(scope="module")
def reference(embedded):
    model, tok = embedded
    ids = tok.encode(EVAL_TEXT)[:TOKENS]
    prompts = [tok.encode(p) for p in GREEDY_PROMPTS]
    fmt = eval_format(model, "fp32", tok)
    return ids, prompts, perplexity(model, ids, fmt), greedy(model, prompts, fmt, GREEDY_TOKENS)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "q4", "q3"])
def test_perplexity_within_bound(embedded, reference, name):
    model, tok = embedded
    ids, prompts, ppl32, cont32 = reference
    fmt = eval_format(model, name, tok)
    ppl = perplexity(model, ids, fmt)
    rel = ppl / ppl32 - 1
    msg = f"{name}: perplexity {ppl:.4f} vs fp32 {ppl32:.4f} ({rel:+.3%}, bound {BOUNDS[name]:.1%})"
    if name in ("fp16", "fp8"):
        agree = agreement(greedy(model, prompts, fmt, GREEDY_TOKENS), cont32)
        msg += f"; greedy prefix equal to fp32: {agree} of {GREEDY_TOKENS}"
    print(msg)
    assert abs(rel) <= BOUNDS[name], msg


def test_generator_fits_q3_codebooks_at_start_up(make_gen):
    from kvgen.engine.kv import quant
    from kvgen.engine.sampling import SamplingParams

    gen = make_gen(kv_dtype="q3", kv_cache_mb=8)
    cb = gen.pool.fmt.codebook  # [layers, k|v, 8]
    normal = quant.normal_codebook()
    fitted = [not torch.equal(cb[layer, kv], normal) for layer in range(cb.shape[0]) for kv in range(2)]
    assert all(fitted), f"{fitted.count(False)} codebooks left at the normal quantiles"
    assert (cb[..., 0] == -1).all() and (cb[..., -1] == 1).all()
    assert gen.pool.fmt.qk_scale is None  # q3 keys have a scale per channel already
    out = gen.generate("The capital of France is", SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_key_equalisation_leaves_attention_unchanged(embedded_fp32):
    """qk_scale multiplies queries and divides keys by the same per-channel scale: over an exact
    cache the logits are those of the unscaled model (up to float rounding: fp32 weights, where the
    file's blocks would round each activation to int16 and turn an ulp into a rounding step)."""
    from kvgen.engine.kv.formats import make_format
    from kvgen.engine.kv_samples import calibrate_format

    model, tok = embedded_fp32
    cfg = model.cfg
    ids = tok.encode(EVAL_TEXT)[:64]
    plain = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert not calibrate_format(model, plain, tok) and plain.qk_scale is None
    fp8 = make_format("fp8", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert calibrate_format(model, fp8, tok)
    scale = fp8.qk_scale  # [layers, q heads + kv heads, head_dim]
    assert scale.shape == (cfg.num_layers, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    assert scale.max() / scale.min() > 10  # SmolLM2's key channels really differ in size
    scaled = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    scaled.qk_scale = scale
    a = perplexity(model, ids, plain)
    b = perplexity(model, ids, scaled)
    assert abs(a / b - 1) < 1e-5, (a, b)


def test_generator_equalises_fp8_keys_at_start_up(make_gen):
    from kvgen.engine.sampling import SamplingParams

    gen = make_gen(kv_dtype="fp8", kv_cache_mb=8)
    assert gen.pool.fmt.qk_scale is not None and gen.pool.fmt.qk_scale.shape[0] == gen.cfg.num_layers
    out = gen.generate("The capital of France is", SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
    assert make_gen(kv_cache_mb=8).pool.fmt.qk_scale is None  # plain storage: nothing to fit
    assert make_gen(kv_dtype="q4", kv_cache_mb=8).pool.fmt.qk_scale is None  # per-channel keys
