"""AsyncClient (grpc.aio) against a real kvgen server: the same methods, results and errors as
the blocking Client, and the same tokens."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvgen.client import (
    AsyncClient,
    Cancelled,
    Client,
    Completion,
    DeadlineExceeded,
    FinishReason,
    InvalidArgument,
    NotFound,
    StreamDelta,
    Unauthenticated,
    request,
)
from tests.client.conftest import KEY, REPLICA

GREEDY = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def run(tiny_kvgen, body, **kw):
    """body(client) run on a fresh event loop with an AsyncClient made inside it."""
    async def main():
        async with AsyncClient(tiny_kvgen.target, api_key=KEY, timeout=60, **kw) as c:
            return await body(c)

    return asyncio.run(main())


def test_generate_stream_and_chat_match_the_blocking_client(tiny_kvgen):
    async def body(c):
        done = await c.generate("Once upon a time", **GREEDY)
        deltas = [d async for d in c.stream("Once upon a time", **GREEDY)]
        collected = await c.stream("Once upon a time", **GREEDY).collect()
        chat = await c.chat([{"role": "user", "content": "Hi!"}], **GREEDY)
        return done, deltas, collected, chat

    done, deltas, collected, chat = run(tiny_kvgen, body)
    with Client(tiny_kvgen.target, api_key=KEY) as sync:
        assert done.token_ids == sync.generate("Once upon a time", **GREEDY).token_ids
        assert chat.token_ids == sync.chat([("user", "Hi!")], **GREEDY).token_ids
    assert isinstance(done, Completion) and done.finish_reason is FinishReason.LENGTH and done.replica == REPLICA
    assert all(isinstance(d, StreamDelta) for d in deltas) and deltas[-1].usage.completion_tokens == 6
    assert tuple(t for d in deltas for t in d.token_ids) == done.token_ids == collected.token_ids
    assert collected.replica == REPLICA


def test_batch_session_and_info(tiny_kvgen):
    async def body(c):
        batch = await c.batch(["one", request("two", top_k=-1)], max_new_tokens=2)
        async with c.session("aio-chat-1") as s:
            opened = "aio-chat-1" in tiny_kvgen.gen.sessions
            first = await s.chat([{"role": "user", "content": "Hello there"}], **GREEDY)
            second = await s.chat([{"role": "user", "content": "And then?"}], **GREEDY)
            streamed = [d async for d in s.stream(" more", **GREEDY)]
        closed = "aio-chat-1" not in tiny_kvgen.gen.sessions
        other = await c.session()  # awaited: opened under a fresh id, closed by hand
        await other.close()
        return (batch, opened, closed, first, second, streamed, other.id, await c.model_info(), await c.health(),
                await c.load(), await c.abort(["none"]))

    batch, opened, closed, first, second, streamed, other, info, health, load, aborted = run(tiny_kvgen, body)
    assert isinstance(batch[0], Completion) and isinstance(batch[1], InvalidArgument)
    assert batch[1].field_violations[0].field == "sampling.top_k"
    assert opened and closed and len(other) == 32
    # (a first turn may already reuse blocks other requests left in the prefix cache)
    assert first.usage.cached_tokens < second.usage.cached_tokens < streamed[-1].usage.cached_tokens
    assert info.vocab_size == 300 and health == "SERVING" and load.replica == REPLICA
    assert aborted.unknown == ("none",)


def test_batch_stream_matches_the_blocking_client(tiny_kvgen):
    prompts = ["one", request("bad", max_new_tokens=0), [("user", "two")]]

    async def body(c):
        items = [x async for x in c.batch_stream(prompts, **GREEDY)]
        whole = await c.batch_stream(prompts, **GREEDY).collect()
        stream = c.batch_stream(["long", "longer"], max_new_tokens=1800, ignore_eos=True)
        first = await stream.__anext__()
        stream.cancel()
        try:
            await stream.__anext__()
        except Cancelled:
            return items, whole, first
        raise AssertionError("a cancelled batch stream went on")

    items, whole, first = run(tiny_kvgen, body)
    with Client(tiny_kvgen.target, api_key=KEY) as sync:
        want = [sync.generate("one", **GREEDY), sync.chat([("user", "two")], **GREEDY)]
    assert [type(x) for x in whole] == [Completion, InvalidArgument, Completion]
    assert [x.token_ids for x in whole[::2]] == [x.token_ids for x in want] and len(want[0].token_ids) == 6
    assert whole[1].field_violations[0].field == "sampling.max_new_tokens" and whole[0].replica == REPLICA
    for i in (0, 2):
        assert tuple(t for x in items if x.index == i for t in x.delta.token_ids) == whole[i].token_ids
    assert first.delta.token_ids


def test_errors_deadlines_and_cancel(tiny_kvgen):
    async def body(c):
        got = {}
        for name, call in {
            "invalid": c.generate("x", top_p=2.0),
            "not_found": c.generate("x", session_id="never-opened", max_new_tokens=1),
            "deadline": c.generate("long", max_new_tokens=1800, ignore_eos=True, timeout=0.2),
        }.items():
            try:
                await call
            except grpc.RpcError as e:
                got[name] = e
        stream = c.stream("long", max_new_tokens=1800, ignore_eos=True)
        first = await stream.__anext__()
        stream.cancel()
        try:
            async for _ in stream:
                pass
        except Cancelled as e:
            got["cancelled"] = e
        try:
            async with AsyncClient(tiny_kvgen.target) as anonymous:
                await anonymous.health()  # the health service needs no key
                await anonymous.model_info()
        except Unauthenticated as e:
            got["unauthenticated"] = e
        return got, first

    got, first = run(tiny_kvgen, body)
    assert first.token_ids
    assert isinstance(got["invalid"], InvalidArgument) and got["invalid"].field_violations[0].field == "sampling.top_p"
    assert isinstance(got["not_found"], NotFound) and isinstance(got["deadline"], DeadlineExceeded)
    assert got["cancelled"].code() == grpc.StatusCode.CANCELLED
    assert got["unauthenticated"].code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_task_cancelled_while_reading_is_not_swallowed(tiny_kvgen):
    async def body(c):
        async def read():
            async for _ in c.stream("long", max_new_tokens=1800, ignore_eos=True):
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if (await c.load()).running_requests == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    assert run(tiny_kvgen, body)  # the call ended with the task: the server stopped generating
