"""The engine loop: schedule, run one forward over every scheduled sequence, sample, emit.

It runs on its own thread so callers (the gRPC event loop among them) never block on
model work; they submit sequences and receive Events through each sequence's `emit`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from kvgen.engine.attention import Step
from kvgen.engine.cuda_decode import CudaDecoder
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.sampling import sample
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import FinishReason, Sequence

log = logging.getLogger("kvgen.engine")


class Engine:
    def __init__(self, model: Model, pool: BlockPool, scheduler: Scheduler, window: int = 0, chunk: int = 0,
                 cuda_graphs: bool = True):
        self.model = model
        self.device = model.device  # where the model, the pool and a step's tensors live
        self.window = window  # sliding-window attention: blocks behind the window are freed
        self.chunk = chunk  # chunked attention: blocks of finished chunks are freed
        self.pool = pool
        self.scheduler = scheduler
        self._cv = threading.Condition()
        self._cancelled: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stop = False
        self._calls: list = []
        self.steps = 0
        self._progress_at = time.monotonic()  # the loop's last sign of life (see stalled_s)
        self.on_step = None  # fn(batch, seconds): metrics and tracing hook
        self.on_submit = None  # fn(seq), caller's thread, before the engine sees seq: tracing
        self.on_release = None  # fn(seq), engine thread, once seq's KV is let go: metrics, tracing
        # On CUDA, decode steps run through the GPU kernels (CUDA graphs unless cuda_graphs is
        # off); prefill, mixed steps and what the kernels do not cover run Model.forward there.
        self.decoder: CudaDecoder | None = None
        if self.device.type == "cuda" and CudaDecoder.supports(pool.fmt, model.cfg.head_dim, window, chunk):
            width = min(pool.capacity, -(-model.cfg.context_length // pool.block_size))
            self.decoder = CudaDecoder(model, pool.fmt, pool.store, width=width, graphs=cuda_graphs,
                                       max_rows=scheduler.max_running)

    # called from any thread

    def submit(self, seq: Sequence) -> None:
        with self._cv:
            self.scheduler.add(seq)
            if self.on_submit:
                self.on_submit(seq)
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        with self._cv:
            seq.cancelled = True
            self._cancelled.append(seq)
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
        with self._cv:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self._retire(seq, FinishReason.ABORTED)

    def call(self, fn):
        """Run fn() on the engine thread between steps (for work that touches the pool)."""
        done = threading.Event()
        box = {}

        def wrapped():
            try:
                box["value"] = fn()
            except Exception as e:  # handed back to the caller
                box["error"] = e
            done.set()

        with self._cv:
            self._calls.append(wrapped)
            self._cv.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stalled_s(self) -> float:
        """Seconds the engine thread has gone without finishing a loop iteration while work is
        pending (0 when idle or moving): what a liveness probe and the watchdog read. Safe from
        any thread (two attribute reads)."""
        if self.idle and not self._cancelled and not self._calls:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    @property
    def idle(self) -> bool:
        return not self.scheduler.running and not self.scheduler.waiting

    # the engine thread

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        while True:
            with self._cv:
                while not (self._stop or self._cancelled or self._calls or not self.idle):
                    self._cv.wait()
                    self._progress_at = time.monotonic()  # woken: idle time is not a stall
                if self._stop:
                    return
                calls, self._calls = self._calls, []
            for fn in calls:
                fn()
            try:
                self.step()
            except Exception as e:  # a broken step must not hang every stream
                log.exception("engine step failed")
                with self._cv:
                    seqs = [*self.scheduler.running]
                    for seq in seqs:
                        self.scheduler.drop(seq)
                for seq in seqs:
                    self._retire(seq, FinishReason.ABORTED, error=e)
            self._progress_at = time.monotonic()

    def _drop_cancelled(self) -> None:
        with self._cv:
            cancelled, self._cancelled = self._cancelled, []
            for seq in cancelled:
                self.scheduler.drop(seq)
        for seq in cancelled:
            if not seq.finished:
                self._retire(seq, FinishReason.CANCELLED)

    def step(self) -> None:
        """One forward pass over everything scheduled (cancelled sequences leave first)."""
        self._drop_cancelled()
        with self._cv:
            batch = self.scheduler.schedule()
        if not batch:
            time.sleep(0.001)  # blocked on KV room; finished sequences will make some
            return
        t0 = time.perf_counter()
        if self.decoder is not None and all(n == 1 for _, n in batch):
            logits = self._decode_gpu(batch, t0)
        else:
            logits = self._forward(batch, t0)
        if logits.is_cuda:
            logits = logits.cpu()  # sampling runs on the CPU (per-sequence torch.Generators)
        for seq, n in batch:
            seq.cache.advance(n)
            if self.window or self.chunk:
                seq.cache.drop_before(self._oldest_needed(seq.cache.length))
        ready = [i for i, (seq, _) in enumerate(batch) if seq.pending == 0]
        if ready:
            seqs = [batch[i][0] for i in ready]
            picked = sample(logits[ready], [s.params for s in seqs], [s.generator for s in seqs],
                            [s.tokens if s.params.repetition_penalty != 1.0 else [] for s in seqs])
            for seq, s in zip(seqs, picked, strict=True):
                if seq.cancelled or seq.finished:
                    continue
                seq.on_token(s)
                if not seq.finished and seq.num_tokens >= self.model.cfg.context_length:
                    seq.finish(FinishReason.LENGTH)
                if seq.finished:
                    with self._cv:
                        self.scheduler.drop(seq)
                    self._release(seq)
        self.steps += 1
        if self.on_step:
            self.on_step(batch, time.perf_counter() - t0)

    def _forward(self, batch, t0: float) -> torch.Tensor:
        """Model.forward over the batch (any mix of prefill chunks and decode tokens)."""
        ids, positions, blocks, offsets, qlens, ctx, rows, tables, starts = [], [], [], [], [], [], [], [], []
        row = -1
        for seq, n in batch:
            start = seq.cache.length
            if seq.admitted_at is None:
                seq.admitted_at = t0
            ids.extend(seq.tokens[start:start + n])
            positions.append(torch.arange(start, start + n))
            b, o = seq.cache.slots(start, n)
            blocks.append(b)
            offsets.append(o)
            qlens.append(n)
            ctx.append(start + n)
            row += n
            rows.append(row)
            tables.append(seq.cache.live_blocks)
            starts.append(seq.cache.kv_start)
        width = max(len(t) for t in tables)
        step = Step(
            positions=torch.cat(positions),
            write_blocks=torch.cat(blocks),
            write_offsets=torch.cat(offsets),
            query_lens=qlens,
            context_lens=ctx,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
            logits_rows=torch.tensor(rows),
            is_decode=all(n == 1 for n in qlens),
            kv_starts=starts if any(starts) else None,
            window=self.window,
            chunk=self.chunk,
        )
        input_ids = torch.tensor(ids)
        if self.device.type != "cpu":
            step, input_ids = _to_device(step, self.device), input_ids.to(self.device)
        return self.model.forward(input_ids, step, self.pool.fmt, self.pool.store)

    def _decode_gpu(self, batch, t0: float) -> torch.Tensor:
        """One token per sequence through the CUDA decoder (kernels, CUDA graphs)."""
        rows = []
        for seq, _ in batch:
            if seq.admitted_at is None:
                seq.admitted_at = t0
            cache = seq.cache
            rows.append((seq.tokens[cache.length], cache.length, cache.blocks))
        return self.decoder(rows)

    def _oldest_needed(self, next_pos: int) -> int:
        """The oldest position a query at next_pos or later can still attend to."""
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
        if seq.session is None:
            seq.cache.free()
        else:
            seq.session.keep(seq)
        if self.on_release:
            self.on_release(seq)
        seq.done.set()


def _to_device(step: Step, device: torch.device) -> Step:
    return dataclasses.replace(
        step, positions=step.positions.to(device), write_blocks=step.write_blocks.to(device),
        write_offsets=step.write_offsets.to(device), block_tables=step.block_tables.to(device),
        logits_rows=step.logits_rows.to(device))
