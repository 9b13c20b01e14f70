"""A request inside the engine: its tokens, its KV, and how its text comes out."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.sampling import Sampled, SamplingParams
from kvgen.engine.speculative.policy import DraftLength
from kvgen.engine.tokenizer import Detokenizer, TextTokenizer


class FinishReason(IntEnum):  # same numbers as kvgen.v1.FinishReason
    STOP_TOKEN = 1
    STOP_STRING = 2
    LENGTH = 3
    CANCELLED = 4
    ABORTED = 5


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Event:
    """What a request's consumer receives: a delta, and on the last one the ending. Events add
    up: the sum of a request's events is its whole result (Request.result)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[Sampled] = field(default_factory=list)  # on the first event, when asked for
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    usage: Usage | None = None
    timings: dict | None = None
    error: Exception | None = None
    index: int = 0  # which of a request's n samples (sampling.n)

    def add(self, ev: Event) -> None:
        self.index = ev.index
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        self.prompt_logprobs += ev.prompt_logprobs
        if ev.finish_reason is not None:
            self.finish_reason, self.matched_stop = ev.finish_reason, ev.matched_stop
            self.usage, self.timings, self.error = ev.usage, ev.timings, ev.error


_ids = itertools.count(1)


class Sequence:
    """keep_kv: a session's turn, whose blocks stay for the next turn (parked, not released).
    resume_from: for such a turn, how many of the session's cached tokens the prompt shares;
    the scheduler keeps those when it admits the turn (None once admitted, or not a session).
    on_release: called on the engine thread once the engine has let go of the KV blocks.
    cache_salt: the prefix cache shares blocks only between requests with the same salt.
    matcher: the llguidance matcher of the request's constraint (None: unconstrained); it is fed
    every sampled token and ends the output once the constraint is complete.
    adapter: the LoRA adapter (lora.Adapter) its rows run with (None: the base model)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer: TextTokenizer,
                 eos_ids: list[int], emit, cache: PagedKVCache, request_id: str = "", *,
                 keep_kv: bool = False, resume_from: int | None = None, on_release=None, cache_salt: str = "",
                 matcher=None, adapter=None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.emit = emit  # called from the engine thread with an Event
        self.cache = cache
        self.cached_tokens = 0  # prompt tokens whose KV a session had cached (set at admission)
        self.keep_kv = keep_kv
        self.cache_salt = cache_salt  # requests share prefix-cache blocks only under the same salt
        self.adapter = adapter
        self.resume_from = resume_from
        self.on_release = on_release
        self._final: Event | None = None  # the finishing event, held until the KV is released
        self.tokenizer = tokenizer
        if params.stop_token_ids is not None:
            self.stop_ids = set(params.stop_token_ids)
        else:
            self.stop_ids = set() if params.ignore_eos else set(eos_ids)
        self.matcher = matcher
        if matcher is not None:  # the grammar allows EOS only where the output may end: it ends it
            self.stop_ids |= set(eos_ids)
        # prompt logprobs so far (the first token has none); filled chunk by chunk by the engine
        self.prompt_logprobs: list[Sampled] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [Sampled(self.prompt_ids[0])]
        self.rng = None  # sampling's own random stream: a seeded request repeats whatever else runs
        if not params.greedy:
            self.rng = torch.Generator()
            self.rng.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.detok = Detokenizer(tokenizer, self.prompt_ids)
        self.held = ""  # text kept back because it may start a stop string
        self.max_stop = max((len(s) for s in params.stop_strings), default=0)
        self.cancelled = False
        self.finished = False
        self.preemptions = 0
        self.arrival = time.perf_counter()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: FinishReason | None = None
        # speculative decoding: this step's drafted tokens (fed after the last token, not yet
        # part of the output), their draft distributions [k, V] (None: greedy or prompt lookup),
        # this sequence's adaptive draft length, and what its verifications kept
        # n parallel samples: this sequence's index among them, and (on the first, until its
        # prompt is computed) the others, which fork from its KV then (Engine._fork)
        self.index = 0
        self.forks: list[Sequence] = []
        self.shift: tuple[int, int] | None = None  # a session turn's context shift (KVManager.shift)
        self.draft: list[int] = []
        self.draft_q: torch.Tensor | None = None
        self.draft_length = DraftLength()
        self.drafted = self.accepted = self.verifications = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def reuses_kv(self) -> bool:
        """Whether the prompt may start from cached KV (prompt logprobs need every position computed)."""
        return self.prompt_logprobs is None

    @property
    def shares_prompt(self) -> bool:
        """A request of its own (not a session's turn) whose prompt blocks go through the prefix
        cache: matched there at admission, indexed there as they are written."""
        return self.reuses_kv and not self.keep_kv

    @property
    def pending(self) -> int:
        """Tokens whose K/V still need computing (a draft's included)."""
        return self.num_tokens + len(self.draft) - self.cache.length

    def cut_draft(self, keep: int) -> None:
        """Keep only the first `keep` drafted tokens (0: no draft)."""
        if keep < len(self.draft):
            self.draft = self.draft[:keep]
            self.draft_q = self.draft_q[:keep] if self.draft_q is not None and keep else None

    def record_draft(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verifications += 1
        self.draft_length.record(drafted, accepted)

    def on_token(self, s: Sampled) -> None:
        """Record a sampled token, emit its text, and finish if a stop condition holds."""
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.output_ids.append(s.token_id)
        ev = Event(token_ids=[s.token_id], logprobs=[s] if s.logprob is not None else [])
        if len(self.output_ids) == 1 and self.prompt_logprobs is not None:
            ev.prompt_logprobs = self.prompt_logprobs
        complete = False
        if self.matcher is not None:
            if not self.matcher.consume_token(s.token_id):  # the mask makes this unreachable
                return self.finish(FinishReason.ABORTED, ev, error=RuntimeError(
                    f"constraint rejected token {s.token_id}: {self.matcher.get_error()}"))
            complete = self.matcher.is_stopped()
        if s.token_id in self.stop_ids:
            ev.text = self.held  # no stop string can complete any more
            self.held = ""
            return self.finish(FinishReason.STOP_TOKEN, ev, self.tokenizer.token_text(s.token_id))
        text = self.held + self.detok.add(s.token_id)
        at_length = len(self.output_ids) >= self.params.max_new_tokens
        if at_length or complete:
            text += self.detok.flush()
        for stop in self.params.stop_strings:
            i = text.find(stop)
            if i >= 0:
                ev.text = text[:i]
                self.held = ""
                return self.finish(FinishReason.STOP_STRING, ev, stop)
        if complete:  # the constraint is satisfied and nothing may follow: a stop, like EOS
            ev.text, self.held = text, ""
            return self.finish(FinishReason.STOP_TOKEN, ev)
        if at_length:
            ev.text, self.held = text, ""
            return self.finish(FinishReason.LENGTH, ev)
        keep = _stop_prefix_len(text, self.params.stop_strings, self.max_stop)
        ev.text, self.held = text[: len(text) - keep], text[len(text) - keep:]
        ev.index = self.index
        self.emit(ev)

    def finish(self, reason: FinishReason, ev: Event | None = None, matched: str = "",
               error: Exception | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        ev = ev or Event()
        if reason in (FinishReason.CANCELLED, FinishReason.ABORTED) and self.held:
            ev.text += self.held
        ev.finish_reason = reason
        ev.matched_stop = matched
        ev.error = error
        ev.usage = Usage(len(self.prompt_ids), len(self.output_ids), self.cached_tokens)
        end = self.finished_at = time.perf_counter()
        self.finish_reason = reason
        ev.timings = {
            "queue_ms": ((self.admitted_at or end) - self.arrival) * 1e3,
            "time_to_first_token_ms": ((self.first_token_at or end) - self.arrival) * 1e3,
            "total_ms": (end - self.arrival) * 1e3,
        }
        ev.index = self.index
        self._final = ev  # sent by emit_final, once the engine has let go of the KV blocks

    def emit_final(self) -> None:
        """Send the finishing event. The engine calls this after releasing the sequence, so a client that
        has read the end of its stream finds the pool, the metrics and its session already without it."""
        ev, self._final = self._final, None
        if ev is not None:
            self.emit(ev)
            # nothing follows the end: let go of the request's callbacks, which hold the request, whose seq is
            # this (a cycle that kept every finished request, its sequence and their buffers until the cycle
            # collector ran)
            self.emit = self.on_release = _ended


def _ended(*_) -> None:
    """A finished sequence's callbacks."""


def _stop_prefix_len(text: str, stops: list[str], max_stop: int) -> int:
    """Length of the longest end of text that is the start of some stop string."""
    for n in range(min(len(text), max_stop - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
