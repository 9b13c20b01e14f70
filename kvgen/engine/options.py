"""What the engine is told at start-up (the server fills these from the environment)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineOptions:
    weight_dtype: str = "fp32"
    kv_dtype: str = "auto"  # plain storage in the activations' dtype (fp32 weights: fp32; others: bf16)
    kv_cache_mb: float = 512.0
    block_size: int = 16
    token_budget: int = 512
    max_running: int = 64
    max_waiting: int = 256
    session_ttl_s: float = 600
    kv_warm_mb: float = 256.0  # host memory for idle sessions' blocks pushed out of the pool; beyond it, disk
    kv_cold_dir: str = ""  # where cold blocks go (empty: a temp dir, removed on close)
    threads: int = 0  # 0 = every core
    attention_window: int = 0  # sliding-window attention (0: the model's own, if any)
    attention_chunk: int = 0  # chunked attention: each query sees only its own chunk
    device: str = "cpu"  # where load() puts the model and the KV pool: "cpu" or "cuda[:i]"
    cuda_graphs: bool = True  # on CUDA, replay decode steps from CUDA graphs (False: the same step, eagerly)
