"""The loader against transformers (HF folders) and against itself (GGUF written by gguf-py).

Tiny random models are written to disk the way real checkpoints are: an HF folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and a GGUF as
llama.cpp's converter writes it (metadata, gpt2 tokenizer, q/k rows permuted for llama,
2-D weights in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K).
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from kvgen.engine import model_files
from kvgen.engine.attention import Step
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.sampling import SamplingParams
from tests import tiny
from tests.engine.test_oracle import hf_greedy, run_chunks
from tests.tiny import (
    CHATML_TEMPLATE,
    tiny_bpe_tokenizer,
    tiny_config,
    tiny_weights,
    write_gguf,
    write_hf_folder,
)

Q = gguf.GGMLQuantizationType
TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces and   runs\t\ttabs\n\nnewlines  ",
    "def add(a, b):\n    return a + b\n",
    "unseen words: zebra quokka, café naïve — “quotes” 你好 🤖",
    "numbers 123 4567 89 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "And sunsets?"}],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These models are tiny: on a busy 2-core machine, two intra-op threads make each forward
    # ~20x slower than one (measured: 12 s vs 0.25 s for this file's logits checks).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bpe():
    return tiny_bpe_tokenizer(300)


def token_sequences(vocab: int, tok) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 23, 41)]
    seqs.append(tok.encode("The quick brown fox jumps over the lazy dog. Hello, world! 123").ids)
    return seqs


def chunkings(n: int) -> list[list[int]]:
    """One prefill; and a prefill of 10, a chunk of 7, then decode steps (all attention paths)."""
    return [[n], [10, 7] + [1] * (n - 17)] if n > 17 else [[n], [2] + [1] * (n - 2)]


def logits_at_chunk_ends(model, ids, chunks) -> tuple[torch.Tensor, list[int]]:
    out = run_chunks(model, ids, chunks)
    return torch.stack(out), (torch.tensor(chunks).cumsum(0) - 1).tolist()


def all_logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of ids that returns the logits of every position [len(ids), vocab]."""
    cfg, n = model.cfg, len(ids)
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 64)
    cache = PagedKVCache(pool)
    cache.reserve(n)
    blocks, offsets = cache.slots(0, n)
    step = Step(positions=torch.arange(n), write_blocks=blocks, write_offsets=offsets, query_lens=[n],
                context_lens=[n], block_tables=torch.tensor([cache.blocks]), logits_rows=torch.arange(n),
                is_decode=False)
    return model.forward(torch.tensor(ids), step, fmt, pool.store)


# 1. HF folders against transformers

def hf_config(arch: str, vocab: int):
    cfg = tiny_config(arch=arch, vocab=vocab)
    # non-default values, so that a field the loader ignores shows up in the logits
    cfg.rope_theta = 50000.0 if arch == "llama" else 1000000.0
    cfg.rms_norm_eps = 1e-5 if arch == "llama" else 1e-6
    cfg.bos_token_id = None if arch == "qwen2" else 0
    cfg.eos_token_ids = [2] if arch == "llama" else [0, 2]
    return cfg


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_pair(request, tmp_path_factory):
    """(tokenizers.Tokenizer, cfg, our model, our tokenizer, transformers model, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    arch = request.param
    bpe = tiny_bpe_tokenizer(300, style=arch)
    cfg = hf_config(arch, bpe.get_vocab_size())
    folder = tmp_path_factory.mktemp(f"hf-{arch}")
    write_hf_folder(folder, cfg, tiny_weights(cfg, seed=7), bpe)
    model, tok = load_model(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    return bpe, cfg, model, tok, hf, hf_tok


def test_hf_config_read_from_config_json(hf_pair):
    _, cfg, model, _, hf, _ = hf_pair
    got = model.cfg
    for f in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "context_length", "rms_norm_eps", "rope_theta",
              "tie_word_embeddings", "qkv_bias", "bos_token_id", "eos_token_ids"):
        assert getattr(got, f) == getattr(cfg, f), f
    assert hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_hf_logits_match_transformers(hf_pair):
    bpe, cfg, model, _, hf, _ = hf_pair
    for ids in token_sequences(cfg.vocab_size, bpe):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        err = (all_logits(model, ids) - ref).abs().max().item()
        assert err < 1e-4, f"{cfg.architecture} len {len(ids)}, every position: max |diff| {err}"
        for chunks in chunkings(len(ids)):
            ours, ends = logits_at_chunk_ends(model, ids, chunks)
            err = (ours - ref[ends]).abs().max().item()
            assert err < 1e-4, f"{cfg.architecture} len {len(ids)} chunks {chunks[:3]}: max |diff| {err}"


def test_hf_greedy_matches_transformers(hf_pair):
    bpe, cfg, model, tok, hf, _ = hf_pair
    gen = Generator(model, tok, EngineOptions(kv_cache_mb=8))
    try:
        for ids in token_sequences(cfg.vocab_size, bpe):
            r = gen.generate(ids, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
            assert len(r.token_ids) == 16
            assert r.token_ids == hf_greedy(hf, ids, 16), ids
    finally:
        gen.close()


def test_hf_tokenizer_matches_transformers(hf_pair):
    _, _, _, tok, _, hf_tok = hf_pair
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text, add_special_tokens=True).input_ids, text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special=False) == hf_tok.decode(ids, skip_special_tokens=False), text
    assert tok.decode(tok.encode(TEXTS[3])) == TEXTS[3]  # byte-level: lossless


def test_hf_chat_template_matches_transformers(hf_pair):
    _, _, _, tok, _, hf_tok = hf_pair
    assert tok.chat_template == CHATML_TEMPLATE
    for chat in CHATS:
        ref = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref
        assert tok.encode_chat(chat) == hf_tok(ref, add_special_tokens=False).input_ids


MISTRAL_TEMPLATE = (  # uses bos_token and eos_token, as Mistral's and Llama 2's templates do
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")


def test_chat_template_bos_and_eos_tokens_match_transformers(bpe, tmp_path):
    """bos_token / eos_token inside a template render as the model's tokens (folder and GGUF)."""
    from transformers import AutoTokenizer

    cfg = tiny_config(arch="llama", vocab=bpe.get_vocab_size())
    cfg.bos_token_id, cfg.eos_token_ids = 0, [2]
    weights = tiny_weights(cfg, seed=5)
    write_hf_folder(tmp_path, cfg, weights, bpe, chat_template=MISTRAL_TEMPLATE)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc["bos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    write_gguf(tmp_path / "m.gguf", cfg, weights, bpe, chat_template=MISTRAL_TEMPLATE)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    _, folder_tok = load_model(str(tmp_path))
    _, gguf_tok = load_model(str(tmp_path / "m.gguf"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}]
    ref = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ref == "<|endoftext|>[INST] hi [/INST]hello<|im_end|>[INST] bye [/INST]"
    assert folder_tok.apply_chat_template(chat) == ref
    assert gguf_tok.apply_chat_template(chat) == ref


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"])
def test_hf_llama3_rope_scaling_matches_transformers(bpe, tmp_path, style):
    """Llama 3.1 RoPE scaling, as older configs write it ("rope_scaling") and as transformers 5
    saves it ("rope_parameters", with rope_theta inside)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch="llama", vocab=bpe.get_vocab_size(), hidden=64, heads=4, kv_heads=2)
    cfg.rope_theta, cfg.bos_token_id, cfg.eos_token_ids = 500000.0, 0, [2]
    write_hf_folder(tmp_path, cfg, tiny_weights(cfg, seed=3), bpe)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    if style == "rope_scaling":
        hf_cfg["rope_scaling"] = dict(LLAMA3_ROPE)
    else:
        del hf_cfg["rope_theta"]
        hf_cfg["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    model, _ = load_model(str(tmp_path))
    assert model.cfg.rope_theta == 500000.0
    assert (model.cfg.rope_scaling or {}).get("rope_type") == "llama3"
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = token_sequences(cfg.vocab_size, bpe)[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (all_logits(model, ids) - ref).abs().max().item() < 1e-4
    unscaled = model_files.load(str(tmp_path))
    unscaled[0].rope_scaling = None  # the scaling matters at these positions
    assert (all_logits(Model(unscaled[0], unscaled[1]), ids) - ref).abs().max().item() > 1e-2


# 2. GGUF round trip: the same weights through gguf-py's writer

def gguf_config(arch: str, vocab: int):
    # rows a multiple of 256 (the K-quant super-block); head_dim 64
    cfg = tiny_config(arch=arch, vocab=vocab, hidden=256, heads=4, kv_heads=2, ffn=512, layers=2)
    cfg.rope_theta = 50000.0
    cfg.bos_token_id, cfg.eos_token_ids = 0, [2]
    return cfg


@pytest.fixture(scope="module")
def gguf_base(bpe, tmp_path_factory):
    """(dir, cfg, weights, our model from the HF folder of those weights, its tokenizer)."""
    cfg = gguf_config("llama", bpe.get_vocab_size())
    weights = tiny_weights(cfg, seed=11)
    d = tmp_path_factory.mktemp("gguf")
    write_hf_folder(d / "hf", cfg, weights, bpe)
    model, tok = load_model(str(d / "hf"))
    return d, cfg, weights, model, tok


def test_gguf_f32_equals_hf_folder(gguf_base, bpe):
    d, cfg, weights, hf_model, _ = gguf_base
    path = d / "f32.gguf"
    write_gguf(path, cfg, weights, bpe)
    got_cfg, got_w, src = model_files.load(str(path))
    assert "gguf" in src
    for f in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "context_length", "rope_theta", "tie_word_embeddings", "qkv_bias",
              "bos_token_id", "eos_token_ids"):
        assert getattr(got_cfg, f) == getattr(cfg, f), f
    assert got_cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert sorted(got_w) == sorted(weights)
    for name, w in weights.items():  # q/k un-permuted back to HF order, bit for bit
        assert got_w[name].dtype == torch.float32 and torch.equal(got_w[name], w), name
    model, _ = load_model(str(path))
    for ids in token_sequences(cfg.vocab_size, bpe):
        for chunks in chunkings(len(ids)):
            ours, _ = logits_at_chunk_ends(model, ids, chunks)
            ref, _ = logits_at_chunk_ends(hf_model, ids, chunks)
            assert (ours - ref).abs().max().item() < 1e-5


def test_gguf_qwen2_with_bias_unpermuted(bpe, tmp_path):
    """qwen2 GGUFs keep q/k rows in HF order (llama.cpp's converter only permutes llama)."""
    cfg = gguf_config("qwen2", bpe.get_vocab_size())
    weights = tiny_weights(cfg, seed=12)
    write_gguf(tmp_path / "q.gguf", cfg, weights, bpe)
    got_cfg, got_w, _ = model_files.load(str(tmp_path / "q.gguf"))
    assert got_cfg.architecture == "qwen2" and got_cfg.qkv_bias
    for name, w in weights.items():
        assert torch.equal(got_w[name], w), name


def test_gguf_tokenizer_matches_folder(gguf_base, bpe):
    d, cfg, weights, _, folder_tok = gguf_base
    path = d / "tok.gguf"
    write_gguf(path, cfg, weights, bpe)
    _, tok = load_model(str(path))
    assert tok.vocab_size == bpe.get_vocab_size()
    for text in TEXTS:
        assert tok.encode(text) == folder_tok.encode(text), text
        assert tok.decode(tok.encode(text)) == folder_tok.decode(folder_tok.encode(text)), text
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == folder_tok.apply_chat_template(chat)


# 3. errors

def test_unsupported_architecture_in_config_json(gguf_base, tmp_path):
    d = gguf_base[0]
    folder = tmp_path / "gpt2"
    folder.mkdir()
    for f in ("model.safetensors", "tokenizer.json"):
        (folder / f).write_bytes((d / "hf" / f).read_bytes())
    hf = json.loads((d / "hf" / "config.json").read_text())
    hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        model_files.load(str(folder))


def test_unsupported_architecture_in_gguf(gguf_base, bpe, tmp_path):
    _, cfg, weights, _, _ = gguf_base
    path = tmp_path / "falcon.gguf"
    write_gguf(path, cfg, weights, bpe, arch="falcon")
    with pytest.raises(ValueError, match="falcon"):
        model_files.load(str(path))


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        model_files.load(str(missing))


def test_folder_without_safetensors(gguf_base, tmp_path):
    d = gguf_base[0]
    (tmp_path / "config.json").write_text((d / "hf" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        model_files.load(str(tmp_path))


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_files.load(str(tmp_path))


def test_a_tensor_type_without_kernels_is_refused_by_name(gguf_base, bpe, tmp_path, monkeypatch):  # noqa: F811
    """A type kvgen runs no kernel for (IQ2_XXS here) stops the load with the tensor and its type
    named, rather than running as a dequantized float copy."""
    _, cfg, weights, _, _ = gguf_base
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[iq2]
    real = tiny.gguf_quantize
    monkeypatch.setattr(tiny, "gguf_quantize", lambda a, q: np.zeros((a.shape[0], a.shape[1] // block * size),
                                                                     np.uint8) if q == iq2 else real(a, q))
    path = tmp_path / "iq2.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=gguf.GGMLQuantizationType.Q4_0,
               types={"model.layers.1.mlp.up_proj.weight": iq2})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight is IQ2_XXS, a type kvgen does not run"):
        model_files.load(str(path))
