"""An HF folder of a real model's shape with random weights, for the bench's large files.

    python bench/make_shaped_model.py {1.7b,8b} OUT_FOLDER

Only speed and memory mean something on these models: the weights are random (normal, std 0.02,
bf16), the tokenizer is the embedded SmolLM2's (49152 tokens), so the 8B shape is Llama 3.1 8B's
layers over SmolLM2's vocabulary (7.2B parameters, not 8.0). The folder is what
`save_pretrained` writes (config.json, sharded safetensors with their index, the tokenizer), made
one layer at a time so that an 8B model never needs 16 GB of memory: transformers' own random
init would hold the whole model. bench/setup_models.sh converts it with llama.cpp's
convert_hf_to_gguf.py and quantizes it with llama-quantize.
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


def main(shape: str, out: str) -> None:
    from transformers import AutoTokenizer, LlamaConfig

    from kvgen.engine.model_files import embedded_model_path

    src = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=len(tok), max_position_embeddings=8192,
                      rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      torch_dtype="bfloat16", **SHAPES[shape])
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    g = torch.Generator().manual_seed(0)
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

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
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
