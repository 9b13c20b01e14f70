"""CUDA-graph replay of a decode step, one graph per batch-size bucket.

A decode step launches hundreds of small kernels (per layer: norms, projections, kv_append,
flash_decode, ...); at small batch the launch overhead dominates. GraphRunner captures the
step once per bucket and afterwards replays it with one launch:

    def step(inputs):                       # dict of tensors, batch first
        ...                                 # GPU work only: kvgen.gpu.ops, torch ops
        return logits                       # a tensor, a tuple / list or a dict of tensors

    runner = GraphRunner(step,
                         pad_values={"seq_lens": -1, "block_tables": -1},  # padding rows do nothing
                         inplace=("seq_lens",))                           # step advances it
    logits = runner({"tokens": tokens, "positions": pos, "block_tables": bt, "seq_lens": lens})

A call with batch n picks the smallest bucket >= n (1, 2, 4, ... 256 by default), copies
the inputs into that bucket's static tensors, fills rows n.. with the pad values, replays the
graph and returns the outputs' first n rows. Batches above the largest bucket, and every call
while `enabled` is False (the on/off switch), run `step` eagerly on the inputs themselves.

What `step` must honour to be captured:
  * GPU work only, nothing that syncs with the host (.item(), .tolist(), .cpu(), printing a
    tensor, data-dependent shapes) -- kvgen.gpu.ops is written that way;
  * it reads per-call data only from `inputs`; everything else it touches (weights, the KV
    store, other buffers) keeps its address for the life of the runner;
  * shapes other than the batch dim are the same on every call (pad block tables to a fixed
    width);
  * running it again on the same inputs is harmless: it runs `warmup` times eagerly (on the
    static copies) before the capture, which compiles / loads kernels. A decode step
    qualifies: it writes the same K/V into the same slots, and increments only the static
    copy of the counter, which is refilled from the inputs before each replay.
Inputs named in `inplace` are copied back after a replay (rows :n), so a device-side counter
such as seq_lens advanced by the step is advanced in the caller's tensor too.

Outputs are views into the graph's memory, valid until the next call (graphs share one
memory pool); clone them to keep them. On a CPU device there is no graph: the runner still
pads to the bucket and reuses the static tensors, but calls `step` each time (this is how the
bucketing is tested without a GPU).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # up to MAX_RUNNING 256: a step at any load replays a graph


def buckets_for(max_rows: int, base: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """Buckets to capture when a step has at most max_rows rows: the base sizes below
    max_rows and the first one >= it (beyond the base, steps run eagerly and unpadded)."""
    below = [b for b in base if b < max_rows]
    above = [b for b in base if b >= max_rows][:1]
    return tuple(below + above) or (base[0],)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def _slice(out: Any, bucket: int, n: int) -> Any:
    """Rows :n of every tensor with the bucket as its first dim, same structure."""
    if isinstance(out, torch.Tensor):
        return out[:n] if out.dim() and out.shape[0] == bucket else out
    if isinstance(out, dict):
        return {k: _slice(v, bucket, n) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_slice(v, bucket, n) for v in out)
    return out


class _Captured:
    """One bucket: static inputs, the graph (None on CPU) and its static outputs."""

    def __init__(self, step: Callable, static: dict[str, torch.Tensor]):
        self.step = step
        self.static = static
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        # CPU stand-in: run eagerly and copy into the same output tensors.
        for dst, src in zip(_tensors(self.outputs), _tensors(self.step(self.static)), strict=True):
            dst.copy_(src)


class GraphRunner:
    """Capture `step(inputs: dict[str, Tensor])` per batch-size bucket and replay it (see the
    module docstring for the contract).

    step: the decode step; inputs are tensors with the batch as dim 0.
    buckets: batch sizes to capture, ascending.
    pad_values: value for padding rows per input name (default 0), e.g. -1 for seq_lens and
        block tables so kv_append writes nothing and flash_decode returns zeros for them.
    inplace: input names whose static copy the step modifies and that are copied back.
    enabled: the on/off switch; False runs `step` eagerly. Can be flipped at any time.
    warmup: eager runs of the step on the static inputs before a capture.
    """

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], Any], *, buckets: Sequence[int] = BUCKETS,
                 pad_values: dict[str, float | int] | None = None, inplace: Sequence[str] = (),
                 enabled: bool = True, warmup: int = 1):
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive sizes, got {buckets}")
        self.step = step
        self.buckets = tuple(buckets)
        self.pad_values = dict(pad_values or {})
        self.inplace = tuple(inplace)
        self.enabled = enabled
        self.warmup = warmup
        self._graphs: dict[int, _Captured] = {}
        self._pool = None
        # a list: each replay appends (bucket, start, end), CUDA events around it on the stream, so
        # end.elapsed_time(start) is the GPU's time for the step (what a benchmark sets, to tell the
        # GPU's busy time from the time between steps); None: nothing recorded
        self.timings: list[tuple[int, Any, Any]] | None = None

    def bucket_for(self, n: int) -> int | None:
        """Smallest bucket holding n rows, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= n), None)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def reset(self) -> None:
        """Drop every captured graph (e.g. after the KV store was reallocated)."""
        self._graphs.clear()
        self._pool = None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> Any:
        n = self._batch(inputs)
        bucket = self.bucket_for(n) if self.enabled and n > 0 else None
        if bucket is None:
            return self.step(inputs)
        entry = self._graphs.get(bucket)
        if entry is None:
            entry = self._capture(bucket, inputs)
        self._fill(entry.static, inputs, n)
        if self.timings is not None and entry.graph is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            entry.replay()
            end.record()
            self.timings.append((bucket, start, end))
        else:
            entry.replay()
        for name in self.inplace:
            inputs[name].copy_(entry.static[name][:n])
        return _slice(entry.outputs, bucket, n)

    def capture(self, example_inputs: dict[str, torch.Tensor],
                batch_sizes: Sequence[int] | None = None) -> None:
        """Capture buckets ahead of time (largest first, so smaller graphs reuse its pool), from
        example inputs of any batch: rows are repeated / cut to each bucket. The examples'
        rows are run by the warmup, so use padding-like values (seq_lens -1) if the step
        writes state."""
        for bucket in sorted(batch_sizes or self.buckets, reverse=True):
            if bucket in self._graphs:
                continue
            n = self._batch(example_inputs)
            if n < 1:
                raise ValueError("example inputs need at least one row")
            idx = torch.arange(bucket, device=next(iter(example_inputs.values())).device) % max(n, 1)
            self._capture(bucket, {k: v[idx] for k, v in example_inputs.items()})

    # ---- internals ----

    @staticmethod
    def _batch(inputs: dict[str, torch.Tensor]) -> int:
        sizes = set()
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise TypeError(f"input {name!r} must be a tensor with the batch as dim 0")
            sizes.add(t.shape[0])
        if len(sizes) != 1:
            raise ValueError(f"inputs disagree on the batch size: {sorted(sizes)}")
        return sizes.pop()

    def _fill(self, static: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], n: int) -> None:
        if static.keys() != inputs.keys():
            raise ValueError(f"inputs {sorted(inputs)} differ from the captured {sorted(static)}")
        for name, dst in static.items():
            src = inputs[name]
            if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
                raise ValueError(f"input {name!r} is {src.dtype} {tuple(src.shape)}, captured as "
                                 f"{dst.dtype} {tuple(dst.shape)} (only the batch may change)")
            dst[:n].copy_(src)
            if n < dst.shape[0]:
                dst[n:].fill_(self.pad_values.get(name, 0))

    def _capture(self, bucket: int, inputs: dict[str, torch.Tensor]) -> _Captured:
        n = self._batch(inputs)
        static = {name: torch.empty((bucket, *t.shape[1:]), dtype=t.dtype, device=t.device)
                  for name, t in inputs.items()}
        self._fill(static, inputs, min(n, bucket))
        entry = _Captured(self.step, static)
        device = next(iter(static.values())).device
        if device.type != "cuda":
            entry.outputs = self.step(static)
        else:
            with torch.cuda.device(device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(self.warmup):
                        self.step(static)
                torch.cuda.current_stream().wait_stream(side)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                entry.graph = torch.cuda.CUDAGraph()
                with _no_collection(), torch.cuda.graph(entry.graph, pool=self._pool):
                    entry.outputs = self.step(static)
        self._graphs[bucket] = entry
        return entry


@contextlib.contextmanager
def _no_collection():
    """Python's garbage collector held off for a capture. A collection inside the capture
    that destroys another CUDA graph (say, an engine's that was closed but sits in a
    reference cycle) calls cudaGraphExecDestroy, which invalidates the capture
    (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: seen on an H100 in tests/engine/test_cuda_engine.py).
    torch.cuda.graph no longer collects on entry (torch.compiler.config.force_cudagraph_gc),
    so the cycles are collected here, before the capture starts."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
