"""vLLM's tokenizer routes, which lm-eval's remote tokenizer backend finds and uses (so it needs no
copy of the model's tokenizer): GET /tokenizer_info, POST /tokenize, POST /detokenize."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web

from kvgen.engine.generator import INLINE_TOKENIZE_CHARS, Generator
from kvgen.errors import InvalidRequest
from kvgen.service.http.routes import read_json
from kvgen.service.settings import Settings


class TokenizerRoutes:
    def __init__(self, settings: Settings, ready: Callable[[], Generator]):
        self.settings = settings
        self.ready = ready  # the served engine, or Unavailable

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/tokenizer_info", self.info)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def info(self, request: web.Request) -> web.Response:
        gen = self.ready()
        tok = gen.tokenizer
        bos = tok.tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
        return web.json_response({"eos_token": tok.eos_token or None, "bos_token": bos, "pad_token": None,
                                  "chat_template": tok.chat_template, "model_max_length": gen.cfg.context_length})

    async def tokenize(self, request: web.Request) -> web.Response:
        """{"prompt": text, "add_special_tokens": bool} or {"messages": [...]} (with the chat
        template and its generation prompt) -> {"tokens", "count", "max_model_len"}."""
        gen = self.ready()
        body = await _body(request)
        text, messages = body.get("prompt"), body.get("messages")
        if isinstance(messages, list) and messages and text is None:
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise InvalidRequest([("messages", "must be objects with a role and a content")])
            text = json.dumps(messages)  # for the size check only
            encode = lambda: gen.tokenize([{"role": m["role"], "content": m.get("content") or ""}  # noqa: E731
                                           for m in messages])
        elif isinstance(text, str):
            add_bos = None if body.get("add_special_tokens", True) else False
            encode = lambda: gen.tokenizer.encode(text, add_bos=add_bos)  # noqa: E731
        else:
            raise InvalidRequest([("prompt", "a string (or messages) is required")])
        if len(text.encode()) > self.settings.max_prompt_bytes:
            raise InvalidRequest([("prompt", f"at most {self.settings.max_prompt_bytes} bytes are accepted")])
        ids = await asyncio.to_thread(encode) if len(text) > INLINE_TOKENIZE_CHARS else encode()
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": gen.cfg.context_length})

    async def detokenize(self, request: web.Request) -> web.Response:
        gen = self.ready()
        ids = (await _body(request)).get("tokens")
        vocab = gen.cfg.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequest([("tokens", f"must be an array of token ids in [0, {vocab})")])
        return web.json_response({"prompt": gen.tokenizer.decode(ids, skip_special=False)})


async def _body(request: web.Request) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest([("body", "must be a JSON object")])
    return body
