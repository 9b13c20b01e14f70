"""Sessions over HTTP, through the real openai SDK: POST /v1/sessions opens one, an x-session-id
header runs a chat or completion call as its next turn (the conversation's KV reused, as a gRPC
turn reuses it, usage.prompt_tokens_details.cached_tokens counting it), DELETE /v1/sessions/{id}
closes it; an unknown, closed or another API key's session is a 404."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import free_port

from .conftest import base_url, sdk, wait_released

FIRST = [{"role": "user", "content": "The first question of a long conversation, with enough words to fill a few "
                                     "KV blocks of the cache."}]
SECOND = [{"role": "user", "content": "And a second one."}]


def call(server, method: str, path: str, body: dict | None = None, key: str = "unused") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url(server) + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def open_session(server, session_id: str | None = None, key: str = "unused") -> str:
    status, body = call(server, "POST", "/sessions", {"session_id": session_id} if session_id else None, key)
    assert status == 200 and body["object"] == "session" and body["ttl_seconds"] > 0, body
    return body["session_id"]


def turn(client, model, sid, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}, extra_headers={"x-session-id": sid}, **kw)


def test_two_turns_reuse_the_conversation_as_grpc_does(http_server, client, model):
    sid = open_session(http_server, "http-turns")
    first = turn(client, model, sid, FIRST)
    second = turn(client, model, sid, SECOND)
    # the whole first turn (prompt and reply) is kept, not only the prefix cache's full blocks
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # the same two turns in a gRPC session: the same replies, the same usage
    with http_server.channel() as ch:
        stub = pb_grpc.GeneratorStub(ch)
        gsid = stub.CreateSession(pb.CreateSessionRequest()).session_id
        g = [stub.Generate(request(m, session_id=gsid, temperature=0, max_new_tokens=6, ignore_eos=True))
             for m in (FIRST, SECOND)]
        stub.CloseSession(pb.CloseSessionRequest(session_id=gsid))
    assert [r.text for r in g] == [first.choices[0].message.content, second.choices[0].message.content]
    assert (g[1].usage.prompt_tokens, g[1].usage.cached_tokens) == (
        second.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
    # a streamed turn, and a completion continuing the token history
    chunks = list(turn(client, model, sid, [{"role": "user", "content": "A third."}], stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > second.usage.prompt_tokens
    more = client.completions.create(model=model, prompt=" and then", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True}, extra_headers={"x-session-id": sid})
    assert more.usage.completion_tokens == 3 and more.usage.prompt_tokens_details.cached_tokens > 0
    assert call(http_server, "DELETE", f"/sessions/{sid}") == (
        200, {"object": "session.deleted", "session_id": sid, "deleted": True})
    with pytest.raises(openai.NotFoundError) as e:
        turn(client, model, sid, SECOND)
    assert e.value.body["code"] == "not_found"
    assert call(http_server, "DELETE", f"/sessions/{sid}")[0] == 404
    wait_released(http_server)


def test_unknown_malformed_and_misused_sessions(http_server, client, model):
    with pytest.raises(openai.NotFoundError) as e:
        turn(client, model, "no-such-session", FIRST)
    assert e.value.status_code == 404 and e.value.body["code"] == "not_found"
    with pytest.raises(openai.BadRequestError) as e:
        turn(client, model, "bad id!", FIRST)
    assert e.value.body["param"] == "x-session-id"
    sid = open_session(http_server)
    assert len(sid) == 32
    with pytest.raises(openai.BadRequestError) as e:
        turn(client, model, sid, FIRST, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=["a", "b"], max_tokens=2, extra_headers={"x-session-id": sid})
    assert e.value.body["param"] == "prompt"
    status, body = call(http_server, "POST", "/sessions", {"session_id": sid})
    assert status == 400 and body["error"]["param"] == "session_id"  # already open
    status, body = call(http_server, "POST", "/sessions", {"session_id": "x" * 200})
    assert status == 400 and body["error"]["param"] == "session_id"
    assert call(http_server, "DELETE", f"/sessions/{sid}")[0] == 200


def test_a_session_is_its_api_keys_alone(start_server):
    srv = start_server(http_port=free_port(), api_key="key-a,key-b")
    name = srv.gen.cfg.name
    sid = open_session(srv, "owned-by-a", key="key-a")
    with sdk(srv, api_key="key-b") as b, pytest.raises(openai.NotFoundError):
        turn(b, name, sid, FIRST)
    assert call(srv, "DELETE", f"/sessions/{sid}", key="key-b")[0] == 404
    assert call(srv, "POST", "/sessions", key="wrong")[0] == 401
    with sdk(srv, api_key="key-a") as a:
        assert turn(a, name, sid, FIRST).usage.completion_tokens == 6
    assert call(srv, "DELETE", f"/sessions/{sid}", key="key-a")[0] == 200
