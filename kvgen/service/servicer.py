"""kvgen.v1.Generator over the engine: maps the wire to the engine and back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import nullcontext

import grpc
from opentelemetry import trace

from kvgen.engine.generator import Generator, InferenceSession, Result
from kvgen.engine.sequence import Event
from kvgen.service import convert, tracing
from kvgen.errors import NotFound, Unavailable
from kvgen.service.errors import abort, to_status
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


class GeneratorServicer(pb_grpc.GeneratorServicer):
    def __init__(self):
        self.gen: Generator | None = None  # set once the model is loaded
        self.draining = False
        self.session_locks: dict[str, asyncio.Lock] = {}
        self.tracing: tracing.Tracing | None = None  # set by the server when tracing is on

    def _ready(self) -> Generator:
        if self.draining:
            raise Unavailable("the server is shutting down")
        if self.gen is None:
            raise Unavailable("the model is still loading")
        return self.gen

    async def _events(self, req: pb.GenerateRequest, request_id: str, stream: bool = False,
                      context=None) -> AsyncIterator[Event]:
        """Run one request through the engine, yielding its events; leaving early cancels it.
        The current span (the RPC's, or a batch entry's) gets the GenAI attributes."""
        span = trace.get_current_span()
        if not span.is_recording():
            async for ev in self._request_events(req, request_id):
                yield ev
            return
        model = self.gen.cfg.name if self.gen else ""
        try:
            async for ev in self._request_events(req, request_id, span, stream):
                if ev.finish_reason is not None:
                    tracing.end_request(span, ev, model)
                yield ev
        except asyncio.CancelledError as e:
            left = context.time_remaining() if context else None
            late = left is not None and left <= 0
            tracing.record_error(span, e, code="DEADLINE_EXCEEDED" if late else None)
            raise
        except Exception as e:
            tracing.record_error(span, e)
            raise

    async def _request_events(self, req, request_id: str, span=None, stream=False) -> AsyncIterator[Event]:
        gen = self._ready()
        params = convert.sampling_of(req)
        if span is not None:
            tracing.start_request(span, req, params, gen.cfg.name, request_id, stream, req.session_id)
        prompt = convert.prompt_of(req)
        session = None
        if req.session_id:
            session = gen.get_session(req.session_id)
            if session is None:
                raise NotFound(f"no session {req.session_id!r} (closed or expired)")
        lock = self.session_locks.setdefault(req.session_id, asyncio.Lock()) if session else None
        if lock:
            await lock.acquire()
        try:
            async for ev in self._run(gen, prompt, params, request_id, session):
                yield ev
        finally:
            if lock:
                lock.release()

    async def _run(self, gen: Generator, prompt, params, request_id: str, session: InferenceSession | None):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Event] = asyncio.Queue()
        if session:
            session.lock.acquire()  # only contended by eviction, which never waits
        seq = None
        text = ""
        try:
            ids = session.prepare(prompt) if session else gen.prompt_ids(prompt)
            seq = gen.start(ids, params, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev), request_id, session)
            while True:
                ev = await q.get()
                text += ev.text
                if ev.error is not None:
                    raise ev.error
                yield ev
                if ev.finish_reason is not None:
                    break
        finally:
            if seq is not None and not seq.finished:
                gen.engine.cancel(seq)
            if seq is not None and session is not None:
                await asyncio.shield(loop.run_in_executor(None, seq.done.wait))
            if session:
                session.end_turn(text)
                session.lock.release()

    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            result = await self._collect(request, request_id, context=context)
        except Exception as e:
            await _abort(context, e)
        return convert.response(result, request_id, self.gen.tokenizer)

    async def _collect(self, request, request_id, batched: bool = False, context=None) -> Result:
        result = Result()
        with self.tracing.request_span(batched) if self.tracing else _NO_SPAN:
            async for ev in self._events(request, request_id, context=context):
                result.add(ev)
        return result

    async def GenerateStream(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            async for ev in self._events(request, request_id, stream=True, context=context):
                yield convert.stream_message(ev, request_id, self.gen.tokenizer)
        except Exception as e:
            await _abort(context, e)

    async def BatchGenerate(self, request, context):
        try:
            self._ready()
        except Exception as e:
            await _abort(context, e)
        ids = [r.request_id or uuid.uuid4().hex for r in request.requests]
        # Every request is submitted before any is awaited, so the scheduler batches them.
        outcomes = await asyncio.gather(*(self._collect(r, i, batched=True)
                                          for r, i in zip(request.requests, ids, strict=True)),
                                        return_exceptions=True)
        results = []
        for out, rid in zip(outcomes, ids, strict=True):
            if isinstance(out, BaseException):
                if isinstance(out, asyncio.CancelledError):
                    raise out
                results.append(pb.BatchGenerateResult(error=to_status(out)))
            else:
                results.append(pb.BatchGenerateResult(response=convert.response(out, rid, self.gen.tokenizer)))
        return pb.BatchGenerateResponse(results=results)

    async def GetModelInfo(self, request, context):
        try:
            gen = self._ready()
        except Exception as e:
            await _abort(context, e)
        cfg = gen.cfg
        return pb.GetModelInfoResponse(
            name=cfg.name, architecture=cfg.architecture, context_length=cfg.context_length,
            vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype=gen.pool.fmt.name,
            weight_dtype=gen.model.weight_dtype, has_chat_template=gen.tokenizer.chat_template is not None,
            eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else -1,
            kv_block_size=gen.pool.block_size, kv_blocks_total=gen.pool.capacity, device=str(gen.model.device))

    async def CreateSession(self, request, context):
        try:
            gen = self._ready()
        except Exception as e:
            await _abort(context, e)
        s = gen.new_session()
        return pb.CreateSessionResponse(session_id=s.session_id, ttl_seconds=int(gen.options.session_ttl_s))

    async def CloseSession(self, request, context):
        gen = self.gen
        if gen is None or not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        lock = self.session_locks.pop(request.session_id, None)
        if lock:
            async with lock:
                found = await asyncio.to_thread(gen.close_session, request.session_id)
        else:
            found = await asyncio.to_thread(gen.close_session, request.session_id)
        if not found:
            await _abort(context, NotFound(f"no session {request.session_id!r}"))
        return pb.CloseSessionResponse()

    def expire_sessions(self) -> None:
        if self.gen:
            self.gen.expire_sessions()
            live = set(self.gen.sessions)
            for sid in [s for s in self.session_locks if s not in live]:
                self.session_locks.pop(sid, None)


_NO_SPAN = nullcontext()


async def _abort(context, e: Exception):
    """abort() with the status also on the RPC's span (the interceptor can't see abort_with_status)."""
    span = trace.get_current_span()
    if span.is_recording():
        tracing.record_error(span, e, rpc=True)
    await abort(context, e)
