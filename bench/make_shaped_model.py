"""An HF folder of a real model's shape with random weights, for the bench's large files.

    python bench/make_shaped_model.py {1.7b,8b} OUT_FOLDER [--device cuda] [--tokenizer FOLDER]
    python bench/make_shaped_model.py {llama,mistral,qwen2,qwen3,gemma2,gemma3,phi3,mamba2} OUT_FOLDER [...]

--device: where the random numbers are drawn (cuda: an 8B model's 7B draws in seconds, not minutes;
other values than the CPU's for the same seed). --tokenizer: a folder holding the tokenizer that
`save_pretrained` wrote, instead of reading it from the embedded GGUF (bench/gpu_session.sh carries
one to a GPU machine).

Only speed and memory mean something on these models: the weights are random (normal, std 0.02,
bf16), the tokenizer is the embedded SmolLM2's (49152 tokens), so the 8B shape is Llama 3.1 8B's
layers over SmolLM2's vocabulary (7.2B parameters, not 8.0). The folder is what
`save_pretrained` writes (config.json, sharded safetensors with their index, the tokenizer), made
one layer at a time so that an 8B model never needs 16 GB of memory: transformers' own random
init would hold the whole model. bench/setup_models.sh converts it with llama.cpp's
convert_hf_to_gguf.py and quantizes it with llama-quantize.

The family shapes (FAMILY_SHAPES, for `make bench-models MODELS=families`) are each family's real
model's widths (hidden, intermediate, heads, KV heads, head_dim, the family's own features: qkv bias,
q/k norms, windows, soft-caps), with fewer layers where the real model is far past 1B, over
SmolLM2's vocabulary (49152 tokens, not the real ones' 32k-262k), so each is 0.4B-1.2B parameters.
mamba2 (the state-space family) is Mamba-2 1.3B's widths (hidden 2048, 64 heads of 64 over an inner width of
4096, a state of 128 per channel, one group, conv over 4 inputs) with 24 of its 48 layers.
gemma2's converter takes a vocabulary only from a sentencepiece tokenizer.model, and qwen2's refuses
SmolLM2's BPE (transformers rebuilds a qwen2 folder's tokenizer with Qwen2's pre-tokenizer, whose hash
the converter does not know) but takes a tokenizer.model first: their folders get tests/tiny.py's small
one, padded by the converter to 49152 tokens. Any family's layers are listed
by transformers' own model class built on the meta device (no memory), then written a layer at a time.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

# (transformers LlamaConfig fields) SmolLM2-1.7B's shape; Llama 3.1 8B's layers
SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, rope_theta=130000.0, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}

# (transformers config fields per family) the real model's widths; `layers` of `real` when reduced
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FAMILY_SHAPES = {
    "llama": ("Llama 3.2 1B", 16, dict(  # all 16 layers
        max_position_embeddings=131072, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=True)),
    "mistral": ("Mistral 7B v0.3", 32, dict(  # 3 of 32 layers
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=3, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("Qwen2.5 0.5B", 24, dict(  # all 24 layers
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3 0.6B", 28, dict(  # all 28 layers
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True)),
    "gemma2": ("Gemma 2 2B", 26, dict(  # 12 of 26 layers
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma 3 1B", 26, dict(  # all 26 layers
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
        tie_word_embeddings=True)),
    "phi3": ("Phi-3 mini", 32, dict(  # 7 of 32 layers
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=7, num_attention_heads=32,
        num_key_value_heads=32, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "original_max_position_embeddings": 4096})),
    "mamba2": ("Mamba-2 1.3B", 48, dict(  # 24 of 48 layers; transformers' Mamba2Config fields
        hidden_size=2048, num_hidden_layers=24, num_heads=64, head_dim=64, expand=2, state_size=128, n_groups=1,
        conv_kernel=4, chunk_size=256, tie_word_embeddings=True)),
}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # transformers' model type where it is not the GGUF family


def _tokenizer(folder: str | None):
    """The embedded SmolLM2's tokenizer (transformers'), from a saved folder or the GGUF itself."""
    from transformers import AutoTokenizer

    if folder:
        return AutoTokenizer.from_pretrained(folder)
    from kvgen.engine.model_files import embedded_model_path

    src = embedded_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))


def _normal(device: str):
    """shape -> bf16 CPU tensor of normal(0, 0.02) draws from a generator seeded 0 on `device`."""
    g = torch.Generator(device).manual_seed(0)
    return lambda *shape: (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()


def family_main(family: str, out: str, device: str = "cpu", tokenizer: str | None = None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = _tokenizer(tokenizer)
    real, real_layers, shape = FAMILY_SHAPES[family]
    cfg = AutoConfig.for_model(MODEL_TYPES.get(family, family), **{
        "vocab_size": len(tok), "max_position_embeddings": 8192, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id, **shape})
    with torch.device("meta"):  # the parameters' names and shapes, no memory
        model = AutoModelForCausalLM.from_config(cfg)
    cfg.architectures = [type(model).__name__]
    cfg.dtype = "bfloat16"
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    if family in ("gemma2", "qwen2"):  # see the module doc
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.tiny import write_sentencepiece_model

        write_sentencepiece_model(os.path.join(out, "tokenizer.model"))
    if family == "phi3":  # a BPE phi3 (as Phi-4-mini ships): else the converter wants a tokenizer.model
        path = os.path.join(out, "tokenizer_config.json")
        with open(path) as f:
            tc = json.load(f)
        with open(path, "w") as f:
            json.dump({**tc, "tokenizer_class": "GPT2Tokenizer"}, f, indent=2)
    groups: dict[int, dict] = {}
    for name, p in model.named_parameters():  # a tied lm_head is the embedding's (listed once)
        parts = name.split(".")  # model.layers.N. (mamba2: backbone.layers.N.)
        i = int(parts[parts.index("layers") + 1]) + 1 if "layers" in parts else 0
        groups.setdefault(i, {})[name] = tuple(p.shape)
    del model
    normal = _normal(device)

    def make(name, shape):  # norms 1 (gemma's (1 + w): 2), the rest normal, std 0.02 (mamba2's A_log too: A ~ -1)
        if "norm" in name:
            return torch.ones(shape, dtype=torch.bfloat16)
        return normal(*shape)

    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index, params = {}, 0
    for i, name in enumerate(names):
        tensors = {k: make(k, s) for k, s in groups[i].items()}
        params += sum(t.numel() for t in tensors.values())
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    total = sum(os.path.getsize(os.path.join(out, f)) for f in names)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    print(f"{out}: {family} at {real}'s widths, {shape['num_hidden_layers']} of {real_layers} layers, "
          f"{params / 1e9:.2f}B parameters ({total / 2**30:.2f} GiB of bf16) in {n} shards")


def main(shape: str, out: str, device: str = "cpu", tokenizer: str | None = None) -> None:
    from transformers import LlamaConfig

    tok = _tokenizer(tokenizer)
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=len(tok), max_position_embeddings=8192,
                      rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      torch_dtype="bfloat16", **SHAPES[shape])
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    rand = _normal(device)
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    def layer(i: int) -> dict:  # made only when its shard is written
        p = f"model.layers.{i}."
        return {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, h),
                p + "mlp.up_proj.weight": rand(cfg.intermediate_size, h),
                p + "mlp.down_proj.weight": rand(h, cfg.intermediate_size)}

    first = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "model.norm.weight": ones(h)}
    if not cfg.tie_word_embeddings:
        first["lm_head.weight"] = rand(cfg.vocab_size, h)
    n = cfg.num_hidden_layers
    names = [f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors" for i in range(n + 1)]
    index = {}
    for i, name in enumerate(names):
        tensors = layer(i - 1) if i else first
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    total = sum(os.path.getsize(os.path.join(out, f)) for f in names)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    print(f"{out}: {shape}-shaped, {total / 2**30:.2f} GiB of bf16 weights in {n + 1} shards")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(usage=__doc__)
    p.add_argument("shape", choices=[*SHAPES, *FAMILY_SHAPES])
    p.add_argument("out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer", default=None)
    a = p.parse_args()
    (main if a.shape in SHAPES else family_main)(a.shape, a.out, a.device, a.tokenizer)
