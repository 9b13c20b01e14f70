"""The blocking Client against a real kvgen server (tiny model, loopback): typed results, chat,
batch, sessions, and each error class with its google.rpc details."""

from __future__ import annotations

import time

import grpc
import pytest

from kvgen.client import (
    BatchStreamDelta,
    Cancelled,
    Client,
    Completion,
    DeadlineExceeded,
    FieldViolation,
    FinishReason,
    InvalidArgument,
    KvgenError,
    ModelInfo,
    NotFound,
    StreamDelta,
    Unauthenticated,
    Usage,
    request,
)
from tests.client.conftest import KEY, REPLICA

GREEDY = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def client(tiny_kvgen):
    with Client(tiny_kvgen.target, api_key=KEY, timeout=60) as c:
        yield c


def test_generate_gives_a_typed_completion(client):
    done = client.generate("Once upon a time", request_id="req-1", logprobs=2, **GREEDY)
    assert isinstance(done, Completion) and done.request_id == "req-1" and done.replica == REPLICA
    assert isinstance(done.token_ids, tuple) and len(done.token_ids) == 6 and isinstance(done.text, str)
    assert done.finish_reason is FinishReason.LENGTH and done.finish_reason == 3  # the proto's number
    assert isinstance(done.usage, Usage) and done.usage.completion_tokens == 6 and done.usage.prompt_tokens > 0
    assert len(done.logprobs) == 6 and all(len(lp.top) == 2 for lp in done.logprobs)
    assert done.timings.total_ms > 0 and done.raw.text == done.text
    with pytest.raises(AttributeError):  # frozen
        done.text = "x"


def test_a_stream_gives_typed_deltas_that_add_up_to_the_completion(client):
    whole = client.generate("Once upon a time", **GREEDY)
    with client.stream("Once upon a time", **GREEDY) as stream:
        deltas = list(stream)
        assert stream.replica == REPLICA
    assert all(isinstance(d, StreamDelta) for d in deltas)
    assert tuple(t for d in deltas for t in d.token_ids) == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert [bool(d.finish_reason) for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[0].usage is None and deltas[-1].usage.completion_tokens == 6
    again = client.stream("Once upon a time", **GREEDY).collect()
    assert (again.text, again.token_ids, again.finish_reason) == (whole.text, whole.token_ids, whole.finish_reason)
    assert again.replica == REPLICA


def test_chat_takes_messages_in_three_shapes(client):
    class Msg:
        role, content = "user", "Hi!"

    outs = [client.chat(m, **GREEDY).token_ids for m in
            ([{"role": "user", "content": "Hi!"}], [("user", "Hi!")], [Msg()])]
    assert outs[0] == outs[1] == outs[2]
    assert client.generate("Hi!", **GREEDY).token_ids != outs[0]  # the template was applied
    with pytest.raises(ValueError):
        client.chat("Hi!")


def test_batch_gives_one_result_or_error_per_request(client):
    out = client.batch(["one", [("user", "two")], request("three", max_new_tokens=2), [5, 6, 7]],
                       max_new_tokens=3, temperature=0.0)
    assert [type(x) for x in out] == [Completion] * 4
    assert [x.usage.completion_tokens <= 3 for x in out] == [True] * 4
    out = client.batch(["fine", "bad"], top_p=2.0)
    assert all(isinstance(x, InvalidArgument) for x in out)
    assert FieldViolation("sampling.top_p", out[0].field_violations[0].description) in out[0].field_violations
    out = client.batch([request("fine", max_new_tokens=1), request("bad", temperature=-1.0)])
    assert isinstance(out[0], Completion) and isinstance(out[1], InvalidArgument)
    assert out[1].code() == grpc.StatusCode.INVALID_ARGUMENT and out[1].field_violations[0].field == \
        "sampling.temperature"


def test_batch_stream_tags_each_delta_by_entry_and_fails_one_alone(client, tiny_kvgen):
    prompts = ["one", request("bad", top_p=2.0), [("user", "two")]]
    with client.batch_stream(prompts, **GREEDY) as stream:
        items = list(stream)
        assert stream.replica == REPLICA
    assert all(isinstance(x, BatchStreamDelta) for x in items) and {x.index for x in items} == {0, 1, 2}
    [bad] = [x for x in items if x.index == 1]
    assert bad.delta is None and isinstance(bad.error, InvalidArgument)
    assert bad.error.field_violations[0].field == "sampling.top_p"
    for i, alone in ((0, client.generate("one", **GREEDY)), (2, client.chat([("user", "two")], **GREEDY))):
        deltas = [x.delta for x in items if x.index == i]
        assert all(isinstance(d, StreamDelta) for d in deltas) and len(deltas) > 1
        assert tuple(t for d in deltas for t in d.token_ids) == alone.token_ids
        assert deltas[-1].finish_reason is FinishReason.LENGTH and deltas[-1].usage.completion_tokens == 6
    whole = client.batch_stream(prompts, **GREEDY).collect()
    assert [type(x) for x in whole] == [Completion, InvalidArgument, Completion]
    assert whole[0].token_ids == client.batch(prompts, **GREEDY)[0].token_ids and whole[0].replica == REPLICA
    # cancelling the call ends every entry: the server's engine is left with nothing
    stream = client.batch_stream(["long", "longer"], max_new_tokens=1800, ignore_eos=True)
    assert next(stream).delta.token_ids
    stream.cancel()
    with pytest.raises(Cancelled):
        list(stream)
    deadline = time.monotonic() + 10
    while not (tiny_kvgen.gen.engine.idle and tiny_kvgen.gen.scheduler.kv.used == 0):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_session_is_opened_with_what_its_turns_run_with(client, tiny_kvgen):
    with client.session("client-compressed", kv_compress="sink-heavy", kv_compress_window=64) as s:
        assert tiny_kvgen.gen.sessions[s.id].cache.compressor.key[0] == "sink-heavy"
        assert len(s.generate("Once upon a time", **GREEDY).token_ids) == 6  # a turn naming nothing: the session's
        with pytest.raises(InvalidArgument) as e:  # a turn may only name the session's own
            s.generate("Once upon a time", kv_compress="mean", **GREEDY)
        assert [v.field for v in e.value.field_violations] == ["kv_compress"]
    with pytest.raises(InvalidArgument):  # the options travel: an unknown method is refused at create
        client.create_session(kv_compress="zip")
    with pytest.raises(NotFound, match="no-such-adapter"):
        client.open_session(adapter="no-such-adapter")


def test_a_session_keeps_its_conversation(client, tiny_kvgen):
    with client.session("client-chat-1") as s:
        assert s.id == "client-chat-1" and s.info.ttl_seconds > 0
        assert "client-chat-1" in tiny_kvgen.gen.sessions
        first = s.chat([{"role": "user", "content": "Hello there"}], **GREEDY)
        second = s.chat([{"role": "user", "content": "And then?"}], **GREEDY)
        # (a first turn may already reuse blocks other requests left in the prefix cache)
        assert second.usage.cached_tokens > first.usage.cached_tokens
        streamed = list(s.stream(" more", **GREEDY))
        assert streamed[-1].usage.cached_tokens > second.usage.cached_tokens
    assert "client-chat-1" not in tiny_kvgen.gen.sessions
    sid = client.create_session()  # a fresh id, chosen by the client
    assert len(sid) == 32
    client.close_session(sid)
    with pytest.raises(NotFound) as e:
        client.generate("x", session_id=sid, max_new_tokens=1)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_errors_carry_their_details(client, tiny_kvgen):
    with pytest.raises(InvalidArgument) as e:
        client.generate("x", top_p=2.0)
    assert [v.field for v in e.value.field_violations] == ["sampling.top_p"] and e.value.status is not None
    assert isinstance(e.value, grpc.RpcError) and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in e.value.details() and e.value.trailing_metadata()
    with pytest.raises(InvalidArgument):  # a stream's error comes with its first read
        next(client.stream("x", max_new_tokens=0))
    with Client(tiny_kvgen.target) as anonymous, pytest.raises(Unauthenticated) as e:
        anonymous.model_info()
    assert isinstance(e.value, KvgenError)


def test_a_deadline_and_a_cancel_end_calls(client):
    t = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        client.generate("long", max_new_tokens=1800, ignore_eos=True, timeout=0.2)
    assert time.monotonic() - t < 5
    stream = client.stream("long", max_new_tokens=1800, ignore_eos=True)
    assert next(stream).token_ids
    stream.cancel()
    with pytest.raises(Cancelled):
        for _ in stream:
            pass


def test_model_info_health_load_and_abort(client, tiny_kvgen):
    info = client.model_info()
    assert isinstance(info, ModelInfo) and info.vocab_size == 300 and info.has_chat_template
    assert info.num_layers == 2 and isinstance(info.eos_token_ids, tuple)
    assert client.health() == "SERVING" and client.health("kvgen.v1.Generator") == "SERVING"
    load = client.load()
    assert load.replica == REPLICA and load.accepting and load.kv_blocks_total > 0
    out = client.abort(["nothing-runs"])
    assert out.aborted == () and out.unknown == ("nothing-runs",)
