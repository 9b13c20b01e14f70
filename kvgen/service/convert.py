"""kvgen.v1 messages <-> engine values, and the cheap checks a request passes before any work."""

from __future__ import annotations

import re
from collections import Counter

from kvgen.engine.constraint import Constraint
from kvgen.engine.kv.compress import KVCompression
from kvgen.engine.sampling import Sampled, SamplingParams
from kvgen.engine.sequence import Event
from kvgen.engine.tokenizer import TextTokenizer
from kvgen.errors import InvalidRequest
from kvgen.service.errors import clip, to_status
from kvgen.service.settings import Settings
from kvgen.v1 import generate_pb2 as pb

INPUTS = ("prompt", "messages", "prompt_token_ids")
MAX_ID_CHARS = 128  # session_id and request_id
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]+")
_DEFAULTS = Settings()


def prompt_of(req: pb.GenerateRequest, settings: Settings | None = None):
    """The request's one input, as the engine takes it. Its size is checked first, so that an
    oversized prompt is refused before it costs any tokenizing."""
    limit = (settings or _DEFAULTS).max_prompt_bytes
    given = [name for name in INPUTS if (getattr(req, name) if name == "prompt" else len(getattr(req, name)))]
    if not given:
        raise InvalidRequest([("prompt", "one of prompt, messages, prompt_token_ids is required")])
    if len(given) > 1:
        raise InvalidRequest([(name, f"only one of prompt, messages, prompt_token_ids may be set; got "
                               f"{', '.join(given)}") for name in given[1:]])
    if given[0] == "prompt":
        size = _utf8_size(req.prompt, limit)
        if size > limit:
            raise InvalidRequest([("prompt", f"is {size} bytes; at most {limit} are accepted")])
        return req.prompt
    if given[0] == "messages":
        size = sum(m.ByteSize() for m in req.messages)  # as sent: roles, contents and their framing
        if size > limit:
            raise InvalidRequest([("messages", f"are {size} bytes together; at most {limit} are accepted")])
        bad = [(f"messages[{i}].role", "must not be empty") for i, m in enumerate(req.messages) if not m.role]
        if bad:
            raise InvalidRequest(bad[:8])
        return [{"role": m.role, "content": m.content} for m in req.messages]
    return list(req.prompt_token_ids)


def _utf8_size(text: str, limit: int) -> int:
    """len(text.encode()) without encoding a text that is over the limit by its length alone."""
    return len(text) if len(text) > limit else len(text.encode())


def check_request(req: pb.GenerateRequest, settings: Settings | None = None) -> None:
    """Every check of a GenerateRequest that needs no model: exactly one input within the size
    limit, well-formed ids, sampling values in range. Raises InvalidRequest with them all."""
    bad = []
    try:
        prompt_of(req, settings)
    except InvalidRequest as e:
        bad += e.violations
    if req.session_id:
        bad += session_id_violations(req.session_id)
    if len(req.request_id) > MAX_ID_CHARS:
        bad.append(("request_id", f"is {len(req.request_id)} characters; at most {MAX_ID_CHARS}"))
    if len(req.cache_salt) > MAX_ID_CHARS:
        bad.append(("cache_salt", f"is {len(req.cache_salt)} characters; at most {MAX_ID_CHARS}"))
    if len(req.adapter) > MAX_ID_CHARS:
        bad.append(("adapter", f"is {len(req.adapter)} characters; at most {MAX_ID_CHARS}"))
    bad += [(f"sampling.{f}", d) for f, d in sampling_of(req).validate()]
    if bad:
        raise InvalidRequest(bad)


def check_batch(req: pb.BatchGenerateRequest, settings: Settings | None = None) -> None:
    """A BatchGenerate within the entry limit (each entry is checked on its own, and fails alone)."""
    limit = (settings or _DEFAULTS).max_batch_entries
    if len(req.requests) > limit:
        raise InvalidRequest([("requests", f"{len(req.requests)} entries; at most {limit} are accepted")])


def session_id_violations(session_id: str, field: str = "session_id") -> list[tuple[str, str]]:
    """(field, problem) for a session id that no session can have: empty, too long, odd characters."""
    if not session_id:
        return [(field, "is required")]
    if len(session_id) > MAX_ID_CHARS:
        return [(field, f"is {len(session_id)} characters; at most {MAX_ID_CHARS}")]
    if not _SESSION_ID.fullmatch(session_id):
        return [(field, f"{clip(session_id)!r} has characters outside [A-Za-z0-9._:-]")]
    return []


def check_session_id(session_id: str) -> None:
    """Raises InvalidRequest (a BadRequest on the wire) for a malformed session id."""
    bad = session_id_violations(session_id)
    if bad:
        raise InvalidRequest(bad)


def kv_compress_of(req: pb.GenerateRequest | pb.CreateSessionRequest) -> KVCompression | None:
    """The request's (or session's) KV compression fields; None where none is set (the server's)."""
    window = req.kv_compress_window if req.HasField("kv_compress_window") else None
    ratio = req.kv_compress_ratio if req.HasField("kv_compress_ratio") else None
    if not req.kv_compress and window is None and ratio is None:
        return None
    return KVCompression(req.kv_compress, window, ratio)


# SamplingParams' `optional` fields: unset keeps the engine's default
_OPTIONAL = ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens", "seed", "logprobs", "min_p",
             "presence_penalty", "frequency_penalty", "min_new_tokens", "prompt_logprobs", "speculative", "n")


def sampling_of(req: pb.GenerateRequest) -> SamplingParams:
    s = req.sampling
    p = SamplingParams()
    for name in _OPTIONAL:
        if s.HasField(name):
            setattr(p, name, getattr(s, name))
    if s.stop_token_ids:
        p.stop_token_ids = list(s.stop_token_ids)
    p.stop_strings = list(s.stop_strings)
    p.ignore_eos = s.ignore_eos
    p.logit_bias = dict(s.logit_bias)
    kind = s.WhichOneof("constraint")
    if kind == "choice":
        p.constraint = Constraint.choice(list(s.choice.choices))
    elif kind == "json_object":
        if s.json_object:  # false asks for nothing
            p.constraint = Constraint("json_object")
    elif kind is not None:
        p.constraint = Constraint(kind, getattr(s, kind))
    return p


def _logprobs(items: list[Sampled], tok: TextTokenizer) -> list[pb.TokenLogprob]:
    # (a prompt's first token has no logprob: it is sent as 0 with no alternatives)
    return [pb.TokenLogprob(
        token_id=s.token_id, token=tok.token_text(s.token_id), logprob=s.logprob or 0.0,
        top=[pb.TopLogprob(token_id=t, token=tok.token_text(t), logprob=lp) for t, lp in (s.top or [])])
        for s in items]


def _usage(u) -> pb.Usage | None:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    cached_tokens=u.cached_tokens) if u else None


def _timings(t) -> pb.Timings | None:
    return pb.Timings(**t) if t else None


def stream_message(ev: Event, request_id: str, tok: TextTokenizer) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(
        request_id=request_id, text=ev.text, token_ids=ev.token_ids, logprobs=_logprobs(ev.logprobs, tok),
        finish_reason=int(ev.finish_reason or 0), matched_stop=ev.matched_stop,
        usage=_usage(ev.usage), timings=_timings(ev.timings), prompt_logprobs=_logprobs(ev.prompt_logprobs, tok),
        index=ev.index)


def batch_stream_message(index: int, item: pb.GenerateStreamResponse | Exception) -> pb.BatchGenerateStreamResponse:
    """A BatchGenerateStream message: entry `index`'s stream message, or the error that ended it."""
    if isinstance(item, Exception):
        return pb.BatchGenerateStreamResponse(index=index, error=to_status(item))
    return pb.BatchGenerateStreamResponse(index=index, response=item)


def response(samples: list[Event], request_id: str, tok: TextTokenizer) -> pb.GenerateResponse:
    """One request's reply: its only sample, or (n > 1) sample 0 with every sample in choices."""
    out = _sample(samples[0], request_id, tok)
    if len(samples) > 1:
        out.choices.extend(_sample(r, request_id, tok) for r in samples)
        used = [r.usage for r in samples if r.usage]
        if used:
            out.usage.completion_tokens = sum(u.completion_tokens for u in used)
    return out


def _sample(r: Event, request_id: str, tok: TextTokenizer) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, text=r.text, token_ids=r.token_ids, finish_reason=int(r.finish_reason or 0),
        matched_stop=r.matched_stop, usage=_usage(r.usage), logprobs=_logprobs(r.logprobs, tok),
        timings=_timings(r.timings), prompt_logprobs=_logprobs(r.prompt_logprobs, tok), index=r.index)


def lora_adapters(gen) -> list[pb.LoraAdapter]:
    """GetModelInfo's and GetLoad's adapters: each loaded one, with its requests so far and those
    running and waiting now (read from the engine's lists, as GetLoad's other counts are)."""
    running = Counter(seq.adapter.name for seq in list(gen.scheduler.running) if seq.adapter is not None)
    waiting = Counter(seq.adapter.name for seq in list(gen.scheduler.waiting) if seq.adapter is not None)
    return [pb.LoraAdapter(name=a.name, rank=a.rank, target_modules=a.targets, requests=a.requests,
                           running=running[a.name], waiting=waiting[a.name]) for a in gen.adapters.adapters.values()]
