"""The errors a request can meet, in one place: every layer raises these, and the service maps
them to gRPC status codes (service/errors.py). A leaf module: it imports nothing of kvgen's."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """violations: (field, description) pairs, reported as a google.rpc.BadRequest."""

    def __init__(self, violations: list[tuple[str, str]]):
        super().__init__("; ".join(f"{f}: {d}" for f, d in violations))
        self.violations = violations


class Overloaded(RuntimeError):
    """The waiting queue is full; the caller should retry after `retry_after` seconds."""

    def __init__(self, msg: str, retry_after: float = 1.0):
        super().__init__(msg)
        self.retry_after = retry_after


class PoolExhausted(RuntimeError):
    """The KV block pool has fewer free blocks than asked for."""


class NotFound(LookupError):
    """An unknown or closed session."""


class Unavailable(RuntimeError):
    """The server is loading or draining."""


class ClientTooSlow(Overloaded):
    """A stream's reader fell too far behind: the request was ended so the server does not hold
    its output (RESOURCE_EXHAUSTED, like any overload)."""


class Cancelled(RuntimeError):
    """The request was ended by an Abort call (CANCELLED), not by its own client."""
