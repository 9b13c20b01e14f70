"""The engine loop: schedule, run one forward over every scheduled sequence, sample, emit.

It runs on its own thread so callers (the gRPC event loop among them) never block on model
work. What callers hand it (submissions, cancellations, closed sessions' tables) goes into an
inbox the loop drains between steps; the lock around the inbox is never held during work, so
no caller waits on a step. Everything else (the scheduler, its KV manager, the pool) belongs
to the engine thread alone.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvgen.cpu.threads import use_threads
from kvgen.engine.constraint import Masks
from kvgen.engine.delivery import batched_delivery
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.sampling import Sampled, sample, token_logprobs
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import FinishReason, Sequence
from kvgen.engine.speculative import DraftEconomy, accept, draft_cap, worth_catching_up
from kvgen.engine.state_runner import StateRunner
from kvgen.errors import Overloaded

log = logging.getLogger("kvgen.engine")
# A drafter this many tokens behind a sequence is following it (the target's own token, after a
# fully kept draft one more), not catching up
STEADY_LAG = 2


class Engine:
    def __init__(self, model: Model, pool: BlockPool, scheduler: Scheduler, window: int = 0, chunk: int = 0,
                 cuda_graphs: bool = True, max_waiting: int = 256, mask_threads: int = 1,
                 drafter=None, speculate: bool = False, draft_tokens: int = 5, draft_max_batch: int = 8,
                 threads: int = 0):
        self.model = model
        self.threads = threads  # THREADS: the kernels' threads on the engine thread (0: every core)
        self.device = model.device  # where the model, the pool and a step's tensors live
        self.window = window  # sliding-window attention: blocks behind the window are freed
        self.chunk = chunk  # chunked attention: blocks of finished chunks are freed
        self.pool = pool
        self.scheduler = scheduler
        self.max_waiting = max_waiting  # queued requests (not yet admitted) before Overloaded
        self._cv = threading.Condition()  # guards the inbox below, never a step
        self._submitted: list[Sequence] = []
        self._cancelled: list[Sequence] = []
        self._dropped: list = []  # closed sessions' (table, on_freed)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0
        self._progress_at = time.monotonic()  # the loop's last sign of life (see stalled_s)
        self.on_step = None  # fn(batch, seconds): metrics and tracing hook
        self.on_submit = None  # fn(seq), caller's thread, before the engine sees seq: tracing
        self.on_release = None  # fn(seq), engine thread, once seq's KV is let go: metrics, tracing
        # Builds each step's inputs and runs Model.forward; on CUDA, decode steps go through the
        # GPU kernels where they serve the KV format (CUDA graphs unless cuda_graphs is off).
        if getattr(model, "recurrent", False):  # a state-space model: steps over the KV manager's states
            self.runner = StateRunner(model, scheduler.kv.states)
        else:
            self.runner = ModelRunner(model, pool.fmt, pool.store, window=window, chunk=chunk,
                                      cuda_graphs=cuda_graphs, max_rows=scheduler.max_running,
                                      width=min(pool.capacity, -(-model.cfg.context_length // pool.block_size)))
        self.masks = Masks(model.cfg.vocab_size, threads=mask_threads)
        self._ahead = None  # (sequences, future of their masks) started by _mask_ahead for the next step
        # Speculative decoding (kvgen/engine/speculative): a drafter (PromptLookup or DraftModel;
        # None: off for everyone), whether requests that do not say speculate, the longest draft,
        # and the running-batch size above which nobody drafts.
        self.drafter = drafter
        self.speculate = speculate
        self.draft_tokens = draft_tokens
        self.draft_max_batch = draft_max_batch
        self.runner.keep_features = drafter is not None and drafter.wants_features
        # On a GPU, a batch that only wants argmaxes takes them there: one id a row crosses to the host,
        # not a row of logits (256 rows of a 49k vocabulary are 50 MB, a few ms a step)
        self.device_argmax = self.runner.device.type != "cpu"
        self.economy = DraftEconomy()  # measured: whether a drafted token saves more than it costs
        self.drafted_tokens = self.accepted_tokens = 0  # totals, for benchmarks and GetModelInfo-style reports

    # called from any thread

    def submit(self, seq: Sequence) -> None:
        """Queue seq (raises Overloaded when MAX_WAITING requests are queued already)."""
        if self.on_submit:
            self.on_submit(seq)
        with self._cv:
            queued = len(self._submitted) + len(self.scheduler.waiting)
            if queued >= self.max_waiting:
                raise Overloaded(f"{queued} requests already waiting (MAX_WAITING)")
            self._submitted.append(seq)
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        """Stop seq at the next step boundary; its blocks are released then. Returns at once."""
        with self._cv:
            seq.cancelled = True
            self._cancelled.append(seq)
            self._cv.notify()

    def drop_table(self, table, on_freed=None) -> None:
        """Free a closed session's blocks (after any cancellation queued before); on_freed() runs
        on the engine thread once they are. Returns at once."""
        with self._cv:
            self._dropped.append((table, on_freed))
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvgen-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            self._thread.join()
        self.masks.close()
        with self._cv:
            submitted, self._submitted = self._submitted, []
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *submitted]:
            self._retire(seq, FinishReason.ABORTED)

    def stalled_s(self) -> float:
        """Seconds the engine thread has gone without finishing a loop iteration while work is
        pending (0 when idle or moving): what a liveness probe and the watchdog read. Safe from
        any thread (two attribute reads)."""
        if self.idle and not self._inbox_full():
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    @property
    def idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.waiting

    def _inbox_full(self) -> bool:
        return bool(self._submitted or self._cancelled or self._dropped)

    # the engine thread

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        if self.threads:
            use_threads(self.threads)  # (Numba's count is per launching thread: this one's)
        while True:
            with self._cv:
                while not (self._stop or self._inbox_full() or not self.idle):
                    self._cv.wait()
                    self._progress_at = time.monotonic()  # woken: idle time is not a stall
                if self._stop:
                    return
            with batched_delivery():  # the step's events reach each caller's loop together (delivery.py)
                try:
                    self.step()
                except Exception as e:  # a broken step must not hang every stream
                    log.exception("engine step failed")
                    for seq in [*self.scheduler.running]:
                        self._retire(seq, FinishReason.ABORTED, error=e)
            self._progress_at = time.monotonic()

    def _take_inbox(self) -> None:
        """What callers handed over since the last step: new sequences join the queue, cancelled
        ones finish, closed sessions' blocks are freed (after their turn is cancelled)."""
        with self._cv:
            submitted, self._submitted = self._submitted, []
            cancelled, self._cancelled = self._cancelled, []
            dropped, self._dropped = self._dropped, []
        for seq in submitted:
            self.scheduler.add(seq)
        for seq in cancelled:
            if not seq.finished:
                self._retire(seq, FinishReason.CANCELLED)
        for table, on_freed in dropped:
            self.scheduler.kv.drop(table)
            if on_freed:
                on_freed()

    def step(self) -> None:
        """Take the inbox, then one forward pass over everything scheduled."""
        self._take_inbox()
        if self.idle:
            return
        if self.drafter is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if self.drafter is not None:
            self._fit_drafts(batch)
        if not batch:
            time.sleep(0.001)  # blocked on KV room; finished sequences will make some
            return
        t0 = time.perf_counter()
        for seq, _ in batch:
            if seq.admitted_at is None:
                seq.admitted_at = t0
        # The rows sampled after this step are those whose pending tokens it covers; their
        # constraints' masks were started when the last step emitted their tokens (_mask_ahead),
        # or are computed now, while the forward pass runs.
        ready = [i for i, (seq, n) in enumerate(batch) if seq.pending == n and not seq.draft]
        drafted = [i for i, (seq, _) in enumerate(batch) if seq.draft]
        masked = [j for j, i in enumerate(ready) if batch[i][0].matcher is not None]
        constrained = [batch[ready[j]][0] for j in masked]
        ahead, self._ahead = self._ahead, None
        have = {seq: row for row, seq in enumerate(ahead[0])} if ahead else {}
        todo = [seq for seq in constrained if seq not in have]
        masks = self.masks.start([seq.matcher for seq in todo]) if todo else None
        argmax_on_device = self.device_argmax and all(
            seq.params.plain_greedy and not seq.draft and not seq.forks for seq, _ in batch)
        try:
            # float32; on the CPU unless argmax_on_device: sampling uses per-sequence torch.Generators
            logits = self.runner.run(batch, on_host=not argmax_on_device)
            if self.drafter is not None and all(n == 1 + len(seq.draft) for seq, n in batch):
                self.economy.record_step(time.perf_counter() - t0, sum(n for _, n in batch))  # a decode step's cost
        finally:  # waited for on failure too: no matcher may still be in use when tokens are fed to them
            fresh = masks.result() if masks else None
            early = ahead[1].result() if ahead else None
        bitmask = None
        if masked:
            at = {seq: row for row, seq in enumerate(todo)}
            bitmask = torch.stack([early[have[seq]] if seq in have else fresh[at[seq]] for seq in constrained])
        for seq, chunk in self.runner.prompt_logits.items():
            start = seq.cache.length
            seq.prompt_logprobs += token_logprobs(chunk, seq.prompt_ids[start + 1:start + 1 + len(chunk)],
                                                  seq.params.prompt_logprobs)
        starts = [seq.cache.length for seq, _ in batch]
        for seq, n in batch:
            self.scheduler.kv.advance(seq.cache, n, self._oldest_needed(seq.cache.length + n))
            if seq.shares_prompt:
                self.scheduler.kv.index_prompt(seq.cache, seq.cache_salt, seq.prompt_ids, n)
            self.scheduler.kv.compress(seq.cache)  # KV_COMPRESS: rows past its window pooled (kv/compress.py)
        self.steps += 1
        if self.on_step:  # before anything finishes: a request's last step belongs to its record
            self.on_step(batch, time.perf_counter() - t0)
        if ready:
            seqs = [batch[i][0] for i in ready]
            rows = logits if len(ready) == len(logits) else logits[ready]  # (ready is ascending: all = in order)
            if argmax_on_device:  # (what sample() gives rows that ask for nothing but greedy)
                picked = [Sampled(t) for t in rows.max(dim=-1).indices.tolist()]
            else:
                picked = sample(rows, [s.params for s in seqs], [s.rng for s in seqs],
                                [s.tokens if s.params.repetition_penalty != 1.0 else [] for s in seqs],
                                outputs=[s.output_ids for s in seqs], stops=[s.stop_ids for s in seqs],
                                bitmask=bitmask, masked=masked)
            # constrained rows first: once their tokens are fed to their matchers, the next
            # step's masks start on the masks' thread, while the rest is emitted and scheduled
            for j in [*masked, *(j for j in range(len(seqs)) if j not in masked)]:
                seq, s = seqs[j], picked[j]
                if seq.forks and not seq.output_ids:  # its prompt is computed: the other samples start
                    row = masked.index(j) if j in masked else None
                    self._fork(seq, logits[ready[j]], None if row is None else bitmask[row])
                self._emit(seq, [s])
                if masked and j == masked[-1]:
                    self._mask_ahead()
        for i in drafted:
            seq = batch[i][0]
            self._verify(seq, starts[i], torch.cat([self.runner.draft_logits[seq], logits[i:i + 1]]))
        if self.runner.keep_features:  # an EAGLE head drafts from the target's hidden states
            for (seq, _), start in zip(batch, starts, strict=True):
                if not seq.finished and self._speculates(seq):
                    self.drafter.observe(seq, start, self.runner.features[seq][:seq.cache.length - start])

    def _mask_ahead(self) -> None:
        """Start the masks of the running constrained sequences that decode next (their matchers
        take no token before then): computed while the engine finishes this step and runs the
        next one's forward, on 2 cores mostly while this thread is in Python."""
        seqs = [seq for seq in self.scheduler.running
                if seq.matcher is not None and not seq.finished and seq.pending == 1 and not seq.draft]
        if seqs:
            self._ahead = (seqs, self.masks.start([seq.matcher for seq in seqs]))

    def _emit(self, seq: Sequence, sampled: list) -> None:
        """Hand seq its new tokens in order, until one of them finishes it."""
        for s in sampled:
            if seq.cancelled or seq.finished:
                return
            seq.on_token(s)
            if not seq.finished and seq.num_tokens >= self.model.cfg.context_length:
                seq.finish(FinishReason.LENGTH)
            if seq.finished:
                self._release(seq)

    # n parallel samples

    def _fork(self, first: Sequence, logits: torch.Tensor, mask: torch.Tensor | None) -> None:
        """The other samples of first's request take its prompt's KV (full blocks shared, the
        last one copied) and their first tokens from the same logits; one with no room (pool or
        running batch) waits and computes its prompt itself, mostly from the prefix cache."""
        others = [f for f in first.forks if not (f.cancelled or f.finished)]
        first.forks = []
        forked = []
        for f in others:
            room = len(self.scheduler.running) < self.scheduler.max_running
            if room and self.scheduler.kv.fork(first.cache, f.cache):
                f.cached_tokens = first.cache.length  # the prompt was computed once, by `first`
                f.admitted_at = first.admitted_at
                self.scheduler.running.append(f)
                forked.append(f)
            else:
                self.scheduler.add(f)
        if not forked:
            return
        m = len(forked)
        picked = sample(logits[None].repeat(m, 1), [f.params for f in forked], [f.rng for f in forked],
                        [f.tokens if f.params.repetition_penalty != 1.0 else [] for f in forked],
                        outputs=[[] for _ in forked], stops=[f.stop_ids for f in forked],
                        bitmask=None if mask is None else mask[None].repeat(m, 1),
                        masked=None if mask is None else list(range(m)))
        for f, s in zip(forked, picked, strict=True):
            self._emit(f, [s])

    # speculative decoding

    def _speculates(self, seq: Sequence) -> bool:
        wanted = seq.params.speculative if seq.params.speculative is not None else self.speculate
        # Constrained rows are not drafted: their masks follow the matcher one token at a time.
        return wanted and seq.matcher is None and not seq.draft_length.off

    def _propose(self) -> None:
        """Drafts for the running sequences that decode this step, before it is scheduled: the
        scheduler then counts each draft in the token budget like a prefill chunk."""
        running = self.scheduler.running
        # the load counts the queue too: 16 requests that arrive together are admitted over a
        # few steps, and the first ones must not draft (and verify k + 1 rows each) meanwhile
        cap = draft_cap(len(running) + len(self.scheduler.waiting), self.draft_tokens, self.draft_max_batch)
        if not cap:
            return
        room = self.model.cfg.context_length
        wanted = []
        # a drafted token's cost is measured where no drafter catches up (reads a prompt, or what
        # was decoded under load, first): that is paid once a sequence, not once a token
        steady = True
        for seq in running:
            if seq.pending != 1 or seq.finished or not self._speculates(seq):
                continue
            if seq.draft_length.rate is None:  # not checked yet: the drafter's first length
                seq.draft_length.k = min(seq.draft_length.k, self.drafter.first_k)
            # k drafts yield up to k + 1 tokens: never more than the request may still take
            left = min(seq.params.max_new_tokens - len(seq.output_ids), room - seq.num_tokens) - 1
            # a fresh request's draft reads its prompt as the target just did (worth it at low
            # load, where requests start drafting); one that decoded plain under load may be a
            # whole context behind with a few tokens to go
            lag = self.drafter.lag(seq)
            if len(seq.output_ids) > 1 and not worth_catching_up(lag, left + 1):
                continue
            # a sequence's first draft is always tried (it probes what this drafter keeps for it)
            if seq.verifications and not self.economy.pays(seq.drafted, seq.accepted, len(running)):
                continue
            k = min(cap, seq.draft_length.k, left)
            if k > 0:
                wanted.append((seq, k))
                steady = steady and lag <= STEADY_LAG
        if not wanted:
            return
        t0 = time.perf_counter()
        drafts = self.drafter.propose(wanted)
        if steady:
            self.economy.record_draft(time.perf_counter() - t0, sum(len(tokens) for tokens, _ in drafts.values()))
        for seq, (tokens, q) in drafts.items():
            seq.draft, seq.draft_q = tokens, q

    def _fit_drafts(self, batch) -> None:
        """Drafts the step has no room for are cut (the budget ran out, or it was preempted)."""
        scheduled = {seq: n for seq, n in batch}
        for seq in self.scheduler.running:
            if seq.draft:
                n = scheduled.get(seq, 0)
                seq.cut_draft(max(0, n - (seq.num_tokens - seq.cache.length)))

    def _verify(self, seq: Sequence, start: int, raw: torch.Tensor) -> None:
        """Keep what the target agrees with of seq's draft (written at start + 1 ...), give the
        rest of its KV back, and emit the accepted tokens plus the target's next one."""
        draft, q = seq.draft, seq.draft_q
        seq.cut_draft(0)
        if seq.cancelled or seq.finished:
            return
        p = seq.params
        out = accept(raw, draft, q, p, seq.rng, seq.tokens if p.repetition_penalty != 1.0 else [],
                     seq.output_ids, seq.stop_ids)
        kept = len(out) - 1
        self.scheduler.kv.truncate(seq.cache, start + 1 + kept)
        seq.record_draft(len(draft), kept)
        self.economy.record_check(len(draft), kept)
        self.drafted_tokens += len(draft)
        self.accepted_tokens += kept
        self._emit(seq, out)

    def _oldest_needed(self, next_pos: int) -> int:
        """The oldest position a query at next_pos or later can still attend to (0: all)."""
        lo = 0
        if self.window:
            lo = max(lo, next_pos - self.window + 1)
        if self.chunk:
            lo = max(lo, next_pos - next_pos % self.chunk)
        return lo

    def _retire(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        seq.finish(reason, error=error)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        try:
            for f in seq.forks:  # ended before its prompt was computed: so do the other samples
                if not f.finished:
                    self._retire(f, seq.finish_reason or FinishReason.CANCELLED, error=None)
            seq.forks = []
            if self.drafter is not None:
                self.drafter.forget(seq)
            self.scheduler.finish(seq)  # blocks back to the pool, or a session's parked
            if self.on_release:
                self.on_release(seq)
            if seq.on_release:
                seq.on_release()
        finally:  # the finishing event, once the KV is let go; sent even if letting go failed: no reader hangs
            seq.emit_final()

