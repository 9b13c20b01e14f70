"""When the clients try a call again: only UNAVAILABLE, only for a call that never started (a unary
call that got no response; a stream that delivered no message), with exponential backoff and
jitter, RetryInfo's delay honoured when the server sent one, a bounded number of attempts, and
never past the call's deadline. Every other code, and any failure after a stream's first
message, goes to the caller as it is: a generation is never run twice behind the caller's back
once a token of it was seen."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from kvgen.client.errors import KvgenError


@dataclass(frozen=True)
class Retry:
    """attempts: tries in all (1 = never retry). The n-th retry waits a random time in
    [(1 - jitter) * b, b] with b = min(max_backoff, initial_backoff * multiplier ** (n - 1)), or
    the server's RetryInfo delay if that is longer."""

    attempts: int = 4
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self):
        if self.attempts < 1 or self.initial_backoff < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"bad retry policy: {self}")

    def backoff(self, retry: int, server_delay: float | None = None) -> float:
        """How long to wait before retry number `retry` (1 for the first)."""
        b = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        wait = b * (1 - self.jitter * random.random())
        return max(wait, server_delay or 0.0)

    def delay(self, e: KvgenError, tries: int, deadline: float | None) -> float | None:
        """Seconds to wait before trying again a call that failed with e after `tries` tries and
        never started, or None when it must not be tried again (not UNAVAILABLE, attempts used up,
        or the wait would end past the deadline, a time.monotonic() value)."""
        if e.code() != grpc.StatusCode.UNAVAILABLE or tries >= self.attempts:
            return None
        wait = self.backoff(tries, e.retry_delay)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


DEFAULT = Retry()
NO_RETRY = Retry(attempts=1)


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """The timeout of the next attempt: what is left of the call's deadline."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)
