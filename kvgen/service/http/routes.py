"""The OpenAI routes: POST /v1/chat/completions and /v1/completions (whole, or streamed as
server-sent events ending with `data: [DONE]`), GET /v1/models; with an `x-session-id` header a
completion runs as a turn of that session (sessions.py: POST and DELETE /v1/sessions).

A call is read and checked (params.py), then all its choices are submitted before anything is
sent, so a refusal (a bad value, a full queue) is a plain HTTP error. A stream that fails later
ends with an OpenAI error object as its last event, which the SDK raises."""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

from aiohttp import web
from opentelemetry import trace

from kvgen.engine.generator import Generator
from kvgen.engine.sequence import Event, Usage
from kvgen.errors import InvalidRequest, Unavailable
from kvgen.service import tracing
from kvgen.service.http import errors, fanout
from kvgen.service.http.errors import HttpError
from kvgen.service.http.params import Call, read_chat, read_completion
from kvgen.service.http.render import Renderer
from kvgen.service.http.sessions import SessionRoutes
from kvgen.service.settings import Settings

# Also names the served model, whatever it is: a client need not know the model's own name.
MODEL_ALIAS = "kvgen"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIRoutes:
    def __init__(self, settings: Settings, owners: dict[str, str] | None = None):
        """owners: session id -> the opener's key digest, shared with the gRPC servicer if given."""
        self.settings = settings
        self.gen: Generator | None = None  # set once the model is loaded
        self.draining = False
        self.sessions = SessionRoutes(self, owners)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self.sessions.add_to(app)

    def ready(self) -> Generator:
        if self.draining:
            raise Unavailable("the server is shutting down")
        if self.gen is None:
            raise Unavailable("the model is still loading")
        return self.gen

    async def models(self, request: web.Request) -> web.Response:
        gen = self.ready()
        base = {"id": gen.cfg.name, "object": "model", "created": 0, "owned_by": "kvgen",
                "max_model_len": gen.cfg.context_length}
        # vLLM's convention: each LoRA adapter is a model of its own, its root the folder, its parent the base
        loras = [{**base, "id": a.name, "root": a.path, "parent": gen.cfg.name} for a in gen.adapters.adapters.values()]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, read_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, read_completion)

    async def _complete(self, request: web.Request, read) -> web.StreamResponse:
        gen = self.ready()
        call = read(await read_json(request), self.settings)
        adapter = "" if call.model in (gen.cfg.name, MODEL_ALIAS) else call.model  # vLLM's: a LoRA adapter's name
        for req in call.requests:
            req.adapter = adapter
        request_id = uuid.uuid4().hex
        span = trace.get_current_span()
        # before the adapter is looked up, as over gRPC: a refusal's span names the adapter asked for
        tracing.start_request(span, call.requests[0], fanout.params_of(call), gen.cfg.name, request_id, call.stream)
        if adapter and gen.adapters.get(adapter) is None:
            raise HttpError(404, f"model {call.model!r} is not served here; GET /v1/models lists {gen.cfg.name!r} "
                                 f"(or say {MODEL_ALIAS!r}) and the LoRA adapters loaded", code="model_not_found")
        session = self.sessions.turn_of(request, gen)
        if session is not None and adapter and adapter != getattr(session.adapter, "name", ""):
            raise InvalidRequest([("model", "a session keeps the adapter it was opened with")])
        if session is not None and (call.n != 1 or len(call.requests) != 1):
            raise InvalidRequest([("n" if call.n != 1 else "prompt", "a session turn is one prompt with one choice")])
        if session is not None:
            span.set_attribute("gen_ai.conversation.id", session.session_id)
            if session.adapter is not None:  # a turn runs with its session's adapter (the model that answers)
                adapter = session.adapter.name
        try:
            if session is not None:
                choices = await fanout.submit_turn(session, call, request_id, self.settings)
            else:
                choices = await fanout.submit(gen, call, request_id, self.settings)
        except InvalidRequest as e:  # a constraint the grammar engine refused: named as the call named it
            raise call.rename(e) from None
        out = Renderer(call, request_id, adapter or gen.cfg.name, gen.tokenizer, choices)
        if call.stream:
            return await self._stream(request, call, choices, out, span)
        results = await fanout.results(choices)
        answer = out.response(results)
        _end_span(span, results, answer["usage"], out.model)  # as the answer names it (an adapter's name)
        return web.json_response(answer)

    async def _stream(self, request: web.Request, call: Call, choices, out: Renderer, span) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        last: dict[int, Event] = {}
        try:
            async with aclosing(fanout.events(choices)) as events:
                async for c, ev in events:
                    if ev.finish_reason is not None:
                        last[c.index] = ev
                    for chunk in out.chunks(c, ev):
                        await resp.write(_sse(chunk))
            usage = out.usage()
            if call.include_usage:
                await resp.write(_sse(out.usage_chunk()))
            await resp.write(b"data: [DONE]\n\n")
            _end_span(span, [last[c.index] for c in choices], usage, out.model)
        except ConnectionError:  # the client went away; leaving the loop above cancelled every choice
            raise
        except Exception as e:  # the status line is gone: the error is the stream's last event
            tracing.record_error(span, e)
            await resp.write(_sse(errors.answer(e)[1]))
        return resp


async def read_json(request: web.Request):
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from None


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _end_span(span, results: list[Event], usage: dict, model: str) -> None:
    """The GenAI attributes of the whole call: every choice's finish reason, usage counted once."""
    if not span.is_recording() or not results:
        return
    total = Event(finish_reason=results[0].finish_reason, timings=results[0].timings,
                  usage=Usage(usage["prompt_tokens"], usage["completion_tokens"],
                              usage["prompt_tokens_details"]["cached_tokens"]))
    tracing.end_request(span, total, model)
    span.set_attribute("gen_ai.response.finish_reasons",
                       [tracing.FINISH_REASONS[r.finish_reason] for r in results if r.finish_reason is not None])
