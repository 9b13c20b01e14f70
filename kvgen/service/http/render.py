"""Engine events -> OpenAI's JSON: whole responses, stream chunks, logprobs in each API's shape,
and usage that counts each prompt once however many choices it had."""

from __future__ import annotations

import time

from kvgen.engine.sampling import Sampled
from kvgen.engine.sequence import Event
from kvgen.engine.tokenizer import TextTokenizer
from kvgen.service.http.fanout import Choice
from kvgen.service.http.params import Call
from kvgen.service.metrics import FINISH_REASONS


class Renderer:
    """Writes one call's answer (an id, a creation time and the model name shared by every part)."""

    def __init__(self, call: Call, request_id: str, model: str, tok: TextTokenizer, choices: list[Choice]):
        self.call, self.model, self.tok, self.choices = call, model, tok, choices
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.object = "chat.completion" if call.chat else "text_completion"
        self._started: set[int] = set()  # choices whose first chunk went out (role, echo)
        self._offsets = [0] * len(choices)  # completions' text_offset, per choice
        self._usage: dict[int, Event] = {}  # each choice's last event

    # whole responses

    def response(self, results: list[Event]) -> dict:
        for c, ev in zip(self.choices, results, strict=True):
            self._usage[c.index] = ev
        choices = [self._choice(c, ev) for c, ev in zip(self.choices, results, strict=True)]
        return {**self._head(self.object), "choices": choices, "usage": self.usage()}

    def _choice(self, c: Choice, ev: Event) -> dict:
        finish = FINISH_REASONS.get(ev.finish_reason, "stop")
        logprobs = self._logprobs(c, ev, first=True)
        if self.call.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": ev.text, "refusal": None},
                    "logprobs": logprobs, "finish_reason": finish}
        text = self._echo(c) + ev.text
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    # streams

    def chunks(self, c: Choice, ev: Event) -> list[dict]:
        """The chunks one event makes (none for an event with nothing to say)."""
        first = c.index not in self._started
        self._started.add(c.index)
        finish = None
        if ev.finish_reason is not None:
            self._usage[c.index] = ev
            finish = FINISH_REASONS.get(ev.finish_reason, "stop")
        logprobs = self._logprobs(c, ev, first)
        out = []
        if self.call.chat:
            if first:
                out.append(self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
            if ev.text or logprobs or finish:
                delta = {"content": ev.text} if ev.text else {}
                out.append(self._chunk({"index": c.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish}))
            return out
        text = (self._echo(c) if first else "") + ev.text
        if text or logprobs or finish:
            out.append(self._chunk({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}))
        return out

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: the last chunk, no choices, the whole call's usage."""
        return {**self._head(self.object + ".chunk" if self.call.chat else self.object), "choices": [],
                "usage": self.usage()}

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self._head(self.object + ".chunk" if self.call.chat else self.object), "choices": [choice]}
        if self.call.include_usage:
            chunk["usage"] = None  # as OpenAI does: null on every chunk but the last
        return chunk

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # parts

    def usage(self) -> dict:
        """Each prompt's tokens once (its n choices share them), every choice's completion."""
        prompt = cached = completion = 0
        for c in self.choices:
            u = self._usage.get(c.index)
            if u is None or u.usage is None:
                continue
            completion += u.usage.completion_tokens
            if c.index % self.call.n == 0:  # the prompt's first choice speaks for the prompt
                prompt += u.usage.prompt_tokens
                cached += u.usage.cached_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _echo(self, c: Choice) -> str:
        if not self.call.echo:
            return ""
        req = self.call.requests[c.prompt]
        return req.prompt or self.tok.decode(c.prompt_ids, skip_special=False)

    def _logprobs(self, c: Choice, ev: Event, first: bool) -> dict | None:
        k = self.call.logprobs
        if k is None:
            return None
        items = list(ev.logprobs)
        if self.call.chat:
            return {"content": [self._chat_logprob(s, k) for s in items], "refusal": None} if items else None
        prompt = list(getattr(ev, "prompt_logprobs", None) or []) if first and self.call.echo else []
        if first and self.call.echo and not prompt:
            self._offsets[c.index] = len(self._echo(c))  # offsets count the echoed prompt's text
        if not items and not prompt:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for j, s in enumerate(prompt + items):
            text = self.tok.token_text(s.token_id)
            tokens.append(text)
            lps.append(s.logprob if (j or not prompt) else None)  # the prompt's first token has none
            tops.append({self.tok.token_text(t): lp for t, lp in (s.top or [])[:k]} if k and s.top else None)
            offsets.append(self._offsets[c.index])
            self._offsets[c.index] += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprob(self, s: Sampled, k: int) -> dict:
        text = self.tok.token_text(s.token_id)
        return {"token": text, "logprob": s.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self.tok.token_text(i)), "logprob": lp, "bytes": list(t.encode())}
                                 for i, lp in (s.top or [])[:k]]}
