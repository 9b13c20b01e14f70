"""vLLM's run-time LoRA routes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"} (plus kvgen's "timeout_seconds"), answered as vLLM
answers them (a plain-text "Success: ..." line; errors as OpenAI's error JSON: 400 for a bad or
duplicate adapter, 404 for an unknown one). Admin-only with API keys: service/lora_admin.py."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from kvgen.engine.generator import Generator
from kvgen.errors import InvalidRequest
from kvgen.service import lora_admin
from kvgen.service.http.errors import HttpError
from kvgen.service.http.routes import read_json
from kvgen.service.settings import Settings


class LoraRoutes:
    def __init__(self, settings: Settings, ready: Callable[[], Generator]):
        self.settings = settings
        self.ready = ready  # the served engine, or Unavailable

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        gen, body = await self._admitted(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise InvalidRequest([("lora_name", "lora_name and lora_path must be strings")])
        out = await lora_admin.load(gen, name, path)
        _raise_for(out)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        gen, body = await self._admitted(request)
        name, timeout = body.get("lora_name"), body.get("timeout_seconds", 0)
        if not isinstance(name, str):
            raise InvalidRequest([("lora_name", "must be a string")])
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise InvalidRequest([("timeout_seconds", "must be a number")])
        out = await lora_admin.unload(gen, name, float(timeout))
        _raise_for(out)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _admitted(self, request: web.Request) -> tuple[Generator, dict]:
        gen = self.ready()
        given = [("authorization", v) for v in request.headers.getall("Authorization", [])]
        if not lora_admin.is_admin(self.settings, given):
            raise HttpError(403, lora_admin.NOT_ADMIN, kind="permission_error", code="not_admin")
        body = await read_json(request)
        if not isinstance(body, dict):
            raise InvalidRequest([("body", "must be a JSON object")])
        return gen, body


def _raise_for(out: lora_admin.Outcome) -> None:
    if out.adapter is None:
        kind = "invalid_request_error" if out.http < 500 else "server_error"
        raise HttpError(out.http, out.message, kind=kind, code=out.code.name.lower())
