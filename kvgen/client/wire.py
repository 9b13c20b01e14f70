"""What a call puts on the wire: the GenerateRequest built from a prompt and sampling fields, and
the metadata every call carries (the API key, a session's id for the mesh to route by)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import grpc

from kvgen.v1 import generate_pb2 as pb

# Behind a mesh every call of a session carries its id as metadata, and the proxy routes by it to
# the replica that holds the session (deploy/envoy); the server checks it agrees with the body.
SESSION_HEADER = "x-session-id"
REPLICA_TRAILER = "x-kvgen-replica"  # which replica answered a call (a trailer of every success)

Metadata = tuple[tuple[str, str], ...]
# A prompt: raw text, chat messages ({"role", "content"} dicts or objects with .role and
# .content), or token ids.
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | Sequence[object]


def _message(m) -> pb.ChatMessage:
    if isinstance(m, Mapping):
        return pb.ChatMessage(role=m["role"], content=m["content"])
    if isinstance(m, tuple) and len(m) == 2:
        return pb.ChatMessage(role=m[0], content=m[1])
    return pb.ChatMessage(role=m.role, content=m.content)


def session_request(session_id: str, adapter: str = "", kv_compress: str = "",
                    kv_compress_window: int | None = None,
                    kv_compress_ratio: float | None = None) -> pb.CreateSessionRequest:
    """A CreateSessionRequest: what every turn of the session runs with (a LoRA adapter's name, the
    KV compression; "" / None: the base model, the server's compression)."""
    return pb.CreateSessionRequest(session_id=session_id, adapter=adapter, kv_compress=kv_compress,
                                   kv_compress_window=kv_compress_window, kv_compress_ratio=kv_compress_ratio)


def request(prompt: Prompt, session_id: str = "", request_id: str = "", cache_salt: str = "",
            adapter: str = "", kv_compress: str = "", kv_compress_window: int | None = None,
            kv_compress_ratio: float | None = None, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text, chat messages or token ids) and SamplingParams fields
    (json_schema may be a dict, choice a list of strings, logit_bias a {token id: bias} dict);
    adapter: a loaded LoRA adapter's name ("": the base model); kv_compress (off, mean, sink-heavy),
    kv_compress_window, kv_compress_ratio: the request's KV compression ("" / None: the server's)."""
    if isinstance(sampling.get("json_schema"), dict):
        sampling["json_schema"] = json.dumps(sampling["json_schema"])
    if isinstance(sampling.get("choice"), list | tuple):
        sampling["choice"] = pb.ChoiceList(choices=sampling["choice"])
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), session_id=session_id, request_id=request_id,
                             cache_salt=cache_salt, adapter=adapter, kv_compress=kv_compress,
                             kv_compress_window=kv_compress_window, kv_compress_ratio=kv_compress_ratio)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and not isinstance(prompt[0], int):
        req.messages.extend(_message(m) for m in prompt)
    else:
        req.prompt_token_ids.extend(prompt)
    return req


def auth_metadata(api_key: str) -> Metadata:
    """The API key as the server reads it: `authorization: Bearer <key>`."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def with_session(metadata: Metadata, session_id: str) -> Metadata:
    """metadata plus a session's id, for a mesh to route the call to the replica holding it."""
    return (*metadata, (SESSION_HEADER, session_id)) if session_id else metadata


def replica_of(trailers: Iterable[tuple[str, str]] | None) -> str:
    """The replica that answered, from a call's trailing metadata ("" when not sent)."""
    return dict(trailers or ()).get(REPLICA_TRAILER, "")


def replica(call) -> str:
    """The replica that answered: from a finished call (a stream read to its end, or the call of
    a `.with_call` unary, or a Stream of this package's clients)."""
    return replica_of(call.trailing_metadata())


def session_lost(e: grpc.RpcError) -> bool:
    """A session call failed because its session is gone: NOT_FOUND (closed, expired, or its
    replica died and the mesh routed the call to another one) or UNAVAILABLE (its replica is
    unreachable). The remedy is to open the session again (Client.create_session(same id)) and
    resend the conversation. Works on raw grpc errors and on KvgenError alike."""
    return e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
