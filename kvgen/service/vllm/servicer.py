"""vllm.grpc.engine.VllmEngine over kvgen's engine. Generate is kvgen.v1's Generate under another
wire (sampling.py maps the request, the kvgen.v1 servicer runs it: the same checks, limits, Abort
and traces); the rest reads the engine. Embed, FlushCache and the profiler stay UNIMPLEMENTED
(the generated base class's answer)."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from datetime import UTC, datetime

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from kvgen.engine.kv.events import PrefixEventLog
from kvgen.engine.sequence import Event, FinishReason
from kvgen.service import control, tracing
from kvgen.service.auth import caller_key
from kvgen.service.servicer import GeneratorServicer
from kvgen.service.vllm import kv_events, tokenizer
from kvgen.service.vllm.sampling import to_kvgen

SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_SOURCE = "kvgen:GetTokenizer"  # GetModelInfo.tokenizer_path of an engine built from no file
FINISH = {FinishReason.STOP_TOKEN: "stop", FinishReason.STOP_STRING: "stop", FinishReason.LENGTH: "length",
          FinishReason.CANCELLED: "abort", FinishReason.ABORTED: "abort"}


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, core: GeneratorServicer):
        """core: the server's kvgen.v1 servicer, whose engine, state and request path this shares."""
        self.core = core
        self.kv_log: PrefixEventLog | None = None  # set by bind() where the engine has a prefix cache
        self._bundle: asyncio.Task | None = None
        self._started = time.time()
        self._last_request = 0.0

    def bind(self, gen) -> None:
        """The engine is loaded: listen to its prefix cache."""
        prefix = gen.scheduler.kv.prefix
        if prefix is not None:
            self.kv_log = PrefixEventLog()
            prefix.listeners.append(self.kv_log)

    async def _engine(self, context):
        """The served engine (draining too), or the call aborted with the status why not."""
        try:
            return self.core._ready_or_draining()
        except Exception as e:
            await tracing.abort_rpc(context, e)

    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        self._last_request = time.time()
        try:
            gen = self.core._ready()
            req = to_kvgen(request, gen.cfg.eos_token_ids)
            eos = set(gen.cfg.eos_token_ids)
            totals: dict[int, Event] = {}
            async with aclosing(self.core._events(req, request_id, stream=request.stream, context=context)) as events:
                async for ev in events:
                    if request.stream:  # deltas, then the ending (its last delta again, as vLLM's servicer)
                        yield vllm_engine_pb2.GenerateResponse(chunk=_chunk(ev))
                        if ev.finish_reason is not None:
                            yield vllm_engine_pb2.GenerateResponse(complete=_complete(ev, eos))
                        continue
                    total = totals.setdefault(ev.index, Event())
                    total.add(ev)
                    if ev.finish_reason is not None:
                        yield vllm_engine_pb2.GenerateResponse(complete=_complete(total, eos))
        except Exception as e:
            await tracing.abort_rpc(context, e)

    async def Abort(self, request, context):
        ids = list(request.request_ids)
        try:
            self.core._ready_or_draining()
            if ids:
                control.check_abort(request)
                await self.core.inflight.abort(caller_key(context), ids)
        except Exception as e:
            await tracing.abort_rpc(context, e)
        return vllm_engine_pb2.AbortResponse()

    async def HealthCheck(self, request, context):
        if self.core.gen is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the model is still loading")
        if self.core.draining:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the server is shutting down")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context):
        gen = await self._engine(context)
        cfg = gen.cfg
        bos = cfg.bos_token_id if cfg.bos_token_id is not None else -1
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=gen.model_path, is_generation=True, max_context_length=cfg.context_length,
            vocab_size=cfg.vocab_size, supports_vision=False, served_model_name=cfg.name,
            # smg loads a tokenizer from here when it can, else from GetTokenizer: it needs a source
            # named either way, and reads no GGUF, so the engine's own tokenizer is what it gets
            tokenizer_path=gen.model_path or TOKENIZER_SOURCE,
            model_type=cfg.architecture, architectures=tokenizer.architectures(cfg),
            eos_token_ids=cfg.eos_token_ids, pad_token_id=-1, bos_token_id=bos,
            max_req_input_len=cfg.context_length)

    async def GetServerInfo(self, request, context):
        gen = await self._engine(context)
        sched = gen.scheduler
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(sched.running) + len(sched.waiting), is_paused=self.core.draining,
            last_receive_timestamp=self._last_request, uptime_seconds=time.time() - self._started,
            server_type="kvgen", data_parallel_size=1, kv_cache_dtype=gen.pool.fmt.name,
            block_size=gen.pool.block_size, model_dtype=gen.model.weight_dtype, max_num_seqs=sched.max_running)

    async def GetLoads(self, request, context):
        gen = await self._engine(context)
        sched, pool, load = gen.scheduler, gen.pool, self.core.load
        kv, bs = sched.kv, pool.block_size
        hit_rate = 0.0
        if kv.prefix is not None:
            s = kv.prefix.stats
            hit_rate = s.hits / (s.hits + s.misses) if s.hits + s.misses else 0.0
        running, waiting = len(sched.running), len(sched.waiting)
        entry = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
            num_used_tokens=kv.used * bs, max_total_num_tokens=pool.capacity * bs,
            token_usage=kv.used / pool.capacity, gen_throughput=load.tokens_per_second() if load else 0.0,
            cache_hit_rate=hit_rate, utilization=load.utilization() if load else 0.0,
            max_running_requests=sched.max_running,
            num_waiting_uncached_tokens=sum(len(seq.prompt_ids) for seq in list(sched.waiting)))
        return vllm_engine_pb2.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version="kvgen",
                                                dp_rank_count=1, loads=[entry])

    async def GetTokenizer(self, request, context):
        try:
            gen = self.core._ready_or_draining()
            if self._bundle is None:  # built once, off the event loop; later callers share it
                self._bundle = asyncio.ensure_future(asyncio.to_thread(tokenizer.bundle, gen))
            data, sha256 = await asyncio.shield(self._bundle)
        except Exception as e:
            self._bundle = None
            await tracing.abort_rpc(context, e)
        for chunk, digest in tokenizer.chunks(data, sha256):
            yield common_pb2.GetTokenizerChunk(data=chunk, sha256=digest)

    async def SubscribeKvEvents(self, request, context):
        gen = await self._engine(context)
        if self.kv_log is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "no prefix cache on this server (PREFIX_CACHE=0, or a sliding window): no KV events")
        async with aclosing(kv_events.stream(self.kv_log, gen.pool.block_size, request.start_sequence_number)) as s:
            async for batch in s:
                yield batch


def _chunk(ev: Event) -> vllm_engine_pb2.GenerateStreamChunk:
    out = vllm_engine_pb2.GenerateStreamChunk(token_ids=ev.token_ids, completion_tokens=len(ev.token_ids),
                                              index=ev.index)
    if ev.usage:
        out.prompt_tokens, out.cached_tokens = ev.usage.prompt_tokens, ev.usage.cached_tokens
    if ev.logprobs:
        out.output_logprobs.CopyFrom(_output_logprobs(ev))
    if ev.prompt_logprobs:
        out.input_logprobs.CopyFrom(_input_logprobs(ev))
    return out


def _complete(ev: Event, eos: set[int]) -> vllm_engine_pb2.GenerateComplete:
    out = vllm_engine_pb2.GenerateComplete(output_ids=ev.token_ids, finish_reason=FINISH.get(ev.finish_reason, "stop"),
                                           index=ev.index)
    if ev.usage:
        out.prompt_tokens, out.cached_tokens = ev.usage.prompt_tokens, ev.usage.cached_tokens
        out.completion_tokens = ev.usage.completion_tokens
    if ev.finish_reason == FinishReason.STOP_STRING:
        out.matched_stop_str = ev.matched_stop
    elif ev.finish_reason == FinishReason.STOP_TOKEN and ev.token_ids and ev.token_ids[-1] not in eos:
        out.matched_token_id = ev.token_ids[-1]  # one of the request's stop_token_ids (vLLM: EOS is no match)
    if ev.logprobs:
        out.output_logprobs.CopyFrom(_output_logprobs(ev))
    if ev.prompt_logprobs:
        out.input_logprobs.CopyFrom(_input_logprobs(ev))
    return out


def _output_logprobs(ev: Event) -> vllm_engine_pb2.OutputLogProbs:
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[s.logprob or 0.0 for s in ev.logprobs], token_ids=[s.token_id for s in ev.logprobs],
        top_logprobs=[_top(s) for s in ev.logprobs])


def _input_logprobs(ev: Event) -> vllm_engine_pb2.InputLogProbs:
    first = [vllm_engine_pb2.InputTokenLogProb()]  # the prompt's first token has none
    return vllm_engine_pb2.InputLogProbs(
        token_logprobs=first + [vllm_engine_pb2.InputTokenLogProb(value=s.logprob or 0.0)
                                for s in ev.prompt_logprobs[1:]],
        token_ids=[s.token_id for s in ev.prompt_logprobs], top_logprobs=[_top(s) for s in ev.prompt_logprobs])


def _top(s) -> vllm_engine_pb2.TopLogProbs:
    top = s.top or []
    return vllm_engine_pb2.TopLogProbs(values=[lp for _, lp in top], token_ids=[t for t, _ in top])
