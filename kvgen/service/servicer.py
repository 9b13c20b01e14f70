"""kvgen.v1.Generator over the engine: maps the wire to the engine and back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import ExitStack, aclosing, nullcontext

import grpc
from opentelemetry import trace

from kvgen.engine.generator import Generator, kernel_path, type_kernels
from kvgen.engine.request import Request
from kvgen.engine.sequence import Event
from kvgen.engine.session import Session
from kvgen.errors import Cancelled, InvalidRequest, NotFound, Overloaded, Unavailable
from kvgen.service import convert, lora_admin, routing, tracing
from kvgen.service.auth import caller_key
from kvgen.service.control import InFlight
from kvgen.service.errors import clip, to_status
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc


class GeneratorServicer(pb_grpc.GeneratorServicer):
    def __init__(self):
        self.gen: Generator | None = None  # set once the model is loaded
        self.draining = False
        self.owners: dict[str, str] = {}  # session id -> the API key that opened it ("" without keys)
        self.settings = None  # the server's Settings: request limits (None: the defaults)
        self.tracing: tracing.Tracing | None = None  # set by the server when tracing is on
        self.inflight = InFlight()  # running requests by id, for Abort
        self.load = None  # the server's load.Load, set once the model is loaded (GetLoad)

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
        key = caller_key(context)
        routing.check_agrees(req.session_id, context)  # the mesh routed this call by its metadata
        if not span.is_recording():
            async with aclosing(self._request_events(req, request_id, key)) as events:
                async for ev in events:
                    yield ev
            return
        try:
            async with aclosing(self._request_events(req, request_id, key, span, stream)) as events:
                async for ev in events:
                    yield ev
        except asyncio.CancelledError as e:
            left = context.time_remaining() if context else None
            late = left is not None and left <= 0
            tracing.record_error(span, e, code="DEADLINE_EXCEEDED" if late else None)
            raise
        except Exception as e:
            tracing.record_error(span, e)
            raise

    async def _request_events(self, req, request_id: str, key: str, span=None, stream=False
                              ) -> AsyncIterator[Event]:
        """The request's events; span (a recording one): given the GenAI attributes, the response
        model being the adapter that answered (vLLM's convention, as the OpenAI API's answer names
        it: a session's adapter for its turns), else the base model."""
        gen = self._ready()
        adapter = req.adapter
        params = convert.sampling_of(req)
        if span is not None:
            tracing.start_request(span, req, params, gen.cfg.name, request_id, stream, req.session_id)
        convert.check_request(req, self.settings)  # the gate did it for a whole call; not for a batch entry
        prompt = convert.prompt_of(req, self.settings)
        if req.session_id:
            if params.n != 1:
                raise InvalidRequest([("sampling.n", "a session turn has one continuation: n must be 1")])
            session = self._session(gen, req.session_id, key)
            if req.adapter and req.adapter != getattr(session.adapter, "name", ""):
                raise InvalidRequest([("adapter", "a session keeps the adapter it was created with "
                                                  "(CreateSessionRequest.adapter)")])
            adapter = getattr(session.adapter, "name", "")
            requests = [await session.request(prompt, params, request_id, kv_compress=convert.kv_compress_of(req))]
        else:
            requests = await gen.requests(prompt, params, request_id, cache_salt=req.cache_salt,
                                          adapter=req.adapter, kv_compress=convert.kv_compress_of(req))
        with ExitStack() as tracked:
            for r in requests:
                tracked.enter_context(self.inflight.track(key, request_id, r))
            async with aclosing(_merged(gen, requests)) as events:  # leaving early cancels every sample
                async for ev in events:
                    if ev.finish_reason is not None and self.inflight.was_aborted(requests[ev.index]):
                        raise Cancelled(f"request {clip(request_id)!r} was ended by an Abort call")
                    if span is not None and ev.finish_reason is not None:
                        tracing.end_request(span, ev, adapter or gen.cfg.name)
                    yield ev

    def _session(self, gen: Generator, session_id: str, key: str) -> Session:
        """The caller's open session (a session opened with another API key is not found)."""
        session = gen.get_session(session_id)
        if session is None or self.owners.get(session_id, "") != key:
            raise NotFound(f"no session {clip(session_id)!r} (closed or expired)")
        return session

    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            result = await self._collect(request, request_id, context=context)
        except Exception as e:
            await tracing.abort_rpc(context, e)
        return convert.response(result, request_id, self.gen.tokenizer)

    async def _collect(self, request, request_id, batched: bool = False, context=None) -> list[Event]:
        """The request's samples (one unless sampling.n > 1), each its events added up, by index."""
        results: dict[int, Event] = {}
        with self.tracing.request_span(batched) if self.tracing else _NO_SPAN:
            async with aclosing(self._events(request, request_id, context=context)) as events:
                async for ev in events:
                    results.setdefault(ev.index, Event()).add(ev)
        return [results[i] for i in sorted(results)]

    async def GenerateStream(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            async with aclosing(self._events(request, request_id, stream=True, context=context)) as events:
                async for ev in events:
                    yield convert.stream_message(ev, request_id, self.gen.tokenizer)
        except Exception as e:
            await tracing.abort_rpc(context, e)

    async def BatchGenerate(self, request, context):
        try:
            self._ready()
        except Exception as e:
            await tracing.abort_rpc(context, e)
        ids = [r.request_id or uuid.uuid4().hex for r in request.requests]
        # Every request is submitted before any is awaited, so the scheduler batches them.
        outcomes = await asyncio.gather(*(self._collect(r, i, batched=True, context=context)
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

    async def BatchGenerateStream(self, request, context):
        try:
            self._ready()
        except Exception as e:
            await tracing.abort_rpc(context, e)
        ids = [r.request_id or uuid.uuid4().hex for r in request.requests]
        # Each entry runs in a task of its own, all started before any is read, so the scheduler
        # batches them; leaving (the call cancelled, its deadline past) cancels every entry.
        entries = [self._entry_stream(r, i, context) for r, i in zip(request.requests, ids, strict=True)]
        async with aclosing(_interleaved(entries)) as items:
            async for index, item in items:
                yield convert.batch_stream_message(index, item)

    async def _entry_stream(self, request, request_id, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        """One BatchGenerateStream entry's GenerateStream messages, under a request span of its own."""
        with self.tracing.request_span(True) if self.tracing else _NO_SPAN:
            async with aclosing(self._events(request, request_id, stream=True, context=context)) as events:
                async for ev in events:
                    yield convert.stream_message(ev, request_id, self.gen.tokenizer)

    async def GetModelInfo(self, request, context):
        try:
            gen = self._ready()
        except Exception as e:
            await tracing.abort_rpc(context, e)
        cfg = gen.cfg
        runner, model = gen.engine.runner, gen.model
        layout = dict(layer_windows=[layer.window or runner.window for layer in model.layers],
                      attention_logit_softcap=cfg.attn_logit_softcap or 0.0,
                      final_logit_softcap=cfg.final_logit_softcap or 0.0, decode_path=runner.decode_path,
                      decode_path_reason=runner.decode_path_reason,
                      attention_layout="state" if getattr(model, "recurrent", False) else "attention")
        opts = gen.options
        compression = dict(kv_compress=opts.kv_compress, kv_compress_window=opts.kv_compress_window,
                           kv_compress_ratio=opts.kv_compress_ratio,
                           kv_compress_unsupported=gen.kv_compress_unsupported)
        memory = await asyncio.to_thread(gen.weight_memory)
        return pb.GetModelInfoResponse(
            name=cfg.name, architecture=cfg.architecture, context_length=cfg.context_length,
            vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype=gen.pool.fmt.name,
            weight_dtype=gen.model.weight_dtype, has_chat_template=gen.tokenizer.renders_chats,
            eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id if cfg.bos_token_id is not None else -1,
            kv_block_size=gen.pool.block_size, kv_blocks_total=gen.pool.capacity, device=str(gen.model.device),
            prefix_cache=gen.scheduler.kv.prefix is not None, cpu_kernels=kernel_path(gen.model),
            tensor_types=cfg.tensor_types, type_kernels=type_kernels(gen.model), weight_bytes=gen.model.weight_bytes(),
            file_bytes=cfg.file_bytes, mapped_bytes=memory.mapped_bytes,
            mapped_resident_bytes=memory.mapped_resident_bytes, resident_bytes=memory.resident_bytes,
            adapters=convert.lora_adapters(gen), **layout, **compression)

    async def CreateSession(self, request, context):
        try:
            gen = self._ready()
            key = caller_key(context)
            per_key = gen.options.max_sessions_per_key
            if key and per_key and sum(k == key for k in self.owners.values()) >= per_key:
                raise Overloaded(f"{per_key} sessions already open with this API key (MAX_SESSIONS_PER_KEY)",
                                 retry_after=5.0)
            s = gen.new_session(routing.new_session_id(request.session_id, context), adapter=request.adapter,
                                kv_compress=convert.kv_compress_of(request))
        except Exception as e:
            await tracing.abort_rpc(context, e)
        self.owners[s.session_id] = key
        return pb.CreateSessionResponse(session_id=s.session_id, ttl_seconds=int(gen.options.session_ttl_s))

    async def CloseSession(self, request, context):
        try:
            gen = self._ready_or_draining()
            bad = convert.session_id_violations(request.session_id)
            if bad:
                raise InvalidRequest(bad)
            self._session(gen, request.session_id, caller_key(context))
            self.owners.pop(request.session_id, None)
            loop = asyncio.get_running_loop()
            freed = loop.create_future()
            if not gen.close_session(request.session_id,
                                     on_freed=lambda: loop.call_soon_threadsafe(_settle, freed)):
                raise NotFound(f"no session {clip(request.session_id)!r}")  # closed meanwhile
            await freed  # the reply says the blocks are back in the pool
        except Exception as e:
            await tracing.abort_rpc(context, e)
        return pb.CloseSessionResponse()

    async def Abort(self, request, context):
        try:
            self._ready_or_draining()  # a draining server may still be asked to end its streams
            aborted, unknown = await self.inflight.abort(caller_key(context), list(request.request_ids))
        except Exception as e:
            await tracing.abort_rpc(context, e)
        return pb.AbortResponse(aborted=aborted, unknown=unknown)

    async def GetLoad(self, request, context):
        try:
            self._ready_or_draining()  # a router asks a draining server too: `accepting` tells it
        except Exception as e:
            await tracing.abort_rpc(context, e)
        out = self.load.snapshot(accepting=not self.draining)
        out.adapters.extend(convert.lora_adapters(self.gen))
        return out

    async def LoadAdapter(self, request, context):
        """A LoRA adapter loaded at run time (service/lora_admin.py: admin-only, statuses)."""
        gen = await self._admin(context)
        out = await lora_admin.load(gen, request.name, request.path)
        if out.adapter is None:
            await context.abort(out.code, out.message)
        a = out.adapter
        return pb.LoadAdapterResponse(adapter=pb.LoraAdapter(name=a.name, rank=a.rank, target_modules=a.targets))

    async def UnloadAdapter(self, request, context):
        """Unload once the requests running with it finish, or FAILED_PRECONDITION after the timeout."""
        gen = await self._admin(context)
        out = await lora_admin.unload(gen, request.name, request.timeout_seconds)
        if out.adapter is None:
            await context.abort(out.code, out.message)
        return pb.UnloadAdapterResponse()

    async def _admin(self, context) -> Generator:
        try:
            gen = self._ready()
        except Exception as e:
            await tracing.abort_rpc(context, e)
        if not lora_admin.is_admin(self.settings, context.invocation_metadata()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, lora_admin.NOT_ADMIN)
        return gen

    def _ready_or_draining(self) -> Generator:
        if self.gen is None:
            raise Unavailable("the model is still loading")
        return self.gen

    def expire_sessions(self) -> None:
        if self.gen:
            self.gen.expire_sessions()
            live = set(self.gen.sessions)
            for sid in [s for s in self.owners if s not in live]:
                self.owners.pop(sid, None)


async def _merged(gen: Generator, requests: list[Request]) -> AsyncIterator[Event]:
    """The samples' events as they come (each tagged by its index); leaving early, or one
    sample failing, cancels them all."""
    if len(requests) == 1:
        async with aclosing(gen.events(_given(requests[0]))) as events:
            async for ev in events:
                yield ev
        return
    async with aclosing(_interleaved([gen.events(_given(r)) for r in requests])) as items:
        async for _, item in items:
            if isinstance(item, Exception):
                raise item
            yield item


async def _interleaved(sources: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """The items of several async iterators as they come, as (source's position, item); a source
    that raises gives (position, its exception) and ends, the others go on. Leaving early cancels
    every source. The queue is small: a slow reader holds the sources back, so each request's own
    buffer (STREAM_BUFFER) fills and ends it, rather than this one growing without bound."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=max(len(sources), 1))
    done = object()

    async def pump(i: int, source: AsyncIterator) -> None:
        try:
            async with aclosing(source) as items:
                async for item in items:
                    await queue.put((i, item))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(pumps)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            else:
                yield i, item
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _given(request: Request) -> Request:
    """An already submitted request, as the awaitable Generator.events takes."""
    return request


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


_NO_SPAN = nullcontext()
