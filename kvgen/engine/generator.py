"""The engine's Python API: load a model, submit requests, hold sessions.

Every request goes through one async handle (request.Request: iterate its events, cancel it,
wait until its blocks are released); the gRPC servicer only maps messages to and from it.
Python callers without an event loop get the same thing through `generate`,
`generate_stream`, `batch_generate` and the session's `generate`, run on a bridge loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import replace

import torch

from kvgen.cpu import features
from kvgen.cpu.threads import in_fresh_thread
from kvgen.cpu.weight_arena import StaleArena
from kvgen.cpu.weight_blocks import BLOCK_TYPES
from kvgen.engine import float_weights, heap, mamba2_files, model_files, tile_cache, weight_memory
from kvgen.engine.bridge import Bridge
from kvgen.engine.constraint import Grammars
from kvgen.engine.engine import Engine
from kvgen.engine.kv.compress import KVCompression, KVCompressor, choose, make_compressor, unsupported
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.manager import KVManager
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.prefix import PrefixCache
from kvgen.engine.kv.states import POSITION_POOL_SHARE, StateStore, position_pool
from kvgen.engine.kv.tiers import TieredKV
from kvgen.engine.kv_samples import calibrate_format
from kvgen.engine.lora import Adapter, AdapterInUse, AdapterStore, load_adapter
from kvgen.engine.model import Model
from kvgen.engine.model_mamba2 import Mamba2
from kvgen.engine.options import WEIGHT_CACHE_DIR, EngineOptions
from kvgen.engine.request import Prompt, Request
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import Event, Sequence
from kvgen.engine.session import Session
from kvgen.engine.speculative import MODES, DraftModel, Eagle, PromptLookup, load_head
from kvgen.engine.tokenizer import TextTokenizer
from kvgen.errors import InvalidRequest, NotFound, Overloaded

log = logging.getLogger("kvgen.engine")

# Prompts longer than this are tokenized off the event loop (a chat template and BPE over a
# long text take milliseconds the loop's other clients would wait for).
INLINE_TOKENIZE_CHARS = 2048


def load_model(path: str, weight_dtype: str = "auto", device: str = "cpu",
               tile_cache_dir: str = WEIGHT_CACHE_DIR) -> tuple[Model, TextTokenizer]:
    return in_fresh_thread(_load_model, path, weight_dtype, device, tile_cache_dir)  # see threads.py


def _load_model(path: str, weight_dtype: str, device: str, tile_cache_dir: str = "") -> tuple[Model, TextTokenizer]:
    if mamba2_files.holds(path):
        cfg, weights, src = mamba2_files.load(path)
    else:
        cfg, weights, src = model_files.load(path, tile_cache_dir)
    tokenizer = (TextTokenizer.from_gguf(src["gguf"]) if "gguf" in src
                 else TextTokenizer.from_folder(src["folder"]))
    family = Mamba2 if cfg.architecture == "mamba2" else Model  # a state-space model has a forward of its own
    try:
        model = family(cfg, weights, weight_dtype, device, blocks=src.get("blocks"),
                       embedding_rows=src.get("embedding_rows"))
    except StaleArena as e:  # the cache's entry was made by other code than its key says: never serve it
        log.warning("%s: its saved tiles did not replay (%s); loading without them", path, e)
        tile_cache.forget(path, tile_cache_dir)
        return _load_model(path, weight_dtype, device)
    if "arena" in src:
        tile_cache.save(src["arena"], path, tile_cache_dir)
    if weight_dtype != model.weight_dtype:
        log.info("WEIGHT_DTYPE=%s chose %s on %s", weight_dtype, model.weight_dtype, device)
    if kernels := kernel_path(model):
        log.info("CPU block kernels: %s", kernels)
    for t in sorted(set(cfg.tensor_types) & set(float_weights.CONVERTED) if kernel_path(model) else ()):
        b = float_weights.CONVERTED[t]  # the route float_weights.py chose for bf16 / fp16 matrices
        log.info("%s matrices run as %s blocks made at load, on the %s kernels", t, b, BLOCK_TYPES[b][0])
    return model, tokenizer


def _check_activations(asked: str) -> None:
    """CPU_ACTIVATIONS as the kernels were built (features.py reads it when kvgen.cpu is imported); empty:
    whatever they were built for."""
    if not asked:
        return
    if asked not in ("int16", "int8"):
        raise ValueError(f"CPU_ACTIVATIONS={asked!r}: int16 or int8")
    if asked == "int8" and not features.VNNI:
        raise ValueError(f"CPU_ACTIVATIONS=int8 needs AVX512-VNNI; this CPU's block kernels are {features.path()}")
    if asked != features.ACTIVATIONS:
        raise ValueError(f"CPU_ACTIVATIONS={asked!r} in the options, but the kernels were built for "
                         f"{features.ACTIVATIONS!r}: it is read from the environment when kvgen.cpu is imported")


def kernel_path(model: Model) -> str:
    """GetModelInfo.cpu_kernels: the code path the block kernels run on, where gguf weights run on
    the CPU (features.path(), from the CPU's features); empty elsewhere."""
    if model.weight_dtype != "gguf" or model.device.type != "cpu":
        return ""
    return features.path()


def type_kernels(model: Model) -> dict[str, str]:
    """GetModelInfo.type_kernels: for each tensor type of the model's file, what it runs as: a GGUF
    type on the CPU block kernels, its kernel kind (weight_blocks.BLOCK_TYPES), as F16 / BF16 matrices
    do, made into blocks at load (float_weights.CONVERTED: Q8_0, kind q8); else the weight dtype (a gguf
    model's float tensors, norms and the like, run fp32)."""
    blocks = model.weight_dtype == "gguf" and model.device.type == "cpu"
    plain = "fp32" if model.weight_dtype == "gguf" else model.weight_dtype
    held = {t: float_weights.CONVERTED.get(t, t) for t in model.cfg.tensor_types}  # the block type a type runs as
    return {t: BLOCK_TYPES[b][0] if blocks and b in BLOCK_TYPES else plain for t, b in held.items()}


def _make_pool(model: Model, tokenizer: TextTokenizer, opts: EngineOptions) -> BlockPool:
    if getattr(model, "recurrent", False):  # a state model's blocks count positions and hold nothing (states.py)
        return position_pool(opts.block_size, opts.kv_cache_mb)
    cfg = model.cfg
    # Quantized formats keep each running sequence's newest block exact (kv/stage.py), on the
    # torch path and the GPU kernels alike. One slot per running sequence, within a quarter of
    # the KV budget.
    quantized = opts.kv_dtype in ("fp8", "q4", "q3")
    args = (opts.kv_dtype, cfg.num_layers, opts.block_size, cfg.num_kv_heads, cfg.head_dim)
    slots = None
    if quantized:
        slot_bytes = make_format(*args, compute_dtype=model.act_dtype, recent_slots=1).stage_bytes()
        slots = min(opts.max_running, int(opts.kv_cache_mb * 2**20 / 4) // slot_bytes)
    fmt = make_format(*args, compute_dtype=model.act_dtype, recent_slots=slots)
    # key scales (fp8) and codebooks (q3) fitted on the model's own K/V, before any block is
    # written; plain formats have nothing to fit
    calibrate_format(model, fmt, tokenizer)
    # The pool lives with the model (options.device only says where load() puts the model).
    return BlockPool.from_budget(fmt, opts.kv_cache_mb, model.device)


def _make_drafter(model: Model, opts: EngineOptions, model_path: str, draft: Model | None):
    """Prompt lookup costs nothing until a request drafts, so it is there even with speculation
    off (a request may ask for it); a draft model is loaded only when SPECULATIVE=draft."""
    if opts.speculative not in MODES:
        raise ValueError(f"SPECULATIVE={opts.speculative!r}: expected one of {', '.join(MODES)}")
    if opts.speculative == "eagle":
        if not opts.eagle_head:
            raise ValueError("SPECULATIVE=eagle needs EAGLE_HEAD (a head's .safetensors)")
        return Eagle(model, load_head(opts.eagle_head), opts.draft_kv_mb, opts.block_size)
    if opts.speculative != "draft":
        return PromptLookup()
    if draft is None:
        draft = _load_model(opts.draft_model or model_path or model_files.embedded_model_path(),
                            opts.draft_weight_dtype, str(model.device), opts.weight_cache_dir)[0]
        if not opts.draft_model and draft.weight_dtype == model.weight_dtype:
            log.warning("SPECULATIVE=draft: the draft is the served model at its own weights (%s), so a drafted "
                        "token costs as much as decoding it; set DRAFT_WEIGHT_DTYPE or DRAFT_MODEL, or use "
                        "SPECULATIVE=ngram", model.weight_dtype)
    if draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"DRAFT_MODEL has {draft.cfg.vocab_size} tokens; the served model {model.cfg.vocab_size}: "
                         "a draft must share the target's vocabulary")
    return DraftModel(draft, opts.draft_kv_mb, opts.block_size, opts.max_running)


def _salt(cache_salt: str, adapter: Adapter | None) -> str:
    """The prefix cache's key for a request: K/V computed under one adapter is not another's (nor the
    base model's), so the adapter's name and load are part of the salt (after a separator no id holds)."""
    return cache_salt if adapter is None else f"{cache_salt}\x1flora:{adapter.name}#{adapter.serial}"


def _key(compressor: KVCompressor | None) -> tuple:
    """A compressor's (method, window, ratio), ("off",) for none: equal when they compress alike."""
    return compressor.key if compressor is not None else ("off",)


def _releasing(store: AdapterStore, adapter: Adapter, on_release):
    """seq.on_release that also lets go of the request's hold on its adapter (once, whoever calls)."""
    done = threading.Lock()

    def release() -> None:
        if done.acquire(blocking=False):
            store.release(adapter)
        on_release()

    return release


def _window(opts: EngineOptions, cfg) -> int:
    """Sliding-window attention: the setting, else the model's own (0: none)."""
    return opts.attention_window or cfg.sliding_window or 0


class Generator:
    def __init__(self, model: Model, tokenizer: TextTokenizer, options: EngineOptions | None = None,
                 model_path: str = "", draft_model: Model | None = None):
        """draft_model: the drafting model for speculative="draft" (default: DRAFT_MODEL loaded
        at DRAFT_WEIGHT_DTYPE)."""
        opts = options or EngineOptions()
        _check_activations(opts.cpu_activations)
        self.options = opts
        self.model_path = model_path
        self.cfg = cfg = model.cfg
        self.tokenizer = tokenizer
        self.model = model
        # LoRA adapters (LORA_ADAPTERS), checked against the model before anything else is made
        self.adapters = AdapterStore.from_setting(opts.lora_adapters, model, opts.max_loras, opts.max_lora_rank)
        self.pool = in_fresh_thread(_make_pool, model, tokenizer, opts)  # see threads.py
        self.tiers = TieredKV(self.pool, codec=opts.kv_warm_codec, cold_dir=opts.kv_cold_dir or None)
        window = _window(opts, cfg)
        # Blocks behind a sliding window (or a finished chunk) are freed while a request runs,
        # so its prompt's blocks are not all there to share: no prefix cache then.
        prefix = None
        recurrent = getattr(model, "recurrent", False)
        if opts.prefix_cache and not (window or opts.attention_chunk or recurrent):
            prefix = PrefixCache(self.pool, self.tiers, tier_bytes=int(opts.prefix_cache_tier_mb * 2**20))
        kv = KVManager(self.pool, self.tiers, warm_bytes=int(opts.kv_warm_mb * 2**20), prefix=prefix,
                       shift_keys=model.shift_keys)
        if recurrent:  # a state per sequence beside the blocks (kv/states.py), which only it can continue
            kv.states = StateStore(model.state_shapes(),  # the KV budget the position pool leaves
                                   budget_bytes=int(opts.kv_cache_mb * 2**20 * (1 - 1 / POSITION_POOL_SHARE)))
            log.info("%s keeps a recurrent state per sequence: no prefix cache (a state is not shared or rewound "
                     "by blocks) and no speculative decoding (rejected drafts cannot be taken back)",
                     cfg.architecture)
        self.scheduler = Scheduler(kv, opts.token_budget, opts.max_running)
        self.engine = Engine(model, self.pool, self.scheduler, window=window, chunk=opts.attention_chunk,
                             cuda_graphs=opts.cuda_graphs, max_waiting=opts.max_waiting,
                             mask_threads=opts.mask_threads,
                             drafter=None if recurrent else in_fresh_thread(_make_drafter, model, opts, model_path,
                                                                            draft_model),
                             speculate=opts.speculative != "off", draft_tokens=opts.speculative_tokens,
                             draft_max_batch=opts.speculative_max_batch, threads=opts.threads)
        if recurrent and opts.kv_compress != "off":
            log.warning("KV_COMPRESS=%s does nothing for %s: it keeps no K/V", opts.kv_compress, cfg.architecture)
        kv.compressor = None if recurrent else make_compressor(
            opts.kv_compress, opts.kv_compress_window, opts.kv_compress_ratio, self.pool.fmt.name,
            attention_span=window or opts.attention_chunk)
        # why a request may not turn KV compression on here ("": it may)
        self.kv_compress_unsupported = unsupported(self.pool.fmt.name, window or opts.attention_chunk)
        if recurrent:
            self.kv_compress_unsupported = f"a state-space model ({cfg.architecture}) keeps no K/V to compress"
        self.grammars = Grammars(tokenizer.tok, cfg.vocab_size, cfg.eos_token_ids, opts.constraint_cache)
        self.sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()  # the bridge and the server loop may both ask
        self.bridge = Bridge()
        self.engine.start()
        heap.release_free_pages()  # what loading the model and building the pool and step dropped (heap.py)

    @classmethod
    def load(cls, model_path: str | None = None, options: EngineOptions | None = None) -> Generator:
        """Load a GGUF file or HF folder (None: the embedded model) and start the engine."""
        opts = options or EngineOptions()
        torch.set_num_threads(opts.threads or len(os.sched_getaffinity(0)))
        path = model_path or model_files.embedded_model_path()
        model, tokenizer = load_model(path, opts.weight_dtype, opts.device, opts.weight_cache_dir)
        return cls(model, tokenizer, opts, path)

    def close(self) -> None:
        self.engine.stop()
        self.tiers.close()
        self.bridge.close()
        # the pool's memory back now: finished requests and their sequences hold each other (and through their
        # tables, the pool) until Python's cycle collector runs, which a process may not do for many closes
        self.pool.store.clear()

    def weight_memory(self) -> weight_memory.WeightMemory:
        """The model files' mappings (the model's, the drafter's, the tiles mapped from WEIGHT_CACHE_DIR), what
        of them is in RAM, and the process's RSS. Reads /proc: from a thread."""
        files, folder = [f for f in (self.model_path, self.options.draft_model) if f], self.options.weight_cache_dir
        return weight_memory.measure(files + [tile_cache.entry_path(folder, f) for f in files if folder])

    # requests

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text, chat messages or ids); long ones are tokenized (or, for ids,
        checked against the vocabulary) in a thread."""
        chat = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], dict)
        size = sum(len(m.get("content") or "") for m in prompt) if chat else len(prompt)
        if size > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tokenize, prompt)
        return self.tokenize(prompt)

    def tokenize(self, prompt: Prompt) -> list[int]:
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
        outside = [t for t in params.logit_bias if not 0 <= t < self.cfg.vocab_size]
        if outside:
            bad.append(("sampling.logit_bias", f"unknown token ids {outside[:5]} (vocab size {self.cfg.vocab_size})"))
        total = len(ids) + params.max_new_tokens
        if total > self.cfg.context_length:
            bad.append(("sampling.max_new_tokens", f"prompt ({len(ids)} tokens) + max_new_tokens "
                        f"({params.max_new_tokens}) exceeds the context length {self.cfg.context_length}"))
        elif -(-total // self.pool.block_size) > self.pool.capacity:
            bad.append(("sampling.max_new_tokens", f"prompt + max_new_tokens needs more KV blocks than the "
                        f"pool holds ({self.pool.capacity} x {self.pool.block_size} tokens)"))
        if bad:
            raise InvalidRequest(bad)

    async def request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                      request_id: str = "", cache_salt: str = "", adapter: str = "",
                      kv_compress: KVCompression | None = None) -> Request:
        """Submit one request (not in a session). Raises InvalidRequest, NotFound (an adapter not
        loaded) or Overloaded. cache_salt: the prefix cache shares blocks only between requests with
        the same salt. adapter: the name of a loaded LoRA adapter ("": the base model)."""
        self.adapter(adapter)  # an unknown name is refused before the prompt is tokenized
        ids = await self.prompt_ids(prompt)
        await self.compile(sampling)
        return self.submit(ids, sampling, request_id, cache_salt=cache_salt, adapter=adapter, kv_compress=kv_compress)

    async def requests(self, prompt: Prompt, sampling: SamplingParams | None = None,
                       request_id: str = "", cache_salt: str = "", adapter: str = "",
                       kv_compress: KVCompression | None = None) -> list[Request]:
        """Submit a request for sampling.n samples of one prompt (not in a session): one Request
        per sample, by index. The prompt is computed once; the other samples fork from its KV."""
        self.adapter(adapter)
        ids = await self.prompt_ids(prompt)
        await self.compile(sampling)
        return self.submit_n(ids, sampling, request_id, cache_salt=cache_salt, adapter=adapter,
                             kv_compress=kv_compress)

    def adapter(self, name: str) -> Adapter | None:
        """The loaded LoRA adapter of this name (None for "": the base model); NotFound names it."""
        if not name:
            return None
        found = self.adapters.get(name)
        if found is None:
            loaded = ", ".join(self.adapters.names()) or "none"
            raise NotFound(f"LoRA adapter {name[:128]!r} is not loaded (loaded: {loaded})")
        return found

    async def load_adapter(self, name: str, path: str) -> Adapter:
        """Load a LoRA adapter at run time: the name and a MAX_LORAS slot are taken at once
        (AdapterExists, TooManyAdapters), the files read and checked in a worker thread (AdapterError),
        then the adapter is published; requests may name it from then on."""
        self.adapters.reserve(name, path)
        try:
            adapter = await asyncio.to_thread(load_adapter, name, path, self.model, self.adapters.max_rank)
        except BaseException:
            self.adapters.unreserve(name)
            raise
        self.adapters.publish(adapter)
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank, ", ".join(adapter.targets))
        return adapter

    async def unload_adapter(self, name: str, timeout_s: float) -> Adapter:
        """Unload a LoRA adapter: from the call on, requests naming it (and its sessions' turns) are
        NOT_FOUND; the requests running with it finish first. If some still run after timeout_s, the
        unload gives up (AdapterInUse) and the adapter serves again. Its prefix-cache blocks are keyed
        by this load's serial: a later load of the same name never meets them."""
        adapter = self.adapters.withdraw(name)
        if adapter is None:
            loaded = ", ".join(self.adapters.names()) or "none"
            raise NotFound(f"LoRA adapter {name[:128]!r} is not loaded (loaded: {loaded})")
        deadline = time.monotonic() + timeout_s
        while adapter.active > 0:
            if time.monotonic() >= deadline:
                self.adapters.restore(adapter)
                raise AdapterInUse(f"LoRA adapter {name[:128]!r}: {adapter.active} requests still run with it after "
                                   f"{timeout_s:g} s; it stays loaded (cancel them, or unload again later)")
            await asyncio.sleep(0.01)
        self.adapters.forget(adapter)
        log.info("LoRA adapter %r unloaded", name)
        return adapter

    def kv_compressor(self, choice: KVCompression | None) -> KVCompressor | None:
        """The KVCompressor a request's choice asks for (None: exact); no choice (or all fields
        unset), the server's. Raises InvalidRequest naming the request's kv_compress fields."""
        if choice is None or choice == KVCompression():
            return self.scheduler.kv.compressor
        opts = self.options
        return choose(choice, opts.kv_compress, opts.kv_compress_window, opts.kv_compress_ratio,
                      self.kv_compress_unsupported)

    async def compile(self, sampling: SamplingParams | None) -> None:
        """Compile the request's constraint, if any, off the event loop when it is not cached
        (raises InvalidRequest for one the grammar engine rejects)."""
        c = sampling.constraint if sampling else None
        if c is not None and not self.grammars.cached(c):
            await asyncio.to_thread(self.grammars.matcher, c)

    def submit_n(self, ids: list[int], sampling: SamplingParams | None = None, request_id: str = "",
                 cache_salt: str = "", adapter: str = "", kv_compress: KVCompression | None = None) -> list[Request]:
        """As submit, for sampling.n samples: sample i runs with seed + i (when seeded) and joins
        the engine with the first one's KV once its prompt is computed (Engine._fork)."""
        params = sampling or SamplingParams()
        self.check(ids, params)
        first = self.submit(ids, replace(params, n=1), request_id, cache_salt=cache_salt, adapter=adapter,
                            kv_compress=kv_compress, _held=True)
        reqs = [first]
        try:
            for i in range(1, params.n):
                seed = None if params.seed is None else (params.seed + i) % 2**64
                reqs.append(self.submit(ids, replace(params, n=1, seed=seed), request_id, cache_salt=cache_salt,
                                        adapter=adapter, kv_compress=kv_compress, _fork_of=first))
            self.engine.submit(first.seq)
        except BaseException:  # refused (MAX_WAITING, an adapter unloaded): the engine never held any of them
            for r in reqs:
                r.seq.on_release()
            raise
        return reqs

    def submit(self, ids: list[int], sampling: SamplingParams | None = None, request_id: str = "",
               session: Session | None = None, keep: int = 0, cache_salt: str = "", *,
               shift: tuple[int, int] | None = None, adapter: str = "", kv_compress: KVCompression | None = None,
               _held: bool = False, _fork_of: Request | None = None) -> Request:
        """Hand token ids to the engine; call on the event loop that will read the Request.
        shift: a session turn's context shift (kept blocks, dropped blocks; KVManager.shift).
        adapter: a loaded LoRA adapter's name (a session's turn runs with the session's adapter).
        kv_compress: the request's KV compression (unset fields: KV_COMPRESS's); a session's turn
        runs with the session's, and may only name the same.
        (_held / _fork_of: submit_n's, for samples that start together.)"""
        lora = getattr(session, "adapter", None) if session is not None else self.adapter(adapter)
        if session is not None and adapter and (lora is None or lora.name != adapter):
            raise InvalidRequest([("adapter", f"the session runs with {lora.name if lora else 'the base model'!r}; "
                                              "a session keeps the adapter it was created with")])
        compressor = self.kv_compressor(kv_compress)
        if session is not None and kv_compress is not None and _key(compressor) != _key(session.cache.compressor):
            raise InvalidRequest([("kv_compress", "a session keeps the KV compression it was created with "
                                                  f"({_key(session.cache.compressor)[0]})")])
        params = sampling or SamplingParams()
        self.check(ids, params)
        if params.n != 1:
            raise InvalidRequest([("sampling.n", "n > 1 takes Generator.requests / submit_n; a session "
                                                 "turn has one continuation")])
        matcher = self.grammars.matcher(params.constraint) if params.constraint is not None else None
        if params.prompt_logprobs is not None:
            keep = 0  # every prompt position is computed again, for its logits
        req = Request(self.options.stream_buffer)
        on_release = req.on_release
        if lora is not None:  # counted until the engine lets the request go: an unload waits for that
            if not self.adapters.acquire(lora):
                raise NotFound(f"LoRA adapter {lora.name[:128]!r} is not loaded (it is being unloaded or was)")
            on_release = _releasing(self.adapters, lora, req.on_release)
        table = session.cache if session else self.scheduler.kv.new_table(compressor)
        seq = Sequence(ids, params, self.tokenizer, self.cfg.eos_token_ids, req.deliver, table,
                       request_id or uuid.uuid4().hex, keep_kv=session is not None,
                       resume_from=keep if session else None, on_release=on_release,
                       cache_salt=_salt(cache_salt, lora), matcher=matcher, adapter=lora)
        seq.shift = shift
        req.bind(seq, lambda: self.engine.cancel(seq))
        if _fork_of is not None:
            seq.index = len(_fork_of.seq.forks) + 1
            _fork_of.seq.forks.append(seq)  # the engine sees it through the first sample
        elif not _held:
            try:
                self.engine.submit(seq)
            except BaseException:  # refused (MAX_WAITING): the engine never held it
                on_release()
                raise
        return req

    @staticmethod
    async def collect(request: Awaitable[Request]) -> Event:
        """A request's events added up, once the engine has let go of its blocks (so a
        synchronous caller sees the pool as the request left it)."""
        req = await request
        out = await req.result()
        await req.released()
        return out

    @staticmethod
    async def events(request: Awaitable[Request]) -> AsyncIterator[Event]:
        """A request's events; leaving early cancels it."""
        req = await request
        try:
            async for ev in req:
                yield ev
        finally:
            req.cancel()

    # synchronous use

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Event:
        return self.bridge.run(self.collect(self.request(prompt, sampling)))

    def generate_stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Iterator[Event]:
        return self.bridge.iterate(self.events(self.request(prompt, sampling)))

    def batch_generate(self, prompts: list[Prompt], sampling: list[SamplingParams] | SamplingParams | None = None
                       ) -> list[Event | Exception]:
        """All requests run together in the scheduler; a bad one is returned as its exception."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        return self.bridge.run(self._batch(prompts, params))

    async def _batch(self, prompts, params) -> list[Event | Exception]:
        # Every request is submitted before any is awaited, so the scheduler batches them.
        reqs: list[Request | Exception] = []
        for prompt, p in zip(prompts, params, strict=True):
            try:
                reqs.append(await self.request(prompt, p))
            except Exception as e:
                reqs.append(e)
        out = [r if isinstance(r, Exception) else await r.result() for r in reqs]
        for r in reqs:
            if isinstance(r, Request):
                await r.released()
        return out

    # sessions

    def new_session(self, session_id: str = "", adapter: str = "", kv_compress: KVCompression | None = None
                    ) -> Session:
        """adapter: a loaded LoRA adapter's name; every turn of the session runs with it, and with
        kv_compress's KV compression (unset fields: KV_COMPRESS's)."""
        lora = self.adapter(adapter)
        compressor = self.kv_compressor(kv_compress)
        with self._sessions_lock:
            if len(self.sessions) >= self.options.max_sessions:
                raise Overloaded(f"{len(self.sessions)} sessions open (MAX_SESSIONS)", retry_after=5.0)
            sid = session_id or uuid.uuid4().hex
            if sid in self.sessions:
                raise InvalidRequest([("session_id", "a session with this id is already open")])
            s = self.sessions[sid] = Session(self, sid)
            s.adapter = lora
            s.cache.compressor = compressor
        return s

    def get_session(self, session_id: str) -> Session | None:
        with self._sessions_lock:
            return self.sessions.get(session_id)

    def close_session(self, session_id: str, on_freed=None) -> bool:
        """Close a session: a running turn is cancelled and its blocks freed, after which the
        engine thread calls on_freed(). Returns at once."""
        with self._sessions_lock:
            s = self.sessions.pop(session_id, None)
        if s:
            s.close(on_freed)
        return s is not None

    def expire_sessions(self, now: float | None = None) -> int:
        now = now or time.monotonic()
        with self._sessions_lock:
            old = [sid for sid, s in self.sessions.items()
                   if now - s.last_used > self.options.session_ttl_s and not s.busy]
        for sid in old:
            self.close_session(sid)
        return len(old)
