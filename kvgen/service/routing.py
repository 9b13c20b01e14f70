"""The mesh's routing key: a session lives on one replica, so every call of a session, its
CreateSession included, carries the session id as `x-session-id` metadata and the proxy hashes
it to that replica (deploy/envoy: ring hash on the header). The id is the client's to choose,
so it is known before the session exists.

The server holds the metadata to what the request says: a call whose `x-session-id` names
another session than its body would be routed by the one and served by the other, so it is
refused with INVALID_ARGUMENT rather than answered NOT_FOUND on some replica. A call with the
metadata and no session in its body is fine: any routing key may pin a stateless call to a
replica (to Abort it there later, say).
"""

from __future__ import annotations

from kvgen.errors import InvalidRequest
from kvgen.service.convert import session_id_violations
from kvgen.service.errors import clip

SESSION_HEADER = "x-session-id"


def routing_key(context) -> str:
    """The call's x-session-id metadata ("" without it)."""
    if context is None:
        return ""
    for k, v in context.invocation_metadata() or ():
        if k == SESSION_HEADER:
            return v
    return ""


def check_agrees(session_id: str, context, field: str = "session_id") -> None:
    """A body that names a session names the one its metadata routes by (when it has any)."""
    header = routing_key(context)
    if session_id and header and header != session_id:
        raise InvalidRequest([(field, f"{clip(session_id)!r} differs from the {SESSION_HEADER} metadata "
                                      f"{clip(header)!r}, by which the call was routed")])


def new_session_id(requested: str, context) -> str:
    """The id of a session about to open: the request's, else its x-session-id metadata, else ""
    (the server picks one). Raises InvalidRequest for a malformed or disagreeing one."""
    check_agrees(requested, context)
    sid = requested or routing_key(context)
    if sid:
        bad = session_id_violations(sid)
        if bad:
            raise InvalidRequest(bad)
    return sid


def check_create_session(req, settings=None) -> None:
    """The gate's check of a CreateSessionRequest: a client-chosen id is well formed."""
    if req.session_id:
        bad = session_id_violations(req.session_id)
        if bad:
            raise InvalidRequest(bad)
