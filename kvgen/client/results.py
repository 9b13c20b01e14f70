"""Typed results: frozen dataclasses made from the kvgen.v1 protobuf messages. Sequences are
tuples; each result that mirrors a message keeps it as `.raw` (for fields newer than this client,
or for protobuf's own JSON), left out of equality and repr."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvgen.client.errors import KvgenError, from_status
from kvgen.v1 import generate_pb2 as pb


class FinishReason(enum.IntEnum):
    """Why a generation ended; equal to the proto's FINISH_REASON_* numbers, and false while a
    stream is still going (UNSPECIFIED)."""

    UNSPECIFIED = 0
    STOP_TOKEN = 1  # EOS, a stop token, or the output constraint is complete
    STOP_STRING = 2
    LENGTH = 3  # max_new_tokens or the context length
    CANCELLED = 4
    ABORTED = 5

    @classmethod
    def of(cls, value: int) -> FinishReason:
        try:
            return cls(value)
        except ValueError:  # a reason newer than this client
            return cls.UNSPECIFIED


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a session or the prefix cache

    @classmethod
    def of(cls, m: pb.Usage) -> Usage:
        return cls(m.prompt_tokens, m.completion_tokens, m.cached_tokens)


@dataclass(frozen=True)
class Timings:
    time_to_first_token_ms: float = 0.0
    total_ms: float = 0.0
    queue_ms: float = 0.0

    @classmethod
    def of(cls, m: pb.Timings) -> Timings:
        return cls(m.time_to_first_token_ms, m.total_ms, m.queue_ms)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()

    @classmethod
    def of(cls, m: pb.TokenLogprob) -> TokenLogprob:
        return cls(m.token_id, m.token, m.logprob, tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in m.top))


def _logprobs(ms) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob.of(m) for m in ms)


@dataclass(frozen=True)
class Completion:
    """A whole generation (Generate, a BatchGenerate entry)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    matched_stop: str  # the stop string or stop token that ended it, as text
    usage: Usage
    timings: Timings
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    replica: str = ""  # the server that answered (its x-kvgen-replica trailer)
    raw: pb.GenerateResponse | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, m: pb.GenerateResponse, replica: str = "") -> Completion:
        return cls(m.request_id, m.text, tuple(m.token_ids), FinishReason.of(m.finish_reason), m.matched_stop,
                   Usage.of(m.usage), Timings.of(m.timings), _logprobs(m.logprobs), _logprobs(m.prompt_logprobs),
                   replica, m)


@dataclass(frozen=True)
class StreamDelta:
    """One message of a stream: the text and tokens new since the previous one. The last carries
    finish_reason, usage and timings (None before); the first, prompt_logprobs when asked for."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    matched_stop: str = ""
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    raw: pb.GenerateStreamResponse | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, m: pb.GenerateStreamResponse) -> StreamDelta:
        return cls(m.request_id, m.text, tuple(m.token_ids), _logprobs(m.logprobs), FinishReason.of(m.finish_reason),
                   m.matched_stop, Usage.of(m.usage) if m.HasField("usage") else None,
                   Timings.of(m.timings) if m.HasField("timings") else None, _logprobs(m.prompt_logprobs), m)


@dataclass(frozen=True)
class BatchStreamDelta:
    """One message of a BatchGenerateStream: entry `index`'s next StreamDelta, or the error that
    ended that entry (a KvgenError made from its google.rpc.Status; nothing more comes for it)."""

    index: int  # the entry's position in the batch
    delta: StreamDelta | None = None
    error: KvgenError | None = None
    raw: pb.BatchGenerateStreamResponse | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, m: pb.BatchGenerateStreamResponse) -> BatchStreamDelta:
        if m.WhichOneof("result") == "error":
            return cls(m.index, error=from_status(m.error), raw=m)
        return cls(m.index, delta=StreamDelta.of(m.response), raw=m)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    context_length: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    weight_dtype: str
    has_chat_template: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    kv_block_size: int
    kv_blocks_total: int
    device: str
    prefix_cache: bool
    cpu_kernels: str = ""  # the CPU kernel path of gguf weights ("" where none runs)
    tensor_types: dict[str, int] = field(default_factory=dict)  # the file's tensor type -> count
    type_kernels: dict[str, str] = field(default_factory=dict)  # type -> kernel kind or weight dtype
    weight_bytes: int = 0  # the weights as the server holds them
    file_bytes: int = 0
    # the attention layout: per layer, the latest positions a query sees (0: all); score and logit soft-caps
    layer_windows: tuple[int, ...] = ()
    attention_logit_softcap: float = 0.0  # 0: none
    final_logit_softcap: float = 0.0
    decode_path: str = ""  # fused | cuda-kernels | torch
    decode_path_reason: str = ""  # why not a faster path, where torch
    # KV compression of requests that do not choose (KV_COMPRESS: off, mean, sink-heavy), its window and
    # ratio, and why a request may not turn it on here ("": it may)
    kv_compress: str = ""
    kv_compress_window: int = 0
    kv_compress_ratio: float = 0.0
    kv_compress_unsupported: str = ""
    attention_layout: str = ""  # attention (K/V in the pool) | state (a recurrent state per sequence: Mamba-2)
    # the model's files mapped in place (GGUF, the tiles from WEIGHT_CACHE_DIR, safetensors), of which in RAM
    # now, and the server's RSS
    mapped_bytes: int = 0
    mapped_resident_bytes: int = 0
    resident_bytes: int = 0
    raw: pb.GetModelInfoResponse | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, m: pb.GetModelInfoResponse) -> ModelInfo:
        return cls(m.name, m.architecture, m.context_length, m.vocab_size, m.num_layers, m.num_heads, m.num_kv_heads,
                   m.head_dim, m.kv_dtype, m.weight_dtype, m.has_chat_template, tuple(m.eos_token_ids),
                   m.bos_token_id, m.kv_block_size, m.kv_blocks_total, m.device, m.prefix_cache, m.cpu_kernels,
                   dict(m.tensor_types), dict(m.type_kernels), m.weight_bytes, m.file_bytes, tuple(m.layer_windows),
                   m.attention_logit_softcap, m.final_logit_softcap, m.decode_path, m.decode_path_reason,
                   m.kv_compress, m.kv_compress_window, m.kv_compress_ratio, m.kv_compress_unsupported,
                   m.attention_layout, m.mapped_bytes, m.mapped_resident_bytes, m.resident_bytes, m)


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int
    misses: int
    hit_tokens: int
    evictions: int
    blocks_in_pool: int
    blocks_in_tiers: int


@dataclass(frozen=True)
class Load:
    """How busy the server is (GetLoad)."""

    replica: str
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cache_usage: float
    sessions_open: int
    prefix_cache: PrefixCacheStats | None  # None when the server runs without one
    tokens_per_second: float
    requests_per_second: float
    window_seconds: float
    accepting: bool
    raw: pb.GetLoadResponse | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, m: pb.GetLoadResponse) -> Load:
        p = m.prefix_cache
        stats = PrefixCacheStats(p.hits, p.misses, p.hit_tokens, p.evictions, p.blocks_in_pool,
                                 p.blocks_in_tiers) if m.HasField("prefix_cache") else None
        return cls(m.replica, m.running_requests, m.waiting_requests, m.kv_blocks_used, m.kv_blocks_total,
                   m.kv_cache_usage, m.sessions_open, stats, m.tokens_per_second, m.requests_per_second,
                   m.window_seconds, m.accepting, m)


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter the server loaded (LoadAdapter): its name, highest rank, PEFT module names."""

    name: str
    rank: int
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, a: pb.LoraAdapter) -> AdapterInfo:
        return cls(a.name, a.rank, tuple(a.target_modules))


@dataclass(frozen=True)
class AbortResult:
    aborted: tuple[str, ...]  # ids of running requests, now ended with CANCELLED
    unknown: tuple[str, ...]  # ids that named nothing running (not an error)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    ttl_seconds: int  # an idle session is closed after this long
