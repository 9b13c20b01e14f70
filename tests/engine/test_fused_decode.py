"""FusedDecode (one-sequence decode steps as one Numba call) against Model.forward (and, on the default
weights of the embedded model, transformers: tests/engine/test_oracle.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu import features
from kvgen.engine.attention import Step
from kvgen.engine.fused_decode import FusedDecode
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_model_files import bpe, gguf_base  # noqa: F401  (fixtures)
from tests.tiny import write_gguf

# more rows than a kernel call takes at once (vector_matmul.ROWS_AT_ONCE), and not a multiple of it
MANY = 33


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the kernels' int16 activations: the fused step and Model.forward differ in the
    order of their fp32 sums (norms, attention), and an ulp there can move an activation's int16
    rounding by a step (2^-15 of its block's largest), which later layers carry. These tests'
    steps measured up to 4e-4 of the largest value; a wrong cache slot or weight is far more. Built for
    CPU_ACTIVATIONS=int8 (tests/engine/test_cpu_activations.py runs these there) a rounding step is 1/127 of a
    block's largest, 258x int16's, and the same ulps move it as often: up to 1.3e-2 measured, 2e-2 allowed."""
    tol = 2e-2 if features.INT8 else 2e-3
    torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())


@pytest.fixture(scope="module")
def q4_model(gguf_base, bpe):  # noqa: F811
    d, cfg, weights, _, _ = gguf_base
    path = d / "fused-Q4_1.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=gguf.GGMLQuantizationType.Q4_1)
    return load_model(str(path))[0]


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0", "Q4_K"])
def block_model(gguf_base, bpe, request):  # noqa: F811
    """The same model in 4-bit blocks (Q4_1, Q4_K) and in 8-bit codes (Q8_0): the step's two kinds."""
    d, cfg, weights, _, _ = gguf_base
    path = d / f"fused-{request.param}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=getattr(gguf.GGMLQuantizationType, request.param))
    return load_model(str(path))[0]


def test_every_decode_step_equals_the_forward(block_model):
    """Prefill 5 tokens, then 40 decode steps across block boundaries (blocks of 16): the fused
    step's logits, final hidden states and the K/V it writes equal Model.forward's over the same
    cache, for each kind of weight blocks the step takes."""
    m, cfg = block_model, block_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert FusedDecode.supports(m, fmt)
    fused = FusedDecode(m)
    ids = torch.randint(3, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    pools = [BlockPool(fmt, 8) for _ in range(2)]
    caches = [PagedKVCache(p) for p in pools]
    for pool, cache in zip(pools, caches, strict=True):
        cache.reserve(5)
        b, o = cache.slots(0, 5)
        step = Step(positions=torch.arange(5), write_blocks=b, write_offsets=o, query_lens=[5], context_lens=[5],
                    block_tables=torch.tensor([cache.blocks]), logits_rows=None, is_decode=False)
        m.forward(torch.tensor(ids[:5]), step, fmt, pool.store)
        cache.advance(5)
    for pos in range(5, 45):
        for cache in caches:
            cache.reserve(1)
        step = decode_step(caches[:1])
        want_features, got_features = [], np.empty((1, cfg.hidden_size), np.float32)
        want = m.forward(torch.tensor([ids[pos]]), step, fmt, pools[0].store, features=want_features)
        got = fused([(ids[pos], pos, caches[1].blocks)], pools[1].store, features=got_features)
        assert_near(got, want)
        assert_near(torch.from_numpy(got_features), want_features[0])  # what an EAGLE head drafts from
        for c in caches:
            c.advance(1)
    used = caches[0].blocks
    assert_near(pools[1].store["kv"][caches[1].blocks], pools[0].store["kv"][used])


def prefill(model, fmt, pool, ids) -> PagedKVCache:
    cache = PagedKVCache(pool)
    cache.reserve(len(ids) + 1)
    b, o = cache.slots(0, len(ids))
    step = Step(positions=torch.arange(len(ids)), write_blocks=b, write_offsets=o, query_lens=[len(ids)],
                context_lens=[len(ids)], block_tables=torch.tensor([cache.blocks]), logits_rows=None, is_decode=False)
    model.forward(torch.tensor(ids), step, fmt, pool.store)
    cache.advance(len(ids))
    return cache


def decode_step(caches: list[PagedKVCache]) -> Step:
    """Model.forward's Step for one new token after each cache's last (its slot reserved)."""
    blocks, offsets = zip(*[c.slots(c.length, 1) for c in caches], strict=True)
    width = max(len(c.blocks) for c in caches)
    return Step(positions=torch.tensor([c.length for c in caches]), write_blocks=torch.cat(blocks),
                write_offsets=torch.cat(offsets), query_lens=[1] * len(caches),
                context_lens=[c.length + 1 for c in caches],
                block_tables=torch.tensor([c.blocks + [0] * (width - len(c.blocks)) for c in caches]),
                logits_rows=None, is_decode=True)


@pytest.mark.parametrize("rows", [2, 3, MANY])
def test_a_step_of_several_sequences_equals_the_forward(block_model, rows):
    """Sequences of different lengths (14 to 14 + 3 * rows: one block, two, a block's last slot)
    decode one token each in one fused step: the batched forward's logits and K/V."""
    m, cfg = block_model, block_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(3, cfg.vocab_size, (14 + 3 * i,), generator=g).tolist() for i in range(rows)]
    nxt = torch.randint(3, cfg.vocab_size, (rows,), generator=g).tolist()
    pools = [BlockPool(fmt, 8 * rows) for _ in range(2)]
    caches = [[prefill(m, fmt, pool, p) for p in prompts] for pool in pools]
    want = m.forward(torch.tensor(nxt), decode_step(caches[0]), fmt, pools[0].store)
    got = FusedDecode(m)([(t, c.length, c.blocks) for t, c in zip(nxt, caches[1], strict=True)], pools[1].store)
    assert_near(got, want)
    for a, b in zip(caches[0], caches[1], strict=True):
        assert_near(pools[1].store["kv"][b.blocks], pools[0].store["kv"][a.blocks])


def test_a_rows_logits_do_not_depend_on_the_others_in_a_fused_step(q4_model):
    """Every op of the fused step is per row (the kernels' integer sums are exact, their fp32
    scaling and every norm and attention loop run row by row), so a sequence's logits and K/V are
    bit-identical decoded alone, beside 4 others, and beside MANY - 1 others in any order."""
    m, cfg = q4_model, q4_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg.vocab_size, (9 + 2 * i,), generator=g).tolist() for i in range(MANY)]
    nxt = torch.randint(3, cfg.vocab_size, (MANY,), generator=g).tolist()
    fused = FusedDecode(m)
    results = []
    for order in ([0], [3, 0, 1, 2, 4], list(range(MANY))[::-1]):
        pool = BlockPool(fmt, 4 * MANY)
        caches = {i: prefill(m, fmt, pool, prompts[i]) for i in order}
        logits = fused([(nxt[i], caches[i].length, caches[i].blocks) for i in order], pool.store)
        results.append((logits[order.index(0)], pool.store["kv"][caches[0].blocks]))
    for logits, kv in results[1:]:
        assert torch.equal(logits, results[0][0]) and torch.equal(kv, results[0][1])


def test_the_runner_fuses_only_what_it_supports(q4_model):
    m, cfg = q4_model, q4_model.cfg

    def runner(kv="fp32", **kw):
        fmt = make_format(kv, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
        return ModelRunner(m, fmt, BlockPool(fmt, 8).store, **kw)

    assert runner().fused is not None
    assert runner(fused=False).fused is None
    assert runner(window=32).fused is None  # windows and chunks take the forward
    assert runner("q3").fused is None and runner("bf16").fused is None  # fp8 / q4: test_kv_io.py


def test_why_not_names_the_first_reason_a_model_does_not_take_the_step(q4_model):
    """A family whose layers the step does not compute (model.py's other architectures), weights
    not in blocks and a KV format the step cannot read are each refused, with the reason named."""
    import copy
    import dataclasses

    m, cfg = q4_model, q4_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert FusedDecode.why_not(m, fmt) is None
    other = copy.copy(m)
    for arch, what in (("gemma2", "soft-capped"), ("gemma3", "final logit cap"), ("falcon", "not a family")):
        other.cfg = dataclasses.replace(cfg, architecture=arch)
        why = FusedDecode.why_not(other, fmt)
        assert not FusedDecode.supports(other, fmt) and f"architecture {arch}" in why and what in why, why
    other.cfg = cfg
    other.weight_dtype = "fp32"
    assert "weights fp32" in FusedDecode.why_not(other, fmt)
    q3 = make_format("q3", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert not FusedDecode.supports(m, q3) and "KV format q3" in FusedDecode.why_not(m, q3)


def test_drafts_are_verified_in_the_fused_step(q4_model, bpe):  # noqa: F811
    """Prompt lookup over gguf weights: the drafts are verified as rows of the fused step (the
    prompt's prefill too: no step takes Model.forward), and the tokens are plain decoding's."""
    from kvgen.engine.tokenizer import TextTokenizer
    from tests.tiny import CHATML_TEMPLATE

    tok = TextTokenizer(bpe, CHATML_TEMPLATE, bos_id=None, add_bos=False, special_ids={0, 1, 2},
                        eos_token="<|im_end|>")
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    prompt = list(range(3, 15)) * 4  # repeats: prompt lookup has drafts to offer
    plain = Generator(q4_model, tok, EngineOptions())
    spec = Generator(q4_model, tok, EngineOptions(speculative="ngram"))
    forwards, rows = [], []
    forward, fused = spec.engine.runner._forward, spec.engine.runner.fused
    spec.engine.runner._forward = lambda batch, wanted: forwards.append(len(batch)) or forward(batch, wanted)
    spec.engine.runner.fused = lambda r, *a, **k: rows.append(len(r)) or fused(r, *a, **k)
    try:
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
        assert spec.engine.drafted_tokens > 0
        assert forwards == [] and rows[0] == len(prompt) and max(rows[1:]) > 1
    finally:
        plain.close()
        spec.close()


def test_a_drafts_rows_in_one_step_equal_one_step_each(q4_model):
    """A drafted sequence's k + 1 tokens verified as k + 1 rows of one fused step (consecutive
    positions, one block table, crossing a block boundary) give bit for bit the logits and K/V of
    k + 1 one-row steps: the kernels are row-invariant and each row attends up to its own position.
    So speculative decoding over the fused step is exactly lossless for greedy output."""
    m, cfg = q4_model, q4_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    fused = FusedDecode(m)
    ids = torch.randint(3, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    pools = [BlockPool(fmt, 4) for _ in range(2)]
    caches = [prefill(m, fmt, p, ids[:13]) for p in pools]
    for c in caches:
        c.reserve(7)
    one_each = torch.cat([fused([(ids[pos], pos, caches[0].blocks)], pools[0].store) for pos in range(13, 20)])
    together = fused([(ids[pos], pos, caches[1].blocks) for pos in range(13, 20)], pools[1].store)
    assert torch.equal(together, one_each)
    assert torch.equal(pools[1].store["kv"][caches[1].blocks], pools[0].store["kv"][caches[0].blocks])


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_decode_rows_in_a_step_with_prompt_chunks_run_fused_and_keep_their_logits(q4_model, bpe, kv):  # noqa: F811
    """Requests that arrive (and prefill, in chunks) while a request decodes share its steps: its
    decode rows still run fused (with fp32 KV the chunks too, in the same call; with fp8 the
    chunks take Model.forward beside it), so its tokens and their logprobs are bit for bit those
    of the request decoded alone."""
    from kvgen.engine.tokenizer import TextTokenizer
    from tests.tiny import CHATML_TEMPLATE

    tok = TextTokenizer(bpe, CHATML_TEMPLATE, bos_id=None, add_bos=False, special_ids={0, 1, 2},
                        eos_token="<|im_end|>")
    target = list(range(3, 20))
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=24, ignore_eos=True, logprobs=1)
    gen = Generator(q4_model, tok, EngineOptions(token_budget=48, prefix_cache=False, kv_dtype=kv))
    split = []  # steps with decode rows and prompt chunks
    runner = gen.engine.runner
    if kv == "fp32":
        step = runner._fused_step
        runner._fused_step = lambda wanted: split.append({n for _, n, _ in wanted} > {1}) or step(wanted)
    else:
        step = runner._split_step
        runner._split_step = lambda *a: split.append(True) or step(*a)
    try:
        alone = gen.generate(target, params)

        async def joined():
            ids, logprobs, others = [], [], []
            async for ev in await gen.request(target, params):
                ids += ev.token_ids
                logprobs += [s.logprob for s in ev.logprobs]
                if not others:  # decoding when the others arrive
                    others = [await gen.request(list(range(5 + i, 120 + i)), SamplingParams(max_new_tokens=4, seed=i))
                              for i in range(3)]
            for r in others:
                await r.result()
            return ids, logprobs

        ids, logprobs = gen.bridge.run(joined())
        assert any(split), "no step mixed decode rows with prompt chunks"
        assert ids == alone.token_ids
        assert logprobs == [s.logprob for s in alone.logprobs]
    finally:
        gen.close()


def test_prompt_rows_do_not_depend_on_how_the_prompt_was_cut(q4_model, bpe):  # noqa: F811
    """With fp32 KV a prompt chunk runs as rows of the fused step, each through a decode row's
    operations: the prompt prefilled whole, in chunks of 7 (token_budget), or after a prefix-cache
    hit on its first 32 tokens gives bit for bit the same logprobs (the prompt's too) and tokens."""
    from kvgen.engine.tokenizer import TextTokenizer
    from tests.tiny import CHATML_TEMPLATE

    tok = TextTokenizer(bpe, CHATML_TEMPLATE, bos_id=None, add_bos=False, special_ids={0, 1, 2},
                        eos_token="<|im_end|>")
    prompt = torch.randint(3, q4_model.cfg.vocab_size, (61,), generator=torch.Generator().manual_seed(2)).tolist()

    def run(budget, prompt_logprobs=None, warm=False):
        params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=2,
                                prompt_logprobs=prompt_logprobs)
        gen = Generator(q4_model, tok, EngineOptions(token_budget=budget, prefix_cache=warm))
        try:
            if warm:  # another request leaves the prompt's first two blocks in the prefix cache
                gen.generate(prompt[:32] + [5, 6, 7], SamplingParams(max_new_tokens=1))
            out = gen.generate(prompt, params)
            assert out.usage.cached_tokens == (32 if warm else 0)
            return (out.token_ids, [s.logprob for s in out.logprobs],
                    [p.logprob for p in out.prompt_logprobs if p is not None])
        finally:
            gen.close()

    assert run(7, 1) == run(512, 1)
    assert run(512, warm=True) == run(512)


# --- models whose matrices mix kinds of blocks (llama-quantize's K-mixtures) ---

# The kinds per layer, per weight (HF names), and of the head: layer 0's q|k|v and layer 1's
# q|k|v, gate|up are fused weights of parts in different kinds; hidden 256 takes the K-quants,
# hidden 576 (SmolLM2-135M's) only where the input is the MLP's 1536 (down), as in its real
# Q4_K_M / Q5_K_M files, and the 32-block fallbacks elsewhere.
MIXTURES = {
    256: ({"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q5_1",
           "up_proj": "Q5_K", "down_proj": "Q6_K"},
          {"q_proj": "Q2_K", "k_proj": "Q3_K", "v_proj": "Q5_0", "o_proj": "Q2_K", "gate_proj": "IQ4_XS",
           "up_proj": "Q2_K", "down_proj": "Q5_0"}, "Q6_K"),
    576: ({"q_proj": "Q5_1", "k_proj": "Q5_1", "v_proj": "Q8_0", "o_proj": "Q5_0", "gate_proj": "Q4_1",
           "up_proj": "IQ4_NL", "down_proj": "Q6_K"},
          {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q5_0", "o_proj": "Q4_1", "gate_proj": "Q5_0",
           "up_proj": "Q5_0", "down_proj": "Q2_K"}, "Q5_1"),
}
# the kinds the model's linears then hold, part by part (weight_blocks.BLOCK_TYPES): parts of one
# kind fuse where their scales are held alike (layer 0's Q5_1 gate beside its Q5_K up: two parts)
MIXED_KINDS = {
    256: [{"qkv": ["q4", "q4", "q6h"], "o": ["q8"], "gate_up": ["q5m", "q5m"], "down": ["q6h"]},
          {"qkv": ["q2hm", "q3h", "q5"], "o": ["q2hm"], "gate_up": ["q4i", "q2hm"], "down": ["q5"]}],
    576: [{"qkv": ["q5m", "q5m", "q8"], "o": ["q5"], "gate_up": ["q4", "q4i"], "down": ["q6h"]},
          {"qkv": ["q4", "q4", "q5"], "o": ["q4"], "gate_up": ["q5"], "down": ["q2hm"]}],
}


@pytest.fixture(scope="module", params=sorted(MIXTURES))
def mixed_model(gguf_base, bpe, request):  # noqa: F811
    """A 2-layer model whose matrices are in the kinds MIXTURES gives, hidden 256 or 576."""
    from kvgen.engine.fused_decode import _parts
    from tests import tiny
    from tests.engine.test_model_files_quants import _write
    from tests.tiny import tiny_config, tiny_weights

    d, cfg, weights, _, _ = gguf_base
    hidden = request.param
    if hidden != cfg.hidden_size:
        cfg = tiny_config(vocab=cfg.vocab_size, hidden=576, heads=9, kv_heads=3, ffn=1536, layers=2)
        cfg.bos_token_id, cfg.eos_token_ids = 0, [2]
        weights = tiny_weights(cfg, seed=12)
    *layers, head = MIXTURES[hidden]
    types = {"lm_head.weight": getattr(gguf.GGMLQuantizationType, head),
             "model.embed_tokens.weight": getattr(gguf.GGMLQuantizationType, head)}  # (tied, or not)
    for i, layer in enumerate(layers):
        for name, t in layer.items():
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            types[f"model.layers.{i}.{part}.{name}.weight"] = getattr(gguf.GGMLQuantizationType, t)
    path = d / f"mixed-{hidden}.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "gguf_quantize", _write)
        write_gguf(path, cfg, weights, bpe, types=types)
    m = load_model(str(path), "gguf")[0]
    for layer, kinds in zip(m.layers, MIXED_KINDS[hidden], strict=True):  # the file mixes what it says
        assert {f: [p.kind for p in _parts(getattr(layer, f))] for f in kinds} == kinds
    return m


def test_a_mixture_of_kinds_decodes_like_the_forward(mixed_model):
    """Each matrix part multiplies on its own kind's kernel inside the step (the head too): 30
    decode steps across block boundaries give Model.forward's logits, final hidden states and K/V."""
    m, cfg = mixed_model, mixed_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert FusedDecode.why_not(m, fmt) is None and FusedDecode.supports(m, fmt)
    fused = FusedDecode(m)
    linears = [getattr(layer, f) for layer in m.layers for f in ("qkv", "o", "gate_up", "down")] + [m.lm_head]
    for part in (p for lin in linears for p in getattr(lin, "parts", [lin])):  # the weights held once
        codes = fused.weights[0 if part.qs.dtype == np.uint8 else 1]  # q4's and packed bytes, int8 codes
        assert all(np.may_share_memory(a, b) for a, b in ((part.qs, codes), (part.scales, fused.weights[2])))
    ids = torch.randint(3, cfg.vocab_size, (35,), generator=torch.Generator().manual_seed(5)).tolist()
    pools = [BlockPool(fmt, 4) for _ in range(2)]
    caches = [prefill(m, fmt, p, ids[:5]) for p in pools]
    for pos in range(5, 35):
        for cache in caches:
            cache.reserve(1)
        want_features, got_features = [], np.empty((1, cfg.hidden_size), np.float32)
        want = m.forward(torch.tensor([ids[pos]]), decode_step(caches[:1]), fmt, pools[0].store,
                         features=want_features)
        got = fused([(ids[pos], pos, caches[1].blocks)], pools[1].store, features=got_features)
        assert_near(got, want)
        assert_near(torch.from_numpy(got_features), want_features[0])
        for c in caches:
            c.advance(1)
    assert_near(pools[1].store["kv"][caches[1].blocks], pools[0].store["kv"][caches[0].blocks])


def test_the_step_reads_a_files_tiles_where_the_load_wrote_them(mixed_model):
    """Every part's tiles went into the file's WeightArena at load, and that arena is the step's weight
    buffer: the step copies nothing (a second model-sized write, and peak, otherwise)."""
    from kvgen.engine.fused_decode import _parts

    m = mixed_model
    linears = [getattr(layer, f) for layer in m.layers for f in ("qkv", "o", "gate_up", "down")] + [m.lm_head]
    parts = [p for lin in linears for p in _parts(lin)]
    where = [(p.qs.ctypes.data, p.scales.ctypes.data) for p in parts]
    arena = parts[0].arena
    assert arena is not None and all(p.arena is arena for p in parts)
    fused = FusedDecode(m)
    assert all((w.ctypes.data, w.nbytes) == (arena.buf.ctypes.data, arena.buf.nbytes) for w in fused.weights)
    assert [(p.qs.ctypes.data, p.scales.ctypes.data) for p in parts] == where


def test_a_mixtures_batched_rows_and_prompt_chunk_equal_the_forward(mixed_model):
    """MANY sequences decoding one token each in one step, then a 40-token prompt chunk as rows of
    the step (transposed blocks, parallel rows): every row's logits and K/V are Model.forward's."""
    m, cfg = mixed_model, mixed_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    fused = FusedDecode(m)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (14 + i,), generator=g).tolist() for i in range(MANY)]
    nxt = torch.randint(3, cfg.vocab_size, (MANY,), generator=g).tolist()
    pools = [BlockPool(fmt, 3 * MANY + 3) for _ in range(2)]
    caches = [[prefill(m, fmt, pool, p) for p in prompts] for pool in pools]
    want = m.forward(torch.tensor(nxt), decode_step(caches[0]), fmt, pools[0].store)
    got = fused([(t, c.length, c.blocks) for t, c in zip(nxt, caches[1], strict=True)], pools[1].store)
    assert_near(got, want)
    for a, b in zip(*caches, strict=True):
        assert_near(pools[1].store["kv"][b.blocks], pools[0].store["kv"][a.blocks])
    chunk = torch.randint(3, cfg.vocab_size, (40,), generator=g).tolist()
    chunk_caches = [PagedKVCache(pool) for pool in pools]
    for c in chunk_caches:
        c.reserve(40)
    b, o = chunk_caches[0].slots(0, 40)
    step = Step(positions=torch.arange(40), write_blocks=b, write_offsets=o, query_lens=[40], context_lens=[40],
                block_tables=torch.tensor([chunk_caches[0].blocks]), logits_rows=None, is_decode=False)
    want = m.forward(torch.tensor(chunk), step, fmt, pools[0].store)
    got = fused([(t, p, chunk_caches[1].blocks) for p, t in enumerate(chunk)], pools[1].store)
    assert got.shape == want.shape == (40, cfg.vocab_size)
    assert_near(got, want)
    assert_near(pools[1].store["kv"][chunk_caches[1].blocks], pools[0].store["kv"][chunk_caches[0].blocks])


@pytest.mark.parametrize("kv", ["fp8", "q4"])
def test_a_mixture_decodes_over_quantized_kv_like_the_forward(mixed_model, kv):
    """Over fp8 / q4 KV (keys equalised as the Generator fits them): 20 decode steps of 3
    sequences give the forward's logits on the same format (kv_io's rounding: test_kv_io.py)."""
    from kvgen.engine.kv_samples import calibrate_format

    m, cfg = mixed_model, mixed_model.cfg
    fmts = []
    for _ in range(2):
        fmts.append(make_format(kv, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim))
        calibrate_format(m, fmts[-1], ids=list(range(3, 200)))
    assert FusedDecode.supports(m, fmts[1])
    fused = FusedDecode(m)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, cfg.vocab_size, (5 + 7 * i,), generator=g).tolist() for i in range(3)]
    pools = [BlockPool(f, 16) for f in fmts]
    caches = [[prefill(m, f, pool, p) for p in prompts] for f, pool in zip(fmts, pools, strict=True)]
    for _ in range(20):
        nxt = torch.randint(3, cfg.vocab_size, (3,), generator=g).tolist()
        for c in caches[0] + caches[1]:
            c.reserve(1)
        want = m.forward(torch.tensor(nxt), decode_step(caches[0]), fmts[0], pools[0].store)
        got = fused([(t, c.length, c.blocks) for t, c in zip(nxt, caches[1], strict=True)], pools[1].store, fmts[1])
        # (fp8 / q4 KV's rounding, which int8 activations' doubles: CPU_ACTIVATIONS, assert_near)
        tol = 4e-2 if features.INT8 else 2e-2
        torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())
        for c in caches[0] + caches[1]:
            c.advance(1)
