"""LoRA adapters (kvgen/engine/lora.py) against transformers + PEFT on the same base model.

A tiny random Llama (tests/tiny.py) saved as an HF folder and as a Q8_0 GGUF (whose blocks the engine
keeps: the fused decode step runs its base rows); random PEFT adapters with non-zero B over different
target-module subsets and ranks, written by PEFT's own save_pretrained. The oracle is PEFT's model on
the same weights (for the GGUF: transformers' own GGUF loader, which dequantizes the file), unmerged
and merged."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace

import pytest
import torch

from kvgen.engine.generator import Generator, load_model
from kvgen.engine.lora import AdapterError, AdapterExists, AdapterInUse, AdapterStore, TooManyAdapters, load_adapter
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from kvgen.errors import InvalidRequest, NotFound
from tests.engine.test_mamba2 import files  # noqa: F401  (a fixture: the tiny Mamba-2)
from tests.tiny import (
    converter_python,
    llama_cpp_sources,
    tiny_bpe_tokenizer,
    tiny_config,
    tiny_weights,
    write_gguf,
    write_hf_folder,
)

STEPS = 16
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"]
# name -> (target modules, rank, alpha, rslora)
ADAPTERS = {
    "attn": (["q_proj", "v_proj"], 4, 8, False),
    "mlp": (["gate_proj", "up_proj", "down_proj"], 8, 16, True),
    "every": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2, 4, False),
    "ko": (["k_proj", "o_proj"], 16, 8, False),
}


def _hf_logging_quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_adapter(base_folder, out, targets, r, alpha, rslora, seed):
    """A PEFT LoRA adapter of the model in base_folder, A and B random (B non-zero: it changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF folder, Q8_0 GGUF path, {adapter name: folder}) of one tiny random Llama."""
    import gguf

    _hf_logging_quiet()
    root = tmp_path_factory.mktemp("lora")
    # an lm_head of its own: tied to the embeddings, this tiny model mostly repeats its last token,
    # whatever an adapter does
    cfg = replace(tiny_config(vocab=300, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=512),
                  tie_word_embeddings=False)
    weights = tiny_weights(cfg, seed=5)
    tok = tiny_bpe_tokenizer(300)
    write_hf_folder(root / "hf", cfg, weights, tok)
    write_gguf(root / "tiny-q8.gguf", cfg, weights, tok, qtype=gguf.GGMLQuantizationType.Q8_0)
    adapters = {name: write_adapter(root / "hf", root / name, *spec, seed=i)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return root / "hf", root / "tiny-q8.gguf", adapters


def _hf_base(base, kind: str):
    from transformers import AutoModelForCausalLM

    folder, gguf_path, _ = base
    if kind == "hf":
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def _greedy(hf, ids: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                      top_k=None, top_p=None, temperature=None)
    return out[0, len(ids):].tolist()


def _generator(base, kind: str, **opts) -> Generator:
    folder, gguf_path, adapters = base
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    path = str(folder if kind == "hf" else gguf_path)
    return Generator(*load_model(path, "fp32" if kind == "hf" else "auto"),
                     EngineOptions(lora_adapters=spec, **opts), model_path=path)


def _run(gen: Generator, jobs: list[tuple[list[int], str]], **params) -> list:
    """Each (prompt ids, adapter) as one request, all submitted before any is read (one batch)."""
    sp = SamplingParams(**{"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True, **params})

    async def go():
        reqs = [gen.submit(ids, sp, adapter=name) for ids, name in jobs]
        out = [await r.result() for r in reqs]
        for r in reqs:
            await r.released()
        return out

    return gen.bridge.run(go())


@pytest.fixture(scope="module", params=["hf", "gguf"])
def engine(request, base):
    gen = _generator(base, request.param)
    yield request.param, gen
    gen.close()


def test_greedy_with_each_adapter_equals_peft_unmerged_and_merged(base, engine):
    from peft import PeftModel

    kind, gen = engine
    if kind == "gguf":
        assert gen.model.weight_dtype == "gguf" and gen.engine.runner.fused is not None  # blocks stay blocks
    prompts = [gen.tokenize(p) for p in PROMPTS]
    plain = [r.token_ids for r in _run(gen, [(ids, "") for ids in prompts])]
    assert plain == [_greedy(_hf_base(base, kind), ids) for ids in prompts]
    for name, folder in base[2].items():
        ours = [r.token_ids for r in _run(gen, [(ids, name) for ids in prompts])]
        unmerged = PeftModel.from_pretrained(_hf_base(base, kind), str(folder)).eval()
        assert ours == [_greedy(unmerged, ids) for ids in prompts], f"{kind} {name}: against PEFT, unmerged"
        merged = unmerged.merge_and_unload()
        assert ours == [_greedy(merged, ids) for ids in prompts], f"{kind} {name}: against PEFT, merged"
        assert ours != plain, f"{name} changes nothing: the test would not see a missing delta"


def test_a_batch_mixing_four_adapters_and_the_base_gives_each_what_it_gets_alone(engine):
    kind, gen = engine
    prompts = [gen.tokenize(p) for p in PROMPTS]
    jobs = [(ids, name) for ids in prompts for name in ["", *ADAPTERS]]
    alone = [_run(gen, [job])[0].token_ids for job in jobs]
    groups = []
    gen.engine.on_step = lambda batch, _: groups.append({seq.adapter for seq, _ in batch})
    try:
        together = [r.token_ids for r in _run(gen, jobs)]
    finally:
        gen.engine.on_step = None
    assert max(len(g) for g in groups) == 5  # the four adapters and the base model shared a step
    assert together == alone
    assert len({tuple(t) for t in together[:5]}) == 5  # each adapter's output is its own


def _forward_alone(model, fmt, prompt: list[int], adapter) -> tuple[list[int], torch.Tensor]:
    """STEPS greedy tokens of one sequence through Model.forward with a LoraBatch (the prompt in one
    step), and the logits [STEPS, vocab] each was taken from."""
    from kvgen.engine.attention import Step
    from kvgen.engine.kv.paged import PagedKVCache
    from kvgen.engine.kv.pool import BlockPool
    from kvgen.engine.lora import LoraBatch

    pool = BlockPool(fmt, 8)
    cache, ids, logits = PagedKVCache(pool), list(prompt), []
    for _ in range(STEPS):
        start, n = cache.length, len(ids) - cache.length
        cache.reserve(n)
        blocks, offsets = cache.slots(start, n)
        step = Step(positions=torch.arange(start, start + n), write_blocks=blocks, write_offsets=offsets,
                    query_lens=[n], context_lens=[start + n], block_tables=torch.tensor([cache.blocks]),
                    logits_rows=None, is_decode=n == 1)
        out = model.forward(torch.tensor(ids[start:]), step, fmt, pool.store,
                            lora=LoraBatch.of([(adapter, n)], model.device))
        cache.advance(n)
        logits.append(out[-1])
        ids.append(int(out[-1].argmax()))
    return ids[len(prompt):], torch.stack(logits)


def _fused_together(fused, fmt, seqs: list) -> list[tuple[list[int], torch.Tensor]]:
    """_forward_alone for every (prompt, adapter) of seqs at once, each step one FusedDecode call over
    all of them (the prompts as rows of chunks, then a row each), every row with its own adapter."""
    from kvgen.engine.kv.paged import PagedKVCache
    from kvgen.engine.kv.pool import BlockPool

    pool = BlockPool(fmt, 8 * len(seqs))
    caches = [PagedKVCache(pool) for _ in seqs]
    ids, logits = [list(prompt) for prompt, _ in seqs], [[] for _ in seqs]
    for _ in range(STEPS):
        rows, adapters, last = [], [], []
        for cache, seq_ids, (_, adapter) in zip(caches, ids, seqs, strict=True):
            start, n = cache.length, len(seq_ids) - cache.length
            cache.reserve(n)
            rows += [(t, start + i, cache.blocks) for i, t in enumerate(seq_ids[start:])]
            adapters += [adapter] * n
            last.append(len(rows) - 1)
        out = fused(rows, pool.store, need=last, adapters=adapters)
        for i, cache in enumerate(caches):
            cache.advance(len(ids[i]) - cache.length)
            logits[i].append(out[i])
            ids[i].append(int(out[i].argmax()))
    return [(seq_ids[len(prompt):], torch.stack(lg)) for seq_ids, (prompt, _), lg in zip(ids, seqs, logits,
                                                                                          strict=True)]


def test_a_fused_step_mixing_four_adapters_and_the_base_gives_each_sequence_what_it_gets_alone(base):
    """The fused decode step over the GGUF's blocks, each step one call for 10 sequences (2 prompts,
    each on the base model and on each of the 4 adapters: q/v, the MLP, every linear, k/o), the
    prompts as rows of chunks then a row each: every sequence's greedy tokens equal those it gets
    alone through Model.forward + LoraBatch, its logits within the block kernels' rounding (the two
    paths sum norms in another order: test_fused_decode.assert_near), and bit for bit those of its
    rows alone in the fused step (an adapter's delta does not depend on the rows beside it)."""
    from kvgen.engine.fused_decode import FusedDecode
    from kvgen.engine.kv.formats import make_format
    from tests.engine.test_fused_decode import assert_near

    model = load_model(str(base[1]), "auto")[0]
    cfg = model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    adapters = [None] + [load_adapter(name, str(path), model, 64) for name, path in base[2].items()]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (9 + 5 * i,), generator=g).tolist() for i in range(2)]
    seqs = [(prompt, adapter) for prompt in prompts for adapter in adapters]
    fused = FusedDecode(model)
    together = _fused_together(fused, fmt, seqs)
    for (prompt, adapter), (tokens, logits) in zip(seqs, together, strict=True):
        name = adapter.name if adapter else "base"
        want_tokens, want_logits = _forward_alone(model, fmt, prompt, adapter)
        assert tokens == want_tokens, name
        assert_near(logits, want_logits)
        alone_tokens, alone_logits = _fused_together(fused, fmt, [(prompt, adapter)])[0]
        assert tokens == alone_tokens and torch.equal(logits, alone_logits), name
    assert len({tuple(tokens) for tokens, _ in together[:len(adapters)]}) == len(adapters)  # each its own


def test_the_prefix_cache_is_shared_within_an_adapter_and_never_across(engine):
    kind, gen = engine
    ids = gen.tokenize("numbers 123 4567 89, and the year 2024. " * 4)  # a prompt no other test sends
    assert len(ids) > 2 * gen.pool.block_size

    def cached(name):
        return _run(gen, [(ids, name)], max_new_tokens=2)[0].usage.cached_tokens

    assert cached("attn") == 0
    assert cached("attn") >= gen.pool.block_size  # a hit within the adapter
    assert cached("mlp") == 0  # none across adapters
    assert cached("") == 0  # nor with the base model
    assert cached("mlp") >= gen.pool.block_size


def test_a_session_keeps_its_adapter(engine):
    kind, gen = engine
    ids = gen.tokenize(PROMPTS[0])
    expected = _run(gen, [(ids, "every")])[0].token_ids
    session = gen.new_session(adapter="every")
    try:
        sp = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
        assert session.generate(ids, sp).token_ids == expected
        with pytest.raises(InvalidRequest, match="keeps the adapter"):
            gen.bridge.run(_submit_in_session(gen, session, ids, "attn"))
    finally:
        gen.close_session(session.session_id)


async def _submit_in_session(gen, session, ids, adapter):
    return gen.submit(ids, SamplingParams(max_new_tokens=1), session=session, adapter=adapter)


def test_speculative_drafts_verify_under_the_requests_adapter(engine):
    kind, gen = engine
    ids = gen.tokenize(" ".join(PROMPTS * 2))  # under "ko" its continuation soon loops: lookups find drafts
    plain = _run(gen, [(ids, "ko")], speculative=False, max_new_tokens=32)[0].token_ids
    before = gen.engine.drafted_tokens
    drafted = _run(gen, [(ids, "ko")], speculative=True, max_new_tokens=32)[0].token_ids
    assert gen.engine.drafted_tokens > before  # prompt lookup drafted, the adapter's model verified
    assert drafted == plain


def test_an_unknown_adapter_is_not_found_naming_it(engine):
    kind, gen = engine
    with pytest.raises(NotFound, match="'nope'.*loaded: attn, mlp, every, ko"):
        gen.bridge.run(gen.request("hi", SamplingParams(max_new_tokens=1), adapter="nope"))
    with pytest.raises(NotFound, match="'nope'"):
        gen.new_session(adapter="nope")


# ---- bad adapters: each a clear error naming the adapter and what is wrong ----


@pytest.fixture(scope="module")
def model(base):
    return load_model(str(base[0]), "fp32")[0]


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_folder_without_config_or_weights_is_refused(base, model, tmp_path):
    good = base[2]["attn"]
    with pytest.raises(AdapterError, match=r"'x' \(.*\): not a folder"):
        load_adapter("x", str(tmp_path / "missing"), model, 64)
    no_config = _copy(good, tmp_path / "a")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="'x'.*no adapter_config.json"):
        load_adapter("x", str(no_config), model, 64)
    torn = _copy(good, tmp_path / "b")
    (torn / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not JSON"):
        load_adapter("x", str(torn), model, 64)
    no_weights = _copy(good, tmp_path / "c")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_adapter("x", str(no_weights), model, 64)
    garbage = _copy(good, tmp_path / "d")
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(AdapterError, match="does not read"):
        load_adapter("x", str(garbage), model, 64)


def test_a_rank_over_max_lora_rank_is_refused(base, model):
    with pytest.raises(AdapterError, match=r"'ko'.*rank 16, over MAX_LORA_RANK=8"):
        load_adapter("ko", str(base[2]["ko"]), model, 8)
    assert load_adapter("ko", str(base[2]["ko"]), model, 16).rank == 16


def test_an_adapter_of_another_model_is_refused(base, model, tmp_path):
    _hf_logging_quiet()
    cfg = tiny_config(vocab=300, layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, context=512)
    write_hf_folder(tmp_path / "other", cfg, tiny_weights(cfg), tiny_bpe_tokenizer(300))
    other = write_adapter(tmp_path / "other", tmp_path / "lora", ["q_proj"], 4, 8, False, seed=0)
    with pytest.raises(AdapterError, match=r"'other'.*q_proj: lora_A \[4, 32\].*do not fit.*64"):
        load_adapter("other", str(other), model, 64)


def test_target_modules_the_model_lacks_are_refused(base, model, tmp_path):
    folder = _copy(base[2]["attn"], tmp_path / "a")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = ["qkv_proj", "q_proj"]  # Phi-3's fused name, on a Llama
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"'a'.*target modules \['qkv_proj'\], which this llama model lacks"):
        load_adapter("a", str(folder), model, 64)


def test_lora_adapters_setting_is_parsed_and_bounded(base, model):
    folder = base[2]["attn"]
    store = AdapterStore.from_setting(f"one={folder}, two={folder}", model, max_loras=2)
    assert store.names() == ["one", "two"]
    with pytest.raises(TooManyAdapters, match=r"'three'.*MAX_LORAS=2"):
        AdapterStore.from_setting(f"one={folder},two={folder},three={folder}", model, max_loras=2)
    with pytest.raises(AdapterExists, match=r"'one'.*loaded already"):
        AdapterStore.from_setting(f"one={folder},one={folder}", model)
    with pytest.raises(ValueError, match="expected name=folder"):
        AdapterStore.from_setting(str(folder), model)


# ---- llama.cpp's GGUF LoRA files (convert_lora_to_gguf.py from the llama-cpp-python sdist) ----

GGUF_ADAPTERS = ["attn", "every", "ko"]  # "mlp" is rsLoRA, which the converter drops (llama.cpp scales alpha / r)


def convert_lora(adapter_folder, base_folder, out, outtype: str = "f32"):
    """llama.cpp's convert_lora_to_gguf.py on a PEFT folder (the base model's config from base_folder)."""
    import subprocess

    src = llama_cpp_sources()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([converter_python(), str(src / "convert_lora_to_gguf.py"), "--base", str(base_folder),
                        "--outfile", str(out), "--outtype", outtype, str(adapter_folder)],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return out


@pytest.fixture(scope="module")
def gguf_adapters(base, tmp_path_factory):
    """{name: the .gguf llama.cpp's converter made of that PEFT folder}; "every" also as F16."""
    root = tmp_path_factory.mktemp("lora-gguf")
    out = {name: convert_lora(base[2][name], base[0], root / f"{name}.gguf") for name in GGUF_ADAPTERS}
    out["every-f16"] = convert_lora(base[2]["every"], base[0], root / "every-f16.gguf", "f16")
    return out


def test_a_gguf_lora_holds_what_its_peft_folder_does(base, model, gguf_adapters):
    """The converter's layout (A [r, in] and B [out, r] in ggml's reversed dims, B's q/k rows permuted
    for llama.cpp's RoPE, alpha in adapter.lora.alpha) read back into the folder's own numbers."""
    for name in GGUF_ADAPTERS:
        folder = load_adapter(name, str(base[2][name]), model, 64)
        gguf_file = load_adapter(name, str(gguf_adapters[name]), model, 64)
        assert (gguf_file.rank, gguf_file.targets) == (folder.rank, folder.targets)
        for i, (ours, theirs) in enumerate(zip(gguf_file.layers, folder.layers, strict=True)):
            assert ours.keys() == theirs.keys(), (name, i)
            for linear in ours:
                for x, y in zip(ours[linear], theirs[linear], strict=True):
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=f"{name} layer {i} {linear}")
    half = load_adapter("h", str(gguf_adapters["every-f16"]), model, 64)
    full = load_adapter("f", str(base[2]["every"]), model, 64)
    torch.testing.assert_close(half.layers[1]["qkv"][1], full.layers[1]["qkv"][1], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_lora_adapters_naming_gguf_files_give_the_folders_tokens_and_logprobs(base, gguf_adapters, kind):
    folder, gguf_path, adapters = base
    spec = ",".join([f"{n}={adapters[n]}" for n in GGUF_ADAPTERS] + [f"{n}-gguf={gguf_adapters[n]}"
                                                                     for n in GGUF_ADAPTERS])
    path = str(folder if kind == "hf" else gguf_path)
    gen = Generator(*load_model(path, "fp32" if kind == "hf" else "auto"), EngineOptions(lora_adapters=spec),
                    model_path=path)
    try:
        ids = gen.tokenize(PROMPTS[1])
        jobs = [(ids, n) for n in GGUF_ADAPTERS] + [(ids, f"{n}-gguf") for n in GGUF_ADAPTERS]
        out = _run(gen, jobs, logprobs=5)
        for n, from_folder, from_gguf in zip(GGUF_ADAPTERS, out[:3], out[3:], strict=True):
            assert from_gguf.token_ids == from_folder.token_ids, n
            for a, b in zip(from_gguf.logprobs, from_folder.logprobs, strict=True):
                assert [t for t, _ in a.top] == [t for t, _ in b.top], n
                torch.testing.assert_close(torch.tensor([lp for _, lp in a.top]),
                                           torch.tensor([lp for _, lp in b.top]), rtol=0, atol=1e-4)
        plain = _run(gen, [(ids, "")])[0].token_ids
        assert all(r.token_ids != plain for r in out)  # each adapter changes the output: a lost delta would show
    finally:
        gen.close()


def test_a_gguf_that_is_no_lora_adapter_is_refused(base, model, gguf_adapters, tmp_path):
    with pytest.raises(AdapterError, match=r"'m'.*general.type None.*not a LoRA adapter"):
        load_adapter("m", str(base[1]), model, 64)  # the base model's own GGUF
    garbage = tmp_path / "x.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(AdapterError, match=r"'g'.*not a GGUF file"):
        load_adapter("g", str(garbage), model, 64)
    with pytest.raises(AdapterError, match=r"'ko'.*rank 16, over MAX_LORA_RANK=8"):
        load_adapter("ko", str(gguf_adapters["ko"]), model, 8)


def test_a_gguf_lora_of_another_model_is_refused(model, tmp_path):
    _hf_logging_quiet()
    cfg = tiny_config(vocab=300, layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, context=512)
    write_hf_folder(tmp_path / "other", cfg, tiny_weights(cfg), tiny_bpe_tokenizer(300))
    other = write_adapter(tmp_path / "other", tmp_path / "lora", ["q_proj"], 4, 8, False, seed=0)
    converted = convert_lora(other, tmp_path / "other", tmp_path / "other.gguf")
    with pytest.raises(AdapterError, match=r"'other'.*q_proj: lora_A \[4, 32\].*do not fit.*64"):
        load_adapter("other", str(converted), model, 64)


# ---- loading and unloading at run time ----


@pytest.fixture
def bare(base):
    """An engine on the HF folder with no adapter loaded at start, room for two."""
    path = str(base[0])
    gen = Generator(*load_model(path, "fp32"), EngineOptions(max_loras=2), model_path=path)
    yield gen
    gen.close()


def test_an_adapter_loaded_at_run_time_runs_as_one_loaded_at_start(base, engine, bare, gguf_adapters, monkeypatch):
    import threading

    import kvgen.engine.generator as generator_mod

    kind, gen = engine
    if kind != "hf":
        pytest.skip("the run-time engine is on the HF folder")
    readers = []
    real = generator_mod.load_adapter

    def recording(*args):
        readers.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(generator_mod, "load_adapter", recording)
    ids = gen.tokenize(PROMPTS[0])
    bare.bridge.run(bare.load_adapter("ko", str(base[2]["ko"])))
    bare.bridge.run(bare.load_adapter("every", str(gguf_adapters["every"])))
    assert readers and all(t is not threading.main_thread() and t.name != "bridge" for t in readers)  # off the loop
    assert bare.adapters.names() == ["ko", "every"]
    for name in ("ko", "every"):
        assert _run(bare, [(ids, name)])[0].token_ids == _run(gen, [(ids, name)])[0].token_ids, name


def test_a_load_beyond_max_loras_or_of_a_loaded_name_is_refused_and_leaks_nothing(base, bare, tmp_path):
    load = lambda name, path: bare.bridge.run(bare.load_adapter(name, str(path)))  # noqa: E731
    load("a", base[2]["attn"])
    with pytest.raises(AdapterExists, match="'a'.*loaded already"):
        load("a", base[2]["mlp"])
    with pytest.raises(AdapterError, match="'b'.*not a folder"):
        load("b", tmp_path / "missing")  # a failed load gives its slot back...
    load("b", base[2]["mlp"])  # ...so this one fits
    with pytest.raises(TooManyAdapters, match=r"'c'.*2 adapters are loaded already \(MAX_LORAS=2\)"):
        load("c", base[2]["ko"])
    assert bare.adapters.names() == ["a", "b"]
    ids = bare.tokenize(PROMPTS[0])
    assert _run(bare, [(ids, "b")])[0].token_ids  # still serving


def test_unloading_refuses_new_requests_at_once_and_waits_for_running_ones(base, bare):
    bare.bridge.run(bare.load_adapter("ko", str(base[2]["ko"])))
    ids = bare.tokenize(PROMPTS[0])
    session = bare.new_session(adapter="ko")

    async def go():
        running = bare.submit(ids, SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True), adapter="ko")
        await running.__anext__()  # it runs
        unload = asyncio.ensure_future(bare.unload_adapter("ko", timeout_s=60))
        await asyncio.sleep(0.05)
        assert not unload.done()  # waiting for `running`
        with pytest.raises(NotFound, match="'ko' is not loaded"):
            await bare.request(PROMPTS[0], SamplingParams(max_new_tokens=1), adapter="ko")
        with pytest.raises(NotFound, match="'ko'.*being unloaded or was"):
            bare.submit(ids, SamplingParams(max_new_tokens=1), session=session)  # nor its sessions' turns
        running.cancel()
        await asyncio.wait_for(unload, 30)  # done once the engine let `running` go
        await running.released()

    bare.bridge.run(go())
    assert bare.adapters.names() == [] and bare.adapters.adapters == {}
    bare.close_session(session.session_id)
    bare.bridge.run(bare.load_adapter("ko", str(base[2]["ko"])))  # its name and slot are free again


def test_an_unload_that_times_out_is_failed_precondition_and_the_adapter_keeps_serving(base, bare):
    bare.bridge.run(bare.load_adapter("ko", str(base[2]["ko"])))
    ids = bare.tokenize(PROMPTS[0])

    async def go():
        running = bare.submit(ids, SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True), adapter="ko")
        await running.__anext__()
        with pytest.raises(AdapterInUse, match="'ko': 1 requests still run with it after 0.2 s; it stays loaded"):
            await bare.unload_adapter("ko", timeout_s=0.2)
        running.cancel()
        await running.released()

    bare.bridge.run(go())
    assert bare.adapters.names() == ["ko"]
    assert _run(bare, [(ids, "ko")])[0].token_ids  # serving again
    assert bare.adapters.get("ko").active == 0  # every request's hold was let go
    bare.bridge.run(bare.unload_adapter("ko", timeout_s=1))
    with pytest.raises(NotFound):
        bare.bridge.run(bare.unload_adapter("ko", timeout_s=1))


def test_a_reloaded_adapter_never_meets_its_old_prefix_cache_blocks(base, bare):
    """Unload "x", load another adapter as "x": the old K/V is keyed by the old load's serial."""
    ids = bare.tokenize("numbers 123 4567 89, and the year 2024. " * 4)
    bare.bridge.run(bare.load_adapter("x", str(base[2]["attn"])))
    first = bare.adapters.get("x").serial
    _run(bare, [(ids, "x")], max_new_tokens=2)
    assert _run(bare, [(ids, "x")], max_new_tokens=2)[0].usage.cached_tokens >= bare.pool.block_size
    bare.bridge.run(bare.unload_adapter("x", timeout_s=5))
    bare.bridge.run(bare.load_adapter("x", str(base[2]["mlp"])))
    assert bare.adapters.get("x").serial != first
    again = _run(bare, [(ids, "x")], max_new_tokens=STEPS)[0]
    assert again.usage.cached_tokens == 0
    fresh = Generator(*load_model(str(base[0]), "fp32"), EngineOptions(lora_adapters=f"x={base[2]['mlp']}"))
    try:
        assert again.token_ids == _run(fresh, [(ids, "x")], max_new_tokens=STEPS)[0].token_ids
    finally:
        fresh.close()


# ---- a base model whose family takes no adapters: a Mamba-2 (tests/engine/test_mamba2.py's tiny model) ----


@pytest.fixture(scope="module")
def mamba2_adapter(files, tmp_path_factory):  # noqa: F811
    """A PEFT LoRA of test_mamba2.py's tiny Mamba-2 over its in_proj (the module PEFT lets a Mamba adapt), B
    non-zero: what a user who trained one with PEFT would hand the server."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _hf_logging_quiet()
    hf = AutoModelForCausalLM.from_pretrained(str(files[0]), dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("mamba2-lora")
    peft_model.save_pretrained(str(out))
    return out


def test_a_mamba2_base_refuses_every_adapter_load_naming_its_family_and_serves_on(files, mamba2_adapter):  # noqa: F811
    """LORA_ADAPTERS at start is an UnsupportedModel (the server's one line and exit 2) that names the setting,
    the adapter and the family, raised before the Generator makes anything (no thread started); a load at
    run time (Generator.load_adapter, as LoadAdapter and /v1/load_lora_adapter call it) is refused the same
    way with no name or MAX_LORAS slot left held, and the engine's greedy tokens are transformers' after it."""
    import threading

    from kvgen.engine.lora import AdaptersUnsupported
    from kvgen.engine.model_config import UnsupportedModel
    from tests.engine.test_mamba2 import PROMPTS as MAMBA_PROMPTS
    from tests.engine.test_mamba2 import STEPS as MAMBA_STEPS
    from tests.engine.test_mamba2 import expected

    folder, _, hf = files
    model, tok = load_model(str(folder), "fp32")
    said = r"LoRA adapter 'a' \(.*\): the base model is a mamba2 model, which takes no LoRA adapters: a state-space"
    threads = set(threading.enumerate())
    with pytest.raises(AdaptersUnsupported, match="^LORA_ADAPTERS: " + said) as refused:
        Generator(model, tok, EngineOptions(lora_adapters=f"a={mamba2_adapter}"))
    assert isinstance(refused.value, UnsupportedModel)
    assert set(threading.enumerate()) == threads
    with pytest.raises(AdaptersUnsupported, match="^" + said):
        load_adapter("a", str(mamba2_adapter), model, 64)
    gen = Generator(model, tok, EngineOptions(max_loras=1))
    try:
        with pytest.raises(AdaptersUnsupported, match="^" + said):
            gen.bridge.run(gen.load_adapter("a", str(mamba2_adapter)))
        with pytest.raises(AdaptersUnsupported, match="mamba2"):  # a second try: its one slot was not kept
            gen.bridge.run(gen.load_adapter("a", str(mamba2_adapter)))
        assert gen.adapters.names() == [] and not gen.adapters._busy
        with pytest.raises(NotFound, match="'a' is not loaded"):
            gen.adapter("a")
        ids = tok.encode(MAMBA_PROMPTS[0])
        out = gen.generate(ids, SamplingParams(temperature=0, max_new_tokens=MAMBA_STEPS, ignore_eos=True))
        assert out.token_ids == expected(hf, ids)
    finally:
        gen.close()
