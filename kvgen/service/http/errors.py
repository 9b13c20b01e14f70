"""Errors as OpenAI's error JSON, {"error": {"message", "type", "param", "code"}}, with the HTTP
status OpenAI's clients act on: the SDK raises BadRequestError for 400, AuthenticationError for
401, NotFoundError for 404, RateLimitError for 429 (and retries 429 and 5xx by itself, after
Retry-After)."""

from __future__ import annotations

import math

from kvgen.errors import InvalidRequest, NotFound, Overloaded, Unavailable
from kvgen.service.errors import MAX_MESSAGE, clip

# kvgen.v1 field names (what convert and the engine report) -> OpenAI's parameter names
_PARAMS = {"sampling.max_new_tokens": "max_tokens", "sampling.stop_strings": "stop", "sampling.logprobs": "logprobs",
           "sampling.min_new_tokens": "min_tokens", "sampling.prompt_logprobs": "logprobs",
           "sampling.json_schema": "response_format", "sampling.json_object": "response_format",
           "prompt_token_ids": "prompt", "cache_salt": "user"}


def param_of(field: str) -> str:
    return _PARAMS.get(field, field.removeprefix("sampling."))


class HttpError(Exception):
    """An error that is already an HTTP answer (auth, an unknown route, a body that is no JSON)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


def body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": clip(message, MAX_MESSAGE), "type": kind, "param": param, "code": code}}


def answer(e: Exception) -> tuple[int, dict, dict]:
    """(HTTP status, OpenAI error JSON, headers) for any exception a call can raise."""
    if isinstance(e, HttpError):
        return e.status, body(str(e), e.kind, code=e.code), {}
    if isinstance(e, InvalidRequest):
        names = [(param_of(f), d) for f, d in e.violations]
        message = "; ".join(f"{f}: {d}" for f, d in names)
        return 400, body(message, "invalid_request_error", names[0][0] if names else None), {}
    if isinstance(e, Overloaded):
        retry = max(1, math.ceil(e.retry_after))
        return 429, body(str(e), "rate_limit_error", code="rate_limit_exceeded"), {"Retry-After": str(retry)}
    if isinstance(e, NotFound):
        return 404, body(str(e), "invalid_request_error", code="not_found"), {}
    if isinstance(e, Unavailable):
        return 503, body(str(e), "server_error", code="unavailable"), {"Retry-After": "1"}
    return 500, body(f"internal error: {type(e).__name__}: {e}", "server_error"), {}
