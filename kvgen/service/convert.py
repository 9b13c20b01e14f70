"""kvgen.v1 messages <-> engine values."""

from __future__ import annotations

from kvgen.engine.generator import Result
from kvgen.errors import InvalidRequest
from kvgen.engine.sampling import Sampled, SamplingParams
from kvgen.engine.sequence import Event
from kvgen.engine.tokenizer import TextTokenizer
from kvgen.v1 import generate_pb2 as pb

INPUTS = ("prompt", "messages", "prompt_token_ids")


def prompt_of(req: pb.GenerateRequest):
    given = [name for name in INPUTS if (getattr(req, name) if name == "prompt" else len(getattr(req, name)))]
    if not given:
        raise InvalidRequest([("prompt", "one of prompt, messages, prompt_token_ids is required")])
    if len(given) > 1:
        raise InvalidRequest([(name, f"only one of prompt, messages, prompt_token_ids may be set; got "
                               f"{', '.join(given)}") for name in given[1:]])
    if given[0] == "prompt":
        return req.prompt
    if given[0] == "messages":
        bad = [(f"messages[{i}].role", "must not be empty") for i, m in enumerate(req.messages) if not m.role]
        if bad:
            raise InvalidRequest(bad)
        return [{"role": m.role, "content": m.content} for m in req.messages]
    return list(req.prompt_token_ids)


def sampling_of(req: pb.GenerateRequest) -> SamplingParams:
    s = req.sampling
    p = SamplingParams()
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens", "seed", "logprobs"):
        if s.HasField(name):
            setattr(p, name, getattr(s, name))
    if s.stop_token_ids:
        p.stop_token_ids = list(s.stop_token_ids)
    p.stop_strings = list(s.stop_strings)
    p.ignore_eos = s.ignore_eos
    return p


def _logprobs(items: list[Sampled], tok: TextTokenizer) -> list[pb.TokenLogprob]:
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
        usage=_usage(ev.usage), timings=_timings(ev.timings))


def response(r: Result, request_id: str, tok: TextTokenizer) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, text=r.text, token_ids=r.token_ids, finish_reason=int(r.finish_reason or 0),
        matched_stop=r.matched_stop, usage=_usage(r.usage), logprobs=_logprobs(r.logprobs, tok),
        timings=_timings(r.timings))
