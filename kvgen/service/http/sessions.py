"""Sessions over HTTP: POST /v1/sessions opens one, DELETE /v1/sessions/{id} closes it, and a
completion call with an `x-session-id` header (the header the mesh routes gRPC sessions by) runs
as a turn of that session, exactly as a gRPC call naming it does: chat messages are appended to
the session's conversation (the server keeps the replies), a completion's prompt continues its
token history, and the cached prefix is not computed again (usage.prompt_tokens_details.
cached_tokens counts it).

A session belongs to the API key that opened it: to any other it does not exist (404). `owners`
maps session ids to the opener's key digest, as GeneratorServicer.owners does (the server may pass
that very dict, so that either API reaches a session the other opened)."""

from __future__ import annotations

import asyncio
import hashlib
import json

from aiohttp import web

from kvgen.engine.generator import Generator
from kvgen.engine.session import Session
from kvgen.errors import InvalidRequest, NotFound, Overloaded, Unavailable
from kvgen.service import convert
from kvgen.service.errors import clip
from kvgen.service.http.errors import HttpError
from kvgen.service.http.params import session_kv_compress
from kvgen.service.routing import SESSION_HEADER


class SessionRoutes:
    def __init__(self, routes, owners: dict[str, str] | None = None):
        """routes: the OpenAIRoutes, whose ready() is the served Generator (Unavailable while
        loading or draining) and whose gen is it (None while loading)."""
        self.routes = routes
        self.owners: dict[str, str] = {} if owners is None else owners

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/sessions", self.create)
        app.router.add_delete("/v1/sessions/{session_id}", self.close)

    async def create(self, request: web.Request) -> web.Response:
        """Body (optional): {"session_id": "..."}, the client's choice of id (else the
        x-session-id header's, else the server picks one); kv_compress, kv_compress_window,
        kv_compress_ratio: every turn's KV compression (else the server's)."""
        gen = self.routes.ready()
        body = await _read_body(request)
        wanted = body.get("session_id") or ""
        if not isinstance(wanted, str):
            raise InvalidRequest([("session_id", "must be a string")])
        header = request.headers.get(SESSION_HEADER, "")
        if wanted and header and wanted != header:
            raise InvalidRequest([("session_id", f"{clip(wanted)!r} differs from the {SESSION_HEADER} header "
                                                 f"{clip(header)!r}")])
        wanted = wanted or header
        if wanted:
            convert.check_session_id(wanted)
        key = caller_key(request)
        self._forget_expired(gen)
        per_key = gen.options.max_sessions_per_key
        if key and per_key and sum(k == key for k in self.owners.values()) >= per_key:
            raise Overloaded(f"{per_key} sessions already open with this API key (MAX_SESSIONS_PER_KEY)",
                             retry_after=5.0)
        model = body.get("model") or ""  # a LoRA adapter's name, as a completion's `model` names one
        if not isinstance(model, str):
            raise InvalidRequest([("model", "must be a string")])
        compression = session_kv_compress(body)
        s = gen.new_session(wanted, adapter="" if model in (gen.cfg.name, "kvgen") else model,  # routes.MODEL_ALIAS
                            kv_compress=compression)
        self.owners[s.session_id] = key
        return web.json_response({"object": "session", "session_id": s.session_id,
                                  "ttl_seconds": int(gen.options.session_ttl_s)})

    async def close(self, request: web.Request) -> web.Response:
        """Frees the session; answers once its KV blocks are back in the pool."""
        gen = self.routes.gen  # a draining server still closes sessions, as CloseSession does
        if gen is None:
            raise Unavailable("the model is still loading")
        sid = request.match_info["session_id"]
        convert.check_session_id(sid)
        self.session(gen, sid, caller_key(request))
        self.owners.pop(sid, None)
        loop = asyncio.get_running_loop()
        freed = loop.create_future()
        if not gen.close_session(sid, on_freed=lambda: loop.call_soon_threadsafe(_settle, freed)):
            raise NotFound(f"no session {clip(sid)!r}")  # closed meanwhile
        await freed
        return web.json_response({"object": "session.deleted", "session_id": sid, "deleted": True})

    def session(self, gen: Generator, session_id: str, key: str) -> Session:
        """The caller's open session (one opened with another API key is not found)."""
        session = gen.get_session(session_id)
        if session is None or self.owners.get(session_id, "") != key:
            raise NotFound(f"no session {clip(session_id)!r} (closed or expired)")
        return session

    def turn_of(self, request: web.Request, gen: Generator) -> Session | None:
        """The session a completion call names in its x-session-id header (None without one)."""
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            return None
        bad = convert.session_id_violations(sid, SESSION_HEADER)
        if bad:
            raise InvalidRequest(bad)
        return self.session(gen, sid, caller_key(request))

    def _forget_expired(self, gen: Generator) -> None:
        live = set(gen.sessions)
        for sid in [s for s in self.owners if s not in live]:
            self.owners.pop(sid, None)


def caller_key(request: web.Request) -> str:
    """Who is calling, as the gRPC servicer tells it: a digest of the bearer token ("" without one)."""
    for v in request.headers.getall("Authorization", []):
        if v.startswith("Bearer "):
            return hashlib.sha256(v[7:].encode()).hexdigest()
    return ""


async def _read_body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest([("body", "must be a JSON object")])
    return body


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
