"""The engine's Python API, mirroring the seed: generate, generate_stream, batch_generate,
and sessions that keep their KV cache between calls."""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvgen.engine import loader
from kvgen.engine.engine import Engine
from kvgen.engine.kv.calibrate import calibrate_format
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.errors import InvalidRequest, PoolExhausted
from kvgen.engine.kv.tiers import TieredKV
from kvgen.engine.model import Model
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import Sampled, SamplingParams
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import Event, FinishReason, Sequence, Usage
from kvgen.engine.threads import in_fresh_thread
from kvgen.engine.tokenizer import TextTokenizer
from kvgen.gpu import ops as gpu_ops  # imports without CuPy

Prompt = str | list[dict] | list[int]


def load_model(path: str, weight_dtype: str = "fp32", device: str = "cpu") -> tuple[Model, TextTokenizer]:
    return in_fresh_thread(_load_model, path, weight_dtype, device)  # see threads.py


def _load_model(path: str, weight_dtype: str, device: str) -> tuple[Model, TextTokenizer]:
    cfg, weights, src = loader.load(path)
    tokenizer = (TextTokenizer.from_gguf(src["gguf"]) if "gguf" in src
                 else TextTokenizer.from_folder(src["folder"]))
    return Model(cfg, weights, weight_dtype, device), tokenizer


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    usage: Usage | None = None
    timings: dict | None = None
    request_id: str = ""

    def add(self, ev: Event) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        if ev.finish_reason is not None:
            self.finish_reason, self.matched_stop = ev.finish_reason, ev.matched_stop
            self.usage, self.timings = ev.usage, ev.timings


def _make_pool(model: Model, tokenizer: TextTokenizer, opts: EngineOptions) -> BlockPool:
    cfg = model.cfg
    # Quantized formats keep each running sequence's newest block exact (kv/stage.py); the GPU
    # kernels of a format read only its quantized store, so where they run it is off.
    # One slot per running sequence, within a quarter of the KV budget.
    quantized = opts.kv_dtype in ("fp8", "q4", "q3")
    kernels = model.device.type == "cuda" and opts.kv_dtype in gpu_ops.FORMATS
    args = (opts.kv_dtype, cfg.num_layers, opts.block_size, cfg.num_kv_heads, cfg.head_dim)
    slots = None
    if quantized and not kernels:
        slot_bytes = make_format(*args, compute_dtype=model.act_dtype, recent_slots=1).stage_bytes()
        slots = min(opts.max_running, int(opts.kv_cache_mb * 2**20 / 4) // slot_bytes)
    fmt = make_format(*args, compute_dtype=model.act_dtype, recent_slots=slots)
    # key scales (fp8) and codebooks (q3) fitted on the model's own K/V, before any block is
    # written; plain formats have nothing to fit
    calibrate_format(model, fmt, tokenizer)
    # The pool lives with the model (options.device only says where load() puts the model).
    return BlockPool.from_budget(fmt, opts.kv_cache_mb, model.device)


class Generator:
    def __init__(self, model: Model, tokenizer: TextTokenizer, options: EngineOptions | None = None,
                 model_path: str = ""):
        opts = options or EngineOptions()
        self.options = opts
        self.model_path = model_path
        self.cfg = cfg = model.cfg
        self.tokenizer = tokenizer
        self.model = model
        self.pool = in_fresh_thread(_make_pool, model, tokenizer, opts)  # see threads.py
        self.tiers = TieredKV(self.pool, cold_dir=opts.kv_cold_dir or None)  # lossless: raw bytes
        self.scheduler = Scheduler(opts.token_budget, opts.max_running, opts.max_waiting, reclaim=self._reclaim)
        window = opts.attention_window or cfg.sliding_window or 0
        self.engine = Engine(model, self.pool, self.scheduler, window=window, chunk=opts.attention_chunk,
                             cuda_graphs=opts.cuda_graphs)
        self.sessions: dict[str, InferenceSession] = {}
        self._sessions_lock = threading.Lock()
        self.engine.start()

    @classmethod
    def load(cls, model_path: str | None = None, options: EngineOptions | None = None) -> Generator:
        """Load a GGUF file or HF folder (None: the embedded model) and start the engine."""
        opts = options or EngineOptions()
        torch.set_num_threads(opts.threads or len(os.sched_getaffinity(0)))
        path = model_path or loader.embedded_model_path()
        model, tokenizer = load_model(path, opts.weight_dtype, opts.device)
        return cls(model, tokenizer, opts, path)

    def close(self) -> None:
        self.engine.stop()
        self.tiers.close()

    # requests

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            name = "prompt"
        elif prompt and isinstance(prompt[0], dict):
            try:
                ids = self.tokenizer.encode_chat(prompt)
            except Exception as e:
                raise InvalidRequest([("messages", f"chat template failed: {e}")]) from e
            name = "messages"
        else:
            ids = [int(t) for t in prompt]
            name = "prompt_token_ids"
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise InvalidRequest([(name, f"unknown token ids {bad[:5]} (vocab size {self.cfg.vocab_size})")])
        if not ids:
            raise InvalidRequest([(name, "the prompt has no tokens")])
        return ids

    def check(self, ids: list[int], params: SamplingParams) -> None:
        bad = [(f"sampling.{f}", d) for f, d in params.validate()]
        total = len(ids) + params.max_new_tokens
        if total > self.cfg.context_length:
            bad.append(("sampling.max_new_tokens", f"prompt ({len(ids)} tokens) + max_new_tokens "
                        f"({params.max_new_tokens}) exceeds the context length {self.cfg.context_length}"))
        elif -(-total // self.pool.block_size) > self.pool.capacity:
            bad.append(("sampling.max_new_tokens", f"prompt + max_new_tokens needs more KV blocks than the "
                        f"pool holds ({self.pool.capacity} x {self.pool.block_size} tokens)"))
        if bad:
            raise InvalidRequest(bad)

    def start(self, ids: list[int], params: SamplingParams, emit, request_id: str = "",
              session: InferenceSession | None = None) -> Sequence:
        """Submit a request; events go to emit(ev) from the engine thread. Raises InvalidRequest
        or Overloaded."""
        self.check(ids, params)
        cache = session.cache if session else PagedKVCache(self.pool)
        seq = Sequence(ids, params, self.tokenizer, self.cfg.eos_token_ids, emit, cache,
                       request_id or uuid.uuid4().hex)
        seq.session = session
        self.engine.submit(seq)
        return seq

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Result:
        result = Result()
        for ev in self.generate_stream(prompt, sampling):
            result.add(ev)
        return result

    def generate_stream(self, prompt: Prompt, sampling: SamplingParams | None = None,
                        session: InferenceSession | None = None) -> Iterator[Event]:
        params = sampling or SamplingParams()
        ids = session.prepare(prompt) if session else self.prompt_ids(prompt)
        return self._events(ids, params, session)

    def _events(self, ids, params, session) -> Iterator[Event]:
        q: queue.Queue[Event] = queue.Queue()
        seq = self.start(ids, params, q.put, session=session)
        try:
            while True:
                ev = q.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                self.engine.cancel(seq)
                seq.done.wait()

    def batch_generate(self, prompts: list[Prompt], sampling: list[SamplingParams] | SamplingParams | None = None
                       ) -> list[Result | Exception]:
        """All requests run together in the scheduler; a bad one is returned as its exception."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        results: list[Result | Exception] = []
        done = threading.Semaphore(0)
        started = 0
        for prompt, p in zip(prompts, params, strict=True):
            r = Result()
            try:
                ids = self.prompt_ids(prompt)
                self.start(ids, p, lambda ev, r=r: (r.add(ev), ev.finish_reason is not None and done.release()))
                started += 1
                results.append(r)
            except Exception as e:
                results.append(e)
        for _ in range(started):
            done.acquire()
        return results

    # sessions

    def new_session(self) -> InferenceSession:
        s = InferenceSession(self, uuid.uuid4().hex)
        with self._sessions_lock:
            self.sessions[s.session_id] = s
        return s

    def get_session(self, session_id: str) -> InferenceSession | None:
        with self._sessions_lock:
            return self.sessions.get(session_id)

    def close_session(self, session_id: str) -> bool:
        with self._sessions_lock:
            s = self.sessions.pop(session_id, None)
        if s:
            s.close()
        return s is not None

    def expire_sessions(self, now: float | None = None) -> int:
        now = now or time.monotonic()
        with self._sessions_lock:
            old = [sid for sid, s in self.sessions.items() if now - s.last_used > self.options.session_ttl_s]
        for sid in old:
            self.close_session(sid)
        return len(old)

    def _reclaim(self, need: int) -> bool:
        """Engine thread, pool short of `need` blocks: idle sessions' blocks move down to the warm
        tier (host memory; the least recently used session's first, see tiers.AccessPolicy), and
        past kv_warm_mb on to disk. A session brings them back on its next turn."""
        with self._sessions_lock:
            sessions = list(self.sessions.values())
        idle = [s for s in sessions if s.cache.blocks and s.lock.acquire(blocking=False)]  # not mid-turn
        try:
            room = self.tiers.make_room(need, only=[s.cache for s in idle])
            self.tiers.spill(int(self.options.kv_warm_mb * 2**20))
        finally:
            for s in idle:
                s.lock.release()
        return room


class InferenceSession:
    """A conversation whose KV blocks stay in the pool between calls; calls are serialised.

    Messages are appended to the session's conversation; raw prompts and token ids continue
    its token history. Whatever prefix of the new prompt is already cached is not recomputed.
    """

    def __init__(self, gen: Generator, session_id: str):
        self.gen = gen
        self.session_id = session_id
        self.cache = PagedKVCache(gen.pool)
        self.history: list[int] = []  # tokens of the conversation so far
        self.messages: list[dict] = []
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self._pending_messages: list[dict] = []

    def prepare(self, prompt: Prompt) -> list[int]:
        """Prompt ids for the next turn; trims the cache to what they share with it, and brings
        blocks that went down a tier back into the pool."""
        self.last_used = time.monotonic()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            self._pending_messages = [*self.messages, *prompt]
            ids = self.gen.prompt_ids(self._pending_messages)
        else:
            self._pending_messages = []
            ids = self.history + self.gen.prompt_ids(prompt)
        shared = 0
        for a, b in zip(ids[: self.cache.length], self.history, strict=False):
            if a != b:
                break
            shared += 1
        keep = min(shared, len(ids) - 1)  # at least one token computes logits
        # On the engine thread: a block copy is a parallel torch op, and any other thread that runs
        # one keeps an OpenMP pool that slows the engine from then on (threads.py). For the same
        # reason TieredKV's background prefetch is not used here.
        self.gen.engine.call(lambda: self._bring_back(keep))
        return ids

    def _bring_back(self, keep: int) -> None:
        """Engine thread: keep the first `keep` cached tokens, promoting blocks that went down a tier."""
        try:
            self.gen.tiers.truncate(self.cache, keep)
        except PoolExhausted:  # no room to bring the prefix back: the prompt is computed again
            self.gen.tiers.reset(self.cache)

    def keep(self, seq: Sequence) -> None:
        """Engine thread, at the end of a turn: the cache stays, the history grows."""
        self.history = seq.tokens
        self.last_used = time.monotonic()
        self.gen.tiers.touch(self.cache)  # LRU order for _reclaim


    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Result:
        result = Result()
        for ev in self.generate_stream(prompt, sampling):
            result.add(ev)
        return result

    def generate_stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Iterator[Event]:
        with self.lock:
            text = ""
            for ev in self.gen.generate_stream(prompt, sampling, session=self):
                text += ev.text
                yield ev
            self.end_turn(text)

    def end_turn(self, reply: str) -> None:
        """Record the assistant's reply to a messages turn (raw turns live in `history`)."""
        if self._pending_messages:
            self.messages = [*self._pending_messages, {"role": "assistant", "content": reply}]
        self.last_used = time.monotonic()

    def close(self) -> None:
        with self.lock:
            self.gen.engine.call(lambda: self.gen.tiers.reset(self.cache))
