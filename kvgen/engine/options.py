"""What the engine is told at start-up. Each field is a setting: the server fills it from the
environment variable of the same name upper-cased (kvgen/service/settings.py lists them all)."""

from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT_CACHE_DIR = "~/.cache/kvgen/tiles"  # EngineOptions.weight_cache_dir's default (generator.load_model's too)


def setting(default, doc: str, shown: str | None = None):
    """A dataclass field that is also a documented setting. doc: its one line of meaning;
    shown: the default as the README writes it, where the raw value says little ("" = a temp dir)."""
    meta = {"doc": doc} if shown is None else {"doc": doc, "shown": shown}
    return field(default=default, metadata=meta)


@dataclass(slots=True)
class EngineOptions:
    weight_dtype: str = setting("auto", "weight storage: auto (on the CPU a GGUF's own blocks, Q8_0 blocks of bf16 / "
                                        "fp16 matrices, else fp32; on CUDA bf16 unless the file is fp32), gguf, "
                                        "fp32, bf16, int8 or int4")
    weight_cache_dir: str = setting(WEIGHT_CACHE_DIR, "where a GGUF file's weights, once converted to the CPU "
                                    "kernels' tiles, are kept (about the file's size again, one entry a file) so "
                                    "that later starts of the same file and kvgen map them instead of converting "
                                    "(empty: off)")
    cpu_activations: str = setting("", "the CPU block kernels' activations for Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, "
                                       "Q5_K, Q6_K and Q8_0 weights (IQ4, Q3_K, Q2_K: int16 always): int16 "
                                       "(rounding 2^-16 of a block's largest) or int8 (llama.cpp's rounding, "
                                       "~1.6-1.9x the multiply-adds from 16 rows up; AVX512-VNNI only); read when "
                                       "kvgen.cpu is imported, so set it in the environment (empty: as built)",
                                   shown="int16")
    kv_dtype: str = setting("auto", "KV cache storage: auto (the activations' dtype), fp32, fp16, bf16, fp8, q4, q3")
    kv_compress: str = setting("off", "compress older KV rows so long contexts take fewer blocks: off, mean (each "
                                      "pair of rows older than KV_COMPRESS_WINDOW pooled) or sink-heavy (the first "
                                      "rows and the rows likeliest to be attended kept); fp32/fp16/bf16, lossy")
    kv_compress_window: int = setting(256, "KV_COMPRESS: the most recent tokens whose K/V stay exact")
    kv_compress_ratio: float = setting(0.5, "KV_COMPRESS: rows kept per older row, 0.5 or 0.25")
    kv_cache_mb: float = setting(512.0, "memory for the KV block pool, MB")
    block_size: int = setting(16, "tokens per KV block")
    token_budget: int = setting(512, "tokens per engine step (decode tokens plus prefill chunks)")
    max_running: int = setting(64, "sequences in the running batch")
    max_waiting: int = setting(256, "queued requests before RESOURCE_EXHAUSTED")
    session_ttl_s: float = setting(600.0, "idle sessions are closed after this many seconds")
    max_sessions: int = setting(1024, "open sessions per server before CreateSession gets RESOURCE_EXHAUSTED")
    max_sessions_per_key: int = setting(64, "open sessions per API key (0: no per-key limit)")
    stream_buffer: int = setting(4096, "events a stream's reader may leave unread before its request is ended "
                                       "with RESOURCE_EXHAUSTED (the engine goes on for everyone else)")
    kv_warm_mb: float = setting(256.0, "host memory for idle sessions' blocks pushed out of the pool; beyond it, disk")
    kv_warm_codec: str = setting("raw", "warm-tier codec for idle sessions' blocks moved out of the pool: raw = "
                                        "exact bytes; fp8 / q4 = smaller, lossy, for plain fp32/fp16/bf16 pools")
    prefix_cache: bool = setting(True, "share the KV blocks of prompts' common starts across requests (off with a "
                                       "sliding window or chunked attention)")
    prefix_cache_tier_mb: float = setting(256.0, "host memory and disk for prefix-cache blocks moved out of the "
                                                 "pool; past it the least recently used are dropped")
    kv_cold_dir: str = setting("", "where cold blocks go (empty: a temp dir, removed on close)", shown="a temp dir")
    threads: int = setting(0, "CPU threads for torch's ops and kvgen's kernels (0: every core)", shown="all cores")
    attention_window: int = setting(0, "sliding-window attention over the last N positions (0: the model's own)",
                                    shown="model's own")
    attention_chunk: int = setting(0, "chunked attention: each position sees only its own chunk of N (0: off)")
    constraint_cache: int = setting(64, "compiled output constraints (schemas, regexes, grammars) kept for reuse")
    mask_threads: int = setting(1, "threads that compute constrained requests' token masks during a step")
    speculative: str = setting("off", "speculative decoding for requests that do not say: off, ngram (prompt lookup), "
                                      "draft (DRAFT_MODEL drafts) or eagle (EAGLE_HEAD drafts); a request's own "
                                      "`speculative` field wins, and with off it may still ask for prompt lookup")
    speculative_tokens: int = setting(5, "the longest draft a sequence proposes per step (adapted per sequence)")
    speculative_max_batch: int = setting(8, "no drafting while more sequences than this are running (speculation "
                                            "pays at low load)")
    draft_model: str = setting("", "the drafting model for SPECULATIVE=draft: a GGUF file or HF folder with the "
                                   "target's vocabulary (empty: the served model itself)", shown="the served model")
    draft_weight_dtype: str = setting("auto", "the draft model's weight storage, as WEIGHT_DTYPE: auto (on the CPU a "
                                              "GGUF's own blocks, Q8_0 blocks of bf16 / fp16 matrices, else fp32; on "
                                              "CUDA bf16 unless the file is fp32), fp32, bf16, int8, int4 or gguf")
    draft_kv_mb: float = setting(128.0, "memory for the draft model's (or EAGLE head's) own KV block pool, MB")
    eagle_head: str = setting("", "the EAGLE head of SPECULATIVE=eagle: a .safetensors file (or a folder with "
                                  "model.safetensors) in EAGLE-1's layout, sized for the served model", shown="(none)")
    lora_adapters: str = setting("", "LoRA adapters loaded at start, name=path,... (PEFT folders: "
                                     "adapter_config.json + adapter_model.safetensors, or llama.cpp .gguf LoRA "
                                     "files); a request names one in its `adapter` field (HTTP: `model`)",
                                 shown="(none)")
    max_loras: int = setting(8, "the most LoRA adapters loaded at once")
    max_lora_rank: int = setting(64, "the highest LoRA rank an adapter may have")
    device: str = setting("cpu", "where the model and the KV pool live: cpu or cuda[:i]")
    cuda_graphs: bool = setting(True, "on CUDA, replay decode steps from CUDA graphs (false: the same step, eagerly)")
