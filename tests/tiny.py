"""Tiny random Llama-family models for fast tests (weights under HF names, float32)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

import torch

from kvgen.engine.model_config import ModelConfig


def tiny_config(arch: str = "llama", vocab: int = 49152, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, ffn: int = 128, context: int = 2048) -> ModelConfig:
    return ModelConfig(architecture=arch, name=f"tiny-{arch}", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=ffn, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=hidden // heads, context_length=context, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True, qkv_bias=arch == "qwen2", bos_token_id=1, eos_token_ids=[2])


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    h, d = cfg.hidden_size, cfg.head_dim
    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, scale=0.5),
         "model.norm.weight": 1 + rand(h, scale=0.1)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rand(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(h, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(h, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = rand(cfg.num_heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rand(cfg.num_kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = rand(cfg.num_kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, cfg.num_heads * d)
        w[p + "mlp.gate_proj.weight"] = rand(cfg.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = rand(cfg.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = rand(h, cfg.intermediate_size)
        if cfg.qkv_bias:
            for n, size in (("q", cfg.num_heads * d), ("k", cfg.num_kv_heads * d), ("v", cfg.num_kv_heads * d)):
                w[p + f"self_attn.{n}_proj.bias"] = rand(size)
    return w


# --- on-disk tiny models: a byte-level BPE, an HF folder, a GGUF (used by test_model_files.py) ---

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I'm fine, thanks.",
    "def add(a, b):\n    return a + b\n",
    "Les chats et les chiens sont amis. café naïve",
    "numbers 123 4567 89, and the year 2024",
]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's tokenizer.json


def tiny_bpe_tokenizer(vocab_size: int = 300, style: str = "gpt2"):
    """A byte-level BPE trained on a few sentences; specials get ids 0, 1, 2. style "gpt2": GPT-2's
    ByteLevel split; "qwen2": NFC + Qwen2's split regex, as in Qwen2's tokenizer.json (transformers 5
    rebuilds a qwen2 model's tokenizer with those whatever tokenizer.json says)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_CORPUS * 4, trainer)
    return tok


_HF_ARCH_NAMES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
                  "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def write_hf_folder(folder, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer,
                    chat_template: str = CHATML_TEMPLATE) -> None:
    """config.json + model.safetensors + tokenizer.json + tokenizer_config.json, as HF writes them."""
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arch_name, model_type = _HF_ARCH_NAMES[cfg.architecture]
    hf = {
        "architectures": [arch_name], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids if len(cfg.eos_token_ids) > 1
        else cfg.eos_token_ids[0], "torch_dtype": "float32", "use_cache": True,
    }
    if cfg.architecture == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if cfg.architecture == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    tokenizer.save(str(folder / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template,
          "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
          "model_max_length": cfg.context_length, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))


# K-quants, written from llama.cpp's reference layout (ggml-quants.c, quantize_row_q{4,6}_K_ref),
# independently of gguf-py's dequantizers (gguf-py has no quantizer for them).

def quantize_q4_k(x):
    import numpy as np

    b = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)  # super-blocks of 8 x 32
    n = b.shape[0]
    lo = np.minimum(b.min(-1), 0.0)
    scales, mins = (b.max(-1) - lo) / 15.0, -lo
    max_scale, max_min = scales.max(-1, keepdims=True), mins.max(-1, keepdims=True)
    inv_s = np.divide(63.0, max_scale, out=np.zeros_like(max_scale), where=max_scale > 0)
    inv_m = np.divide(63.0, max_min, out=np.zeros_like(max_min), where=max_min > 0)
    ls = np.clip(np.round(inv_s * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.round(inv_m * mins), 0, 63).astype(np.uint8)
    d = (max_scale[:, 0] / 63.0).astype(np.float16)
    dmin = (max_min[:, 0] / 63.0).astype(np.float16)
    de = d.astype(np.float32)[:, None] * ls
    me = dmin.astype(np.float32)[:, None] * lm
    q = np.divide(b + me[..., None], de[..., None], out=np.zeros_like(b), where=de[..., None] > 0)
    L = np.clip(np.round(q), 0, 15).astype(np.uint8)
    sc = np.empty((n, 12), np.uint8)
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    L = L.reshape(n, 4, 2, 32)  # 64-value chunks: low nibbles = first 32, high = next 32
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    head = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2)]
    blocks = np.concatenate([*head, sc, qs], axis=1)
    return blocks.reshape(*np.shape(x)[:-1], np.shape(x)[-1] // 256 * 144)


def quantize_q6_k(x):
    import numpy as np

    b = np.asarray(x, dtype=np.float32).reshape(-1, 16, 16)  # super-blocks of 16 x 16
    n = b.shape[0]
    amax = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]  # signed
    scales = -amax / 32.0
    max_scale = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)
    iscale = np.divide(-128.0, max_scale, out=np.zeros_like(max_scale), where=max_scale != 0)
    d = np.divide(1.0, iscale, out=np.zeros_like(iscale), where=iscale != 0)[:, 0].astype(np.float16)
    sc = np.clip(np.round(iscale * scales), -128, 127).astype(np.int8)
    de = d.astype(np.float32)[:, None] * sc
    q = np.divide(b, de[..., None], out=np.zeros_like(b), where=de[..., None] != 0)
    L = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # 128-value halves
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(n, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(n, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    return blocks.reshape(*np.shape(x)[:-1], np.shape(x)[-1] // 256 * 210)


def gguf_quantize(array, qtype):
    """gguf.quants.quantize, plus the K-quants gguf-py cannot write."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(array)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return quantize_q6_k(array)
    return gguf.quants.quantize(array, qtype)


def llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the rotary halves of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer, qtype=None,
               chat_template: str | None = CHATML_TEMPLATE, arch: str | None = None,
               types: dict | None = None, pre: str = "gpt-2") -> None:
    """A GGUF as llama.cpp's converter writes one: metadata, gpt2 tokenizer (its pre-tokenizer `pre`:
    GPT-2's split, tiny_bpe_tokenizer's), permuted q/k (llama), 2-D weights in `qtype` (default F32) or
    the type `types` gives their HF name (a mixture, as llama-quantize writes), 1-D tensors in F32."""

    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    arch = arch or cfg.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(cfg.name)
    p = arch + "."
    w.add_uint32(p + "block_count", cfg.num_layers)
    w.add_uint32(p + "context_length", cfg.context_length)
    w.add_uint32(p + "embedding_length", cfg.hidden_size)
    w.add_uint32(p + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(p + "attention.head_count", cfg.num_heads)
    w.add_uint32(p + "attention.head_count_kv", cfg.num_kv_heads)
    w.add_float32(p + "rope.freq_base", cfg.rope_theta)
    w.add_float32(p + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(p + "vocab_size", cfg.vocab_size)
    w.add_uint32(p + "rope.dimension_count", cfg.head_dim)
    tj = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tj["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for name, t in weights.items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_GGUF_NAMES[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj."):
                a = llama_cpp_permute(a, cfg.num_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj."):
                a = llama_cpp_permute(a, cfg.num_kv_heads)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        a = np.ascontiguousarray(a)
        t = (types or {}).get(name, qtype)
        if a.ndim == 2 and t != gguf.GGMLQuantizationType.F32:
            data = gguf_quantize(a, t)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=t)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- tiny models of each family: a transformers config -> save_pretrained, and llama.cpp's own converter ---

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored convert_hf_to_gguf.py converts
_REPO = Path(__file__).resolve().parents[1]
TEST_CACHE = Path.home() / ".cache" / "kvgen-tests"

# Shapes small enough to run in well under a second a step, with GQA and two layers. Per family what
# makes it that family (transformers' own config classes fill in the rest: Qwen3's q/k norms, Phi-3's
# fused matrices come with the model type).
FAMILY_SHAPES = {
    "llama": dict(head_dim=16, rope_parameters={  # Llama 3.x's scaling, short enough to matter here
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(head_dim=24),  # head_dim from the config, not hidden / heads (Qwen3's own models do this)
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 512}),
    # Gemma 3 1B's layout: five windowed layers then a global one (what llama.cpp assumes for a gemma3 GGUF),
    # a window short enough to slide within a test's prompts, a final logit cap low enough to bite
    "gemma3": dict(head_dim=16, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16,
                   final_logit_softcapping=5.0, tie_word_embeddings=True),
    # Gemma 2's layout: windowed and global layers alternating (layer 0 windowed), attention scores and
    # logits soft-capped at caps low enough to bite (this model's raw scores reach ~3, its logits ~10);
    # tied embeddings (the converter drops a gemma2 lm_head); queries by head_dim, what llama.cpp assumes
    "gemma2": dict(head_dim=16, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16,
                   attn_logit_softcapping=1.5, final_logit_softcapping=5.0, tie_word_embeddings=True),
}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # transformers' model type where it is not the GGUF family


def family_model(family: str, vocab: int, seed: int = 0, **overrides):
    """A transformers model of `family`, random weights at the scale tiny_weights uses (transformers' own
    init, std 0.02, makes near-flat logits whose greedy picks hang on rounding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                 eos_token_id=2, tie_word_embeddings=False)
    cfg = AutoConfig.for_model(_MODEL_TYPES.get(family, family), **{**shape, **FAMILY_SHAPES.get(family, {}),
                                                                    **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed_tokens" in name else 0.08))
    return model


# The converter takes a gemma2 vocabulary from a sentencepiece tokenizer.model only, and refuses a qwen2
# folder's BPE (transformers reads it as Qwen2Tokenizer, whose pre-tokenizer hash it does not know) but reads
# a tokenizer.model first: those families' folders get one beside, so their GGUFs' vocabularies are its.
SENTENCEPIECE_GGUF = ("gemma2", "qwen2")


def write_family_folder(folder, family: str, tokenizer, seed: int = 0, **overrides):
    """An HF folder as transformers writes it (config.json, model.safetensors, generation_config.json)
    with `tokenizer` (a transformers tokenizer) saved beside; the model returned, for the oracle."""
    model = family_model(family, len(tokenizer), seed, **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if family in SENTENCEPIECE_GGUF:
        write_sentencepiece_model(Path(folder) / "tokenizer.model")
    if family == "phi3":  # a BPE phi3, as Phi-4-mini ships: the converter takes its vocabulary by this class
        # (else it wants Phi-3's sentencepiece tokenizer.model)
        tc = Path(folder) / "tokenizer_config.json"
        tc.write_text(json.dumps({**json.loads(tc.read_text()), "tokenizer_class": "GPT2Tokenizer"}, indent=2))
    return model


def write_sentencepiece_model(path, vocab: int = 400):
    """A sentencepiece model trained on TINY_CORPUS, written to `path` (trained in converter_python(): the
    test venv has no sentencepiece), for the converter's sentencepiece GGUFs (gemma2's vocabulary;
    tests/engine/test_tokenizer_sentencepiece.py)."""
    script = ("import io, sys, sentencepiece as spm\n"
              "m = io.BytesIO()\n"
              "spm.SentencePieceTrainer.train(sentence_iterator=iter(sys.argv[2:]), model_writer=m, "
              f"vocab_size={vocab}, model_type='bpe', byte_fallback=True, hard_vocab_limit=False, minloglevel=2, "
              # as Llama's and Gemma's: no normalizer (llama.cpp applies none: it is not in the GGUF)
              "normalization_rule_name='identity', remove_extra_whitespaces=False)\n"
              "open(sys.argv[1], 'wb').write(m.getvalue())\n")
    subprocess.run([converter_python(), "-c", script, str(path), *TINY_CORPUS * 8], check=True, timeout=300)
    return path


def smollm2_hf_tokenizer():
    """The embedded SmolLM2's tokenizer as transformers reads it from the GGUF: a real BPE whose
    pre-tokenizer llama.cpp's converter recognises (it refuses a BPE it has no hash for)."""
    from transformers import AutoTokenizer

    from kvgen.engine.model_files import embedded_model_path

    folder, name = os.path.split(embedded_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@contextlib.contextmanager
def _test_cache_lock():
    """~/.cache/kvgen-tests made by one process at a time: make test's two workers both reach for the
    converter's venv and sources when their families' modules start together, and a venv made twice at once
    fails (`venv --clear` removing what the other is writing)."""
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def llama_cpp_sources():
    """llama.cpp's sources as vendored in the llama-cpp-python sdist: bench/setup_models.sh's copy where
    it is there, else one fetched once into ~/.cache/kvgen-tests (pip download of the sdist)."""
    with _test_cache_lock():
        return _llama_cpp_sources()


def _llama_cpp_sources():
    for src in (_REPO / "bench" / ".cache" / "llamacpp-src", TEST_CACHE / "llamacpp-src"):
        if (src / ".version").exists() and (src / ".version").read_text().strip() == LLAMACPP_VERSION:
            return src
    src = TEST_CACHE / "llamacpp-src"
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        work, f"llama-cpp-python=={LLAMACPP_VERSION}"], check=True, timeout=600)
        sdist = next(Path(work).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{LLAMACPP_VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(work + "/src", members=[m for m in members if m.name], filter="data")
        src.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(src, ignore_errors=True)
        shutil.move(work + "/src", src)
    (src / ".version").write_text(LLAMACPP_VERSION + "\n")
    return src


@functools.cache
def converter_python() -> str:
    """A Python that runs convert_hf_to_gguf.py: this venv's packages plus sentencepiece (the converter
    imports it for some vocabularies). bench/setup_models.sh's convert-venv, else one made the same way
    in ~/.cache/kvgen-tests."""
    with _test_cache_lock():
        return _converter_python()


def _converter_python() -> str:
    for venv in (_REPO / "bench" / ".cache" / "convert-venv", TEST_CACHE / "convert-venv"):
        py = venv / "bin" / "python"
        if py.exists() and subprocess.run([str(py), "-c", "import sentencepiece, torch"]).returncode == 0:
            return str(py)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "kvgen-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "sentencepiece==0.2.3"], check=True, timeout=600)
    return str(py)


def convert_to_gguf(folder, out, outtype: str = "f32"):
    """llama.cpp's convert_hf_to_gguf.py on an HF folder, in a subprocess with its own gguf-py first on
    the path (the converter is written against it, not against the gguf package this venv has)."""
    src = llama_cpp_sources()
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([converter_python(), str(src / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
                        "--outtype", outtype], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return out
