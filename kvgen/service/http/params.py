"""OpenAI request bodies -> kvgen.v1 GenerateRequests.

Both APIs reach the engine the same way: a body becomes one GenerateRequest per prompt, which
convert.check_request checks and convert.sampling_of maps onto the engine, exactly as for a gRPC
call. What is OpenAI's own (n, stream, echo, the logprobs shape) stays on the Call. Problems are
collected, all of them, and reported under OpenAI's parameter names (errors.param_of).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvgen.engine.constraint import KINDS
from kvgen.errors import InvalidRequest
from kvgen.service import convert
from kvgen.service.http.errors import param_of
from kvgen.service.settings import Settings
from kvgen.v1 import generate_pb2 as pb

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat takes the engine's (256)
MAX_LOGPROBS = 20  # the engine's limit on alternatives per token
INT32 = 2**31
# OpenAI parameters this server does not implement: refused, never silently ignored. Each maps to
# what a body may still carry without asking for the feature (clients send empty defaults).
UNSUPPORTED = {"tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
               "suffix": ("",), "audio": (), "prediction": (), "modalities": (["text"],),
               "guided_whitespace_pattern": ()}
# Every text sampling parameter: (OpenAI name, SamplingParams field, type). top_k, min_p,
# repetition_penalty, min_tokens, stop_token_ids and ignore_eos are vLLM's extensions.
SAMPLING = (("temperature", "temperature", float), ("top_p", "top_p", float), ("top_k", "top_k", int),
            ("min_p", "min_p", float), ("repetition_penalty", "repetition_penalty", float),
            ("presence_penalty", "presence_penalty", float), ("frequency_penalty", "frequency_penalty", float),
            ("min_tokens", "min_new_tokens", int), ("ignore_eos", "ignore_eos", bool))
# vLLM's structured-output fields, each one kind of SamplingParams constraint: guided_* (body
# fields), and the keys of its newer `structured_outputs` object. At most one constraint per call,
# response_format's included.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
              "json_object": "json_object"}
STRUCTURED_IGNORED = ("backend", "disable_fallback", "disable_any_whitespace")  # JSON here has no free blanks


@dataclass
class Call:
    """One OpenAI call, read: the engine requests (one per prompt) and how to answer."""

    chat: bool
    model: str
    requests: list[pb.GenerateRequest]
    n: int = 1  # choices per prompt; choice i of prompt p is index p * n + i
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None = None  # alternatives per token to return; None: no logprobs at all
    echo: bool = False  # completions: the prompt's text before each choice's
    constraint_param: str = ""  # the parameter that set the output constraint (errors name it)

    def param(self, field: str) -> str:
        """The OpenAI parameter a kvgen.v1 field came from."""
        if self.constraint_param and field.removeprefix("sampling.").split(".")[0] in KINDS:
            return self.constraint_param
        return param_of(field)

    def rename(self, e: InvalidRequest) -> InvalidRequest:
        """e, its fields named as this call's parameters (a constraint's errors from compiling it)."""
        return InvalidRequest([(self.param(f), d) for f, d in e.violations])


class _Body:
    """Typed reads of a JSON object; every problem is collected in `bad`."""

    def __init__(self, body):
        if not isinstance(body, dict):
            raise InvalidRequest([("body", "must be a JSON object")])
        self.body = body
        self.bad: list[tuple[str, str]] = []

    def get(self, name: str, kind: type, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            if ok and not -INT32 <= value < INT32:
                self.bad.append((name, "is out of range"))
                return default
        else:
            ok = isinstance(value, kind)
        if not ok:
            self.bad.append((name, f"must be {_KINDS[kind]}"))
            return default
        return float(value) if kind is float else value


_KINDS = {float: "a number", int: "an integer", bool: "a boolean", str: "a string", list: "an array",
          dict: "an object"}


def read_chat(body, settings: Settings) -> Call:
    b = _Body(body)
    messages = _messages(b)
    call = _call(b, chat=True)
    sampling = _sampling(b, call)
    if b.get("logprobs", bool, False):
        call.logprobs = b.get("top_logprobs", int, 0)
    elif b.get("top_logprobs", int) is not None:
        b.bad.append(("top_logprobs", "needs logprobs: true"))
    _set_logprobs(b, call, sampling, "top_logprobs")
    return _finish(b, call, [{"messages": messages}], sampling, settings)


def read_completion(body, settings: Settings) -> Call:
    b = _Body(body)
    prompts = _prompts(b)
    call = _call(b, chat=False)
    sampling = _sampling(b, call)
    call.logprobs = b.get("logprobs", int)
    call.echo = b.get("echo", bool, False)
    _set_logprobs(b, call, sampling, "logprobs")
    if call.echo and call.logprobs is not None:
        sampling.prompt_logprobs = max(call.logprobs, 0)
    best_of = b.get("best_of", int)
    if best_of is not None and best_of not in (1, call.n):
        b.bad.append(("best_of", "is not supported (only best_of = n)"))
    return _finish(b, call, prompts, sampling, settings)


def _call(b: _Body, chat: bool) -> Call:
    model = b.get("model", str, "")
    if not model:
        b.bad.append(("model", "is required (GET /v1/models lists the one served)"))
    options = b.get("stream_options", dict, {})
    call = Call(chat=chat, model=model, requests=[], n=b.get("n", int, 1), stream=b.get("stream", bool, False),
                include_usage=bool(options.get("include_usage")))
    if call.n < 1:
        b.bad.append(("n", "must be >= 1"))
    for name, allowed in UNSUPPORTED.items():
        if b.body.get(name) is not None and b.body[name] not in allowed:
            b.bad.append((name, "is not supported by this server"))
    return call


def _set_logprobs(b: _Body, call: Call, sampling: pb.SamplingParams, name: str) -> None:
    """The engine returns a token's own logprob only with at least one alternative, so it is
    asked for one more than none and the alternatives are cut when rendering."""
    if call.logprobs is None:
        return
    if not 0 <= call.logprobs <= MAX_LOGPROBS:
        b.bad.append((name, f"must be in [0, {MAX_LOGPROBS}]"))
        call.logprobs = None
        return
    sampling.logprobs = max(call.logprobs, 1)


def _sampling(b: _Body, call: Call) -> pb.SamplingParams:
    s = pb.SamplingParams()
    chat = call.chat
    max_tokens = b.get("max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = b.get("max_tokens", int, None if chat else COMPLETIONS_MAX_TOKENS)
    if max_tokens is not None:
        s.max_new_tokens = max_tokens
    for name, target, kind in SAMPLING:
        value = b.get(name, kind)
        if value is not None:
            setattr(s, target, 0 if name == "top_k" and value == -1 else value)  # vLLM: -1 is off
    seed = b.body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        s.seed = seed % 2**64  # any integer: OpenAI's seeds may be negative or past 64 bits
    elif seed is not None:
        b.bad.append(("seed", "must be an integer"))
    stop = b.body.get("stop")
    if isinstance(stop, str):
        s.stop_strings.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        s.stop_strings.extend(stop)
    elif stop is not None:
        b.bad.append(("stop", "must be a string or an array of strings"))
    ids = b.get("stop_token_ids", list, [])
    if ids and not all(isinstance(t, int) and 0 <= t < INT32 for t in ids):
        b.bad.append(("stop_token_ids", "must be token ids"))
    elif ids:
        s.stop_token_ids.extend(ids)
    for key, bias in b.get("logit_bias", dict, {}).items():
        try:
            token = int(key)
            if not 0 <= token < INT32 or isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError
        except ValueError:
            b.bad.append(("logit_bias", "maps token ids (as strings) to numbers in [-100, 100]"))
            break
        s.logit_bias[token] = float(bias)
    _constrain(b, s, call)
    return s


def _constrain(b: _Body, s: pb.SamplingParams, call: Call) -> None:
    """The output constraint: response_format, a guided_* field or structured_outputs (one of them)."""
    given = []  # (parameter, constraint kind, value)
    rf = b.get("response_format", dict)
    if rf and rf.get("type") == "json_object":
        given.append(("response_format", "json_object", True))
    elif rf and rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema") if isinstance(rf.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            b.bad.append(("response_format", "json_schema needs json_schema.schema, a JSON Schema object"))
        else:
            given.append(("response_format", "json_schema", schema))
    elif rf and rf.get("type") != "text":
        b.bad.append(("response_format", "type must be text, json_object or json_schema"))
    given += [(name, kind, b.body[name]) for name, kind in GUIDED.items() if b.body.get(name) is not None]
    for key, value in b.get("structured_outputs", dict, {}).items():
        if key in STRUCTURED and value is not None and value is not False:
            given.append((f"structured_outputs.{key}", STRUCTURED[key], value))
        elif key not in STRUCTURED and key not in STRUCTURED_IGNORED and value not in (None, False):
            b.bad.append((f"structured_outputs.{key}", "is not supported by this server"))
    if len(given) > 1:
        names = ", ".join(name for name, _, _ in given)
        b.bad += [(name, f"at most one output constraint per request; got {names}") for name, _, _ in given[1:]]
        return
    for name, kind, value in given:
        call.constraint_param = name
        if kind == "json_object" and value is True:
            s.json_object = True
        elif kind == "json_schema" and (isinstance(value, dict) or value is True):
            s.json_schema = json.dumps(value)
        elif kind == "json_schema" and isinstance(value, str):
            s.json_schema = value  # the schema's text: the engine parses and checks it
        elif kind in ("regex", "grammar") and isinstance(value, str):
            setattr(s, kind, value)
        elif kind == "choice" and isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            s.choice.choices.extend(value)
        else:
            b.bad.append((name, _CONSTRAINT_KINDS[kind]))


_CONSTRAINT_KINDS = {"json_schema": "must be a JSON Schema: an object, or its text", "regex": "must be a string",
                     "grammar": "must be a string (a Lark grammar)", "json_object": "must be true",
                     "choice": "must be a non-empty array of strings"}


def _messages(b: _Body) -> list[pb.ChatMessage]:
    raw = b.get("messages", list, [])
    if not raw:
        b.bad.append(("messages", "is required: a non-empty array"))
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            b.bad.append((f"messages[{i}]", "must be an object with a role"))
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                b.bad.append((f"messages[{i}].content", "only text parts are supported"))
                continue
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            b.bad.append((f"messages[{i}].content", "must be a string or an array of text parts"))
            continue
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for it
        out.append(pb.ChatMessage(role=role, content=content or ""))
    return out


def kv_compress_fields(b: _Body) -> dict:
    """kvgen's extra body fields for KV compression (GenerateRequest's: kv_compress,
    kv_compress_window, kv_compress_ratio), as given; absent ones take the server's."""
    out = {"kv_compress": b.get("kv_compress", str, ""), "kv_compress_window": b.get("kv_compress_window", int),
           "kv_compress_ratio": b.get("kv_compress_ratio", float)}
    return {k: v for k, v in out.items() if v is not None}


def session_kv_compress(body: dict):
    """A session's KV compression from POST /v1/sessions' body (the same fields); None: the server's."""
    b = _Body(body)
    fields = kv_compress_fields(b)
    if b.bad:
        raise InvalidRequest(b.bad)
    return convert.kv_compress_of(pb.CreateSessionRequest(**fields))


def _prompts(b: _Body) -> list[dict]:
    """A completion's prompt(s): text, texts, token ids, or lists of token ids."""
    p = b.body.get("prompt")
    if isinstance(p, str):
        return [{"prompt": p}]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if all(_is_id(x) for x in p):
            return [{"prompt_token_ids": p}]
        if all(isinstance(x, list) and x and all(_is_id(t) for t in x) for x in p):
            return [{"prompt_token_ids": x} for x in p]
    b.bad.append(("prompt", "must be a string, an array of strings, an array of token ids or an array of arrays "
                            "of token ids"))
    return []


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < INT32


def _finish(b: _Body, call: Call, prompts: list[dict], sampling: pb.SamplingParams, settings: Settings) -> Call:
    user = b.get("user", str, "")
    salt = user if len(user) <= convert.MAX_ID_CHARS else hashlib.sha256(user.encode()).hexdigest()
    compression = kv_compress_fields(b)
    if len(prompts) * call.n > settings.max_batch_entries:
        b.bad.append(("n", f"{len(prompts)} prompt(s) x n = {len(prompts) * call.n} choices; at most "
                           f"{settings.max_batch_entries} (MAX_BATCH_ENTRIES)"))
    bad = b.bad
    if not bad:
        for i, prompt in enumerate(prompts):
            req = pb.GenerateRequest(sampling=sampling, cache_salt=salt, **prompt, **compression)
            try:
                convert.check_request(req, settings)
            except InvalidRequest as e:
                for f, d in e.violations:
                    name = call.param(f)
                    bad.append((f"{name}[{i}]" if len(prompts) > 1 and name == "prompt" else name, d))
            call.requests.append(req)
    if bad:
        raise InvalidRequest(list(dict.fromkeys(bad)))  # once each (every prompt shares the sampling)
    return call
