"""The shape of a Llama-family model, read from GGUF metadata or a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2 (the family, as GGUF names it)
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # Mistral-style: attend to the last N positions
    tensor_types: dict[str, int] = field(default_factory=dict)  # the file's tensor type -> count
    file_bytes: int = 0  # the model file's size (an HF folder: its safetensors)
