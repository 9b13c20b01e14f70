"""A conversation whose KV blocks stay in the engine between turns.

Messages are appended to the session's conversation (the server keeps the assistant replies);
raw prompts and token ids continue its token history. Whatever prefix of the new prompt is
already cached is not recomputed: the turn tells the scheduler how many cached tokens it
shares, and the scheduler keeps those (bringing demoted blocks back) when it admits the turn.

Turns run one at a time. A turn starts once the previous turn's blocks are released (it
finished or was cancelled), which only ever waits on the engine, never on a client: the lock
below is held while a turn is prepared and submitted, not while anyone reads it, and `async
with` gives it back even when the waiting task is cancelled.
"""

from __future__ import annotations

import asyncio
import time

from kvgen.engine.request import Prompt, Request
from kvgen.engine.sampling import SamplingParams
from kvgen.errors import NotFound


class Session:
    def __init__(self, gen, session_id: str):
        """gen: the Generator that holds the session (it submits the turns)."""
        self.gen = gen
        self.session_id = session_id
        self.cache = gen.scheduler.kv.new_table()
        self.history: list[int] = []  # tokens of the conversation so far
        self.messages: list[dict] = []
        self.last_used = time.monotonic()
        self.closed = False
        self._turn = asyncio.Lock()
        self._last: Request | None = None  # the latest turn, until the next one takes its results in
        self._last_messages: list[dict] = []  # the conversation that turn answered (messages turns)

    async def request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                      request_id: str = "") -> Request:
        """Start the next turn (after the previous one is released)."""
        async with self._turn:
            self._check_open()
            if self._last is not None:
                await self._last.released()
                self._take_in(self._last)
                self._check_open()
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                messages = [*self.messages, *prompt]
                ids = await self.gen.prompt_ids(messages)
            else:
                messages = []
                ids = self.history + await self.gen.prompt_ids(prompt)
            await self.gen.compile(sampling)
            self._check_open()
            req = self.gen.submit(ids, sampling, request_id, session=self, keep=self._shared(ids))
            self._last, self._last_messages = req, messages
            self.last_used = time.monotonic()
            return req

    def _shared(self, ids: list[int]) -> int:
        """Cached tokens the new prompt starts with (at least one token is left to compute logits)."""
        shared = 0
        for a, b in zip(ids[: self.cache.length], self.history, strict=False):
            if a != b:
                break
            shared += 1
        return min(shared, len(ids) - 1)

    def _take_in(self, last: Request) -> None:
        """The previous turn is over and released: its tokens are the history, and a messages
        turn's reply joins the conversation (as far as it got, if it was cancelled)."""
        self.history = last.seq.tokens
        if self._last_messages:
            self.messages = [*self._last_messages, {"role": "assistant", "content": last.text}]
        self._last, self._last_messages = None, []
        self.last_used = time.monotonic()

    def _check_open(self) -> None:
        if self.closed:
            raise NotFound(f"session {self.session_id!r} is closed")

    def close(self, on_freed=None) -> None:
        """Cancel a running turn and free the blocks (on the engine thread, which then calls
        on_freed()). Returns at once."""
        self.closed = True
        if self._last is not None:
            self._last.cancel()
        self.gen.engine.drop_table(self.cache, on_freed)

    @property
    def busy(self) -> bool:
        """A turn is running (its client may still be reading)."""
        return self._last is not None and not self._last.finished

    # synchronous use, for Python callers without an event loop

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None):
        return self.gen.bridge.run(self.gen.collect(self.request(prompt, sampling)))

    def generate_stream(self, prompt: Prompt, sampling: SamplingParams | None = None):
        return self.gen.bridge.iterate(self.gen.events(self.request(prompt, sampling)))
