"""The shape of a Llama-family model, read from GGUF metadata or a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

GEMMAS = ("gemma2", "gemma3")  # norms multiply by (1 + w), embeddings scaled by sqrt(hidden), GELU-tanh


class UnsupportedModel(ValueError):
    """A model file kvgen does not run (its family, a tensor type, a RoPE scaling): said at load, in one
    line that names what the file has and what kvgen runs, so the server can refuse to start with it."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2 | qwen3 | phi3 | gemma2 | gemma3 (the family, as GGUF names it)
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
    # Gemma 2 / 3: per layer, its own window (0: global attention); its KV stays whole (global layers read it all)
    layer_windows: list[int] = field(default_factory=list)
    local_rope_theta: float | None = None  # Gemma 3's RoPE base on the windowed layers
    query_pre_attn_scalar: float | None = None  # Gemma: queries scaled by its -1/2 power, not head_dim's
    final_logit_softcap: float | None = None  # Gemma: logits = cap * tanh(logits / cap)
    attn_logit_softcap: float | None = None  # Gemma 2: attention scores = cap * tanh(scores / cap)
    tensor_types: dict[str, int] = field(default_factory=dict)  # the file's tensor type -> count
    file_bytes: int = 0  # the model file's size (an HF folder: its safetensors)
