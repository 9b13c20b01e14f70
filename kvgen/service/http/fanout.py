"""A call's choices on the engine: each prompt tokenized once, its n choices submitted together
(choice i runs with the call's seed + i), and their events merged into one stream tagged by
choice. Whoever stops reading early (a client that went away) cancels every choice.

n > 1 first prefills the prompt alone (one token, greedy), so that the prefix cache holds its
full blocks and the n choices share them instead of each computing the prompt again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from kvgen.engine.generator import Generator
from kvgen.engine.request import Request
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.sequence import Event
from kvgen.engine.session import Session
from kvgen.service import convert
from kvgen.service.http.params import Call
from kvgen.service.settings import Settings

QUEUE_PER_CHOICE = 16  # events in flight per choice before its pump waits (then its Request buffers)


@dataclass
class Choice:
    index: int  # OpenAI's choice index: prompt * n + i
    prompt: int  # which of the call's prompts
    prompt_ids: list[int]
    request: Request


def params_of(call: Call, prompt: int = 0) -> SamplingParams:
    return convert.sampling_of(call.requests[prompt])


async def submit(gen: Generator, call: Call, request_id: str, settings: Settings) -> list[Choice]:
    """Every choice of the call, submitted; if any is refused, those already in are cancelled."""
    choices: list[Choice] = []
    try:
        for p, req in enumerate(call.requests):
            ids = await gen.prompt_ids(convert.prompt_of(req, settings))
            params = params_of(call, p)
            if not req.sampling.HasField("max_new_tokens"):  # chat's default: never past the context
                params.max_new_tokens = max(1, min(params.max_new_tokens, gen.cfg.context_length - len(ids)))
            await gen.compile(params)  # a new schema compiles off the event loop
            if call.n > 1:
                await _share_prompt(gen, ids, params, req.cache_salt, req.adapter)
            for i in range(call.n):
                seed = None if params.seed is None else (params.seed + i) % 2**64
                index = p * call.n + i
                r = gen.submit(ids, replace(params, seed=seed), f"{request_id}-{index}", cache_salt=req.cache_salt,
                               adapter=req.adapter, kv_compress=convert.kv_compress_of(req))
                choices.append(Choice(index, p, ids, r))
    except BaseException:
        for c in choices:
            c.request.cancel()
        raise
    return choices


async def submit_turn(session: Session, call: Call, request_id: str, settings: Settings) -> list[Choice]:
    """The call as the next turn of session (one prompt, one choice), as a gRPC call in it runs:
    messages join the conversation, a prompt or token ids continue its token history."""
    req = call.requests[0]
    r = await session.request(convert.prompt_of(req, settings), params_of(call), f"{request_id}-0",
                              kv_compress=convert.kv_compress_of(req))
    return [Choice(0, 0, list(req.prompt_token_ids), r)]


async def _share_prompt(gen: Generator, ids: list[int], params: SamplingParams, salt: str, adapter: str = "") -> None:
    """Prefill the prompt once, so its full blocks are in the prefix cache for the n choices."""
    kv = gen.scheduler.kv
    if kv.prefix is None or params.prompt_logprobs is not None or (len(ids) - 1) < gen.pool.block_size:
        return  # nothing to share: no cache, the request bypasses it, or no full block to reuse
    warm = gen.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=1), cache_salt=salt, adapter=adapter)
    try:
        await warm.result()
        await warm.released()  # indexed once released
    finally:
        warm.cancel()


async def events(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Event]]:
    """Every choice's events as they come. Leaving early cancels every choice."""
    if len(choices) == 1:  # the common case needs no tasks
        c = choices[0]
        try:
            async for ev in c.request:
                yield c, ev
        finally:
            c.request.cancel()
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_PER_CHOICE * len(choices))

    async def pump(c: Choice) -> None:
        try:
            async for ev in c.request:
                await queue.put((c, ev, None))
        except Exception as e:
            await queue.put((c, None, e))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            c, ev, error = await queue.get()
            if error is not None:
                raise error
            yield c, ev
            left -= ev.finish_reason is not None
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:
            c.request.cancel()


async def results(choices: list[Choice]) -> list[Event]:
    """Each choice's events added up, in choice order."""
    out = [Event() for _ in choices]
    async with aclosing(events(choices)) as evs:
        async for c, ev in evs:
            out[c.index].add(ev)
    return out
