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

from kvgen.engine.constraint import Masks
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.sampling import sample, token_logprobs
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import FinishReason, Sequence
from kvgen.errors import Overloaded

log = logging.getLogger("kvgen.engine")


class Engine:
    def __init__(self, model: Model, pool: BlockPool, scheduler: Scheduler, window: int = 0, chunk: int = 0,
                 cuda_graphs: bool = True, max_waiting: int = 256, mask_threads: int = 1):
        self.model = model
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
        self.runner = ModelRunner(model, pool.fmt, pool.store, window=window, chunk=chunk, cuda_graphs=cuda_graphs,
                                  max_rows=scheduler.max_running,
                                  width=min(pool.capacity, -(-model.cfg.context_length // pool.block_size)))
        self.masks = Masks(model.cfg.vocab_size, threads=mask_threads)

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
        while True:
            with self._cv:
                while not (self._stop or self._inbox_full() or not self.idle):
                    self._cv.wait()
                    self._progress_at = time.monotonic()  # woken: idle time is not a stall
                if self._stop:
                    return
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
        batch = self.scheduler.schedule()
        if not batch:
            time.sleep(0.001)  # blocked on KV room; finished sequences will make some
            return
        t0 = time.perf_counter()
        for seq, _ in batch:
            if seq.admitted_at is None:
                seq.admitted_at = t0
        # The rows sampled after this step are those whose pending tokens it covers; their
        # constraints' masks are computed while the forward pass runs.
        ready = [i for i, (seq, n) in enumerate(batch) if seq.pending == n]
        masked = [j for j, i in enumerate(ready) if batch[i][0].matcher is not None]
        masks = self.masks.start([batch[ready[j]][0].matcher for j in masked]) if masked else None
        try:
            logits = self.runner.run(batch)  # float32, on the CPU: sampling uses per-sequence torch.Generators
        finally:  # waited for on failure too: no matcher may still be in use at the next step
            bitmask = masks.result() if masks else None
        for seq, chunk in self.runner.prompt_logits.items():
            start = seq.cache.length
            seq.prompt_logprobs += token_logprobs(chunk, seq.prompt_ids[start + 1:start + 1 + len(chunk)],
                                                  seq.params.prompt_logprobs)
        for seq, n in batch:
            self.scheduler.kv.advance(seq.cache, n, self._oldest_needed(seq.cache.length + n))
        self.steps += 1
        if self.on_step:  # before anything finishes: a request's last step belongs to its record
            self.on_step(batch, time.perf_counter() - t0)
        if ready:
            seqs = [batch[i][0] for i in ready]
            picked = sample(logits[ready], [s.params for s in seqs], [s.rng for s in seqs],
                            [s.tokens if s.params.repetition_penalty != 1.0 else [] for s in seqs],
                            outputs=[s.output_ids for s in seqs], stops=[s.stop_ids for s in seqs],
                            bitmask=bitmask, masked=masked)
            for seq, s in zip(seqs, picked, strict=True):
                if seq.cancelled or seq.finished:
                    continue
                seq.on_token(s)
                if not seq.finished and seq.num_tokens >= self.model.cfg.context_length:
                    seq.finish(FinishReason.LENGTH)
                if seq.finished:
                    self._release(seq)

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
        self.scheduler.finish(seq)  # blocks back to the pool, or a session's parked
        if self.on_release:
            self.on_release(seq)
        if seq.on_release:
            seq.on_release()

