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
        self.history: list[int] = []  # tokens of the conversation up to the last turn taken in (see tokens)
        self.messages: list[dict] = []
        self.last_used = time.monotonic()
        self.closed = False
        self.head = 0  # tokens a context shift keeps at the start (a raw session's first prompt)
        self._turn = asyncio.Lock()
        self._last: Request | None = None  # the latest turn, until the next one takes its results in
        self._last_messages: list[dict] = []  # the conversation that turn answered (messages turns)

    async def request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                      request_id: str = "", kv_compress=None) -> Request:
        """Start the next turn (after the previous one is released). kv_compress: a KVCompression the
        turn names (None: the session's); it must be the session's (Generator.submit checks)."""
        async with self._turn:
            self._check_open()
            if self._last is not None:
                await self._last.released()
                self._take_in(self._last)
                self._check_open()
            room = self.gen.cfg.context_length - (sampling or SamplingParams()).max_new_tokens
            shift = None
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                messages = [*self.messages, *prompt]
                ids = await self.gen.prompt_ids(messages)
                while len(ids) > room and _drop_oldest_turn(messages, len(prompt)):
                    ids = await self.gen.prompt_ids(messages)  # the kept head's blocks are reused
            else:
                messages = []
                new = await self.gen.prompt_ids(prompt)
                if not self.history:
                    self.head = len(new)  # a raw session's first prompt is its kept head (n_keep)
                ids = self.history + new
                if len(ids) > room:
                    ids, shift = self._shift(ids, len(new), room)
            await self.gen.compile(sampling)
            self._check_open()
            keep = self._shared(ids) if shift is None else min(self.cache.length - shift[1] * self.block_size,
                                                                len(ids) - 1)
            req = self.gen.submit(ids, sampling, request_id, session=self, keep=keep, shift=shift,
                                  kv_compress=kv_compress)
            self._last, self._last_messages = req, messages
            self.last_used = time.monotonic()
            return req

    @property
    def tokens(self) -> list[int]:
        """The conversation's tokens so far, the last turn's included (history takes them in only
        when the next turn starts)."""
        return list(self._last.seq.tokens) if self._last is not None else list(self.history)

    @property
    def block_size(self) -> int:
        return self.gen.pool.block_size

    def _shift(self, ids: list[int], new: int, room: int) -> tuple[list[int], tuple[int, int] | None]:
        """Context shift of a token history: keep the head (the first prompt, at most a quarter
        of the room, to a block boundary), drop the oldest whole blocks after it (at least what
        is over, and half of what follows the head, so shifts are rare), keep the rest. Returns
        the shortened ids and (kept blocks, dropped blocks) when the dropped blocks are all
        cached, else None (the turn recomputes after the head). Too long a new prompt is left
        as it is (check() refuses it)."""
        bs = self.block_size
        keep_blocks = -(-min(self.head, room // 4) // bs)
        old = len(ids) - new  # history tokens: only they may be dropped
        over = len(ids) - room
        drop_blocks = -(-max(over, (old - keep_blocks * bs) // 2) // bs)
        if (keep_blocks + drop_blocks) * bs > old:
            drop_blocks = (old - keep_blocks * bs) // bs
        if drop_blocks <= 0 or drop_blocks * bs < over:
            return ids, None
        cut = (keep_blocks + drop_blocks) * bs
        shifted = ids[:keep_blocks * bs] + ids[cut:]
        cached = self.cache.length >= cut
        return shifted, (keep_blocks, drop_blocks) if cached else None

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


def _drop_oldest_turn(messages: list[dict], new: int) -> bool:
    """Remove the oldest exchange after the leading system messages (a user message and the
    replies up to the next user message), never one of the `new` messages of this turn.
    False when nothing is left to drop."""
    first = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    last = len(messages) - new
    if first >= last:
        return False
    end = first + 1
    while end < last and messages[end].get("role") not in ("user", "system"):
        end += 1
    del messages[first:end]
    return True
