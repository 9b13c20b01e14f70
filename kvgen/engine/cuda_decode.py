"""Decode steps on CUDA: one new token per sequence through the kvgen.gpu kernels, replayed
from a CUDA graph per batch-size bucket.

The step is Model.forward specialised to decode (keep the two in step): the same weights and
helpers, but K/V go in through ops.kv_append and attention through ops.flash_decode, both
reading the positions from a device-side length counter, so nothing in the step depends on
host values and the whole step can be captured once per bucket and replayed with one launch.

Inputs per row (staged on the host in one int32 buffer, one copy to the device per step):
    tokens        the new token
    seq_lens      tokens already cached = the new token's position (-1: padding row)
    block_tables  the sequence's blocks, padded with -1 to a fixed width (the most blocks a
                  sequence can have), so every step has the same shapes

A batch of n rows is padded to the smallest bucket >= n (1, 2, 4, ... up to max_running) with
padding rows (token 0, seq_len -1, table all -1): kv_append writes nothing for them,
flash_decode returns zeros, and their logits are dropped. Padding happens with graphs off too,
so both run the same kernels on the same shapes and give the same tokens; graphs off is the
same step run eagerly (the baseline when debugging a capture).

Per step: kv_append and flash_decode per layer, then ops.increment advances the counter on
the device (GraphRunner copies it back to the step's input). The engine still seeds the
counter from the host lengths every step: tokens come from host sampling anyway, and the host
stays the one source of truth for lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvgen.engine.model import Model, apply_rope
from kvgen.gpu import ops as gpu_ops
from kvgen.gpu.graphs import BUCKETS, GraphRunner

Row = tuple[int, int, Sequence[int]]  # (new token, tokens already cached, block ids)


def buckets_for(max_rows: int, base: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """Buckets to capture when a step has at most max_rows rows: the base sizes below
    max_rows and the first one >= it (beyond the base, steps run eagerly and unpadded)."""
    below = [b for b in base if b < max_rows]
    above = [b for b in base if b >= max_rows][:1]
    return tuple(below + above) or (base[0],)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Rows a step of n rows runs with: the smallest bucket >= n, or n past the largest."""
    return next((b for b in buckets if b >= n), n)


def fill_rows(buf: np.ndarray, rows: Sequence[Row], bucket: int) -> None:
    """Stage a step in buf[:bucket] ([*, 2 + width] int32): column 0 the token, 1 the tokens
    already cached, 2.. the block table padded with -1. Rows len(rows)..bucket are padding
    (token 0 keeps the embedding lookup in range; seq_len -1 and an all -1 table make the
    kernels skip them). Every staged row is rewritten: buf is reused across steps."""
    width = buf.shape[1] - 2
    for i, (token, cached, blocks) in enumerate(rows):
        nb = len(blocks)
        if nb > width:
            raise ValueError(f"a sequence holds {nb} blocks, more than the {width} a step can stage")
        buf[i, 0] = token
        buf[i, 1] = cached
        buf[i, 2:2 + nb] = blocks
        buf[i, 2 + nb:] = -1
    buf[len(rows):bucket] = -1
    buf[len(rows):bucket, 0] = 0


class CudaDecoder:
    """Decode steps of `model` over a pool's store (see the module doc).

    width: block-table columns (the most blocks one sequence can hold).
    graphs: capture / replay CUDA graphs (False: the same padded step, eagerly).
    max_rows: the most sequences in a step (the scheduler's max_running), sets the buckets.
    kernels: what provides kv_append / flash_decode / increment (default kvgen.gpu.ops; tests
        pass references to run the step on the CPU).
    """

    def __init__(self, model: Model, fmt, store: dict[str, torch.Tensor], *, width: int, graphs: bool = True,
                 max_rows: int = 64, kernels=gpu_ops):
        self.model, self.fmt, self.store = model, fmt, store
        self.device = model.device
        self.width = width
        self.kernels = kernels
        # Buckets are captured lazily, on the first step of each size: the warm-up run before
        # a capture writes the same K/V to the same slots as the replay after it (fp8 too: the
        # second write of a row finds the block's scale already grown), so real inputs do.
        self.runner = GraphRunner(self._step, buckets=buckets_for(max_rows),
                                  pad_values={"tokens": 0, "seq_lens": -1, "block_tables": -1},
                                  inplace=("seq_lens",), enabled=graphs)
        self._staging = torch.empty((0, 2 + width), dtype=torch.int32)
        self.seq_lens: torch.Tensor | None = None  # the last step's counters, advanced on the device

    @staticmethod
    def supports(fmt, head_dim: int, window: int = 0, chunk: int = 0) -> bool:
        """Whether decode steps over this format can take the kernel path (sliding-window and
        chunked attention need masks the kernels do not have)."""
        return fmt.name in gpu_ops.FORMATS and head_dim <= gpu_ops.MAX_HEAD_DIM and not (window or chunk)

    @property
    def graphs(self) -> bool:
        return self.runner.enabled

    def __call__(self, rows: Sequence[Row]) -> torch.Tensor:
        """Logits [len(rows), vocab] (float32, on the device; valid until the next call) of one
        decode step; writes each row's K/V at its position."""
        n = len(rows)
        bucket = bucket_for(n, self.runner.buckets)
        if self._staging.shape[0] < bucket:
            # pinned: a faster copy; reuse is safe because the copy below is synchronous
            self._staging = torch.empty((bucket, 2 + self.width), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        fill_rows(self._staging.numpy(), rows, bucket)
        staged = self._staging[:bucket].to(self.device)
        inputs = {"tokens": staged[:, 0].contiguous(), "seq_lens": staged[:, 1].contiguous(),
                  "block_tables": staged[:, 2:].contiguous()}
        # inference mode on every call: the runner's static copies are made inside it, and
        # inference tensors may only be updated in place under it
        with torch.inference_mode():
            logits = self.runner(inputs)
        self.seq_lens = inputs["seq_lens"][:n]
        return logits[:n]

    def _step(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model.forward for one token per row, on device data only (capturable)."""
        m, k_ops, fmt, store = self.model, self.kernels, self.fmt, self.store
        cfg = m.cfg
        tokens, seq_lens, tables = inputs["tokens"], inputs["seq_lens"], inputs["block_tables"]
        b = tokens.shape[0]
        nq, nkv = cfg.num_heads, cfg.num_kv_heads
        # padding rows (-1) take position 0 to keep the RoPE lookup in range
        rot = m.rot[seq_lens.clamp_min(0).long()].unsqueeze(1)
        h = m.embed[tokens.long()]
        for i, layer in enumerate(m.layers):
            x = layer.ln1(h)
            qkv = layer.qkv(x).view(b, -1, cfg.head_dim)
            qk = apply_rope(qkv[:, :nq + nkv], rot)
            if fmt.qk_scale is not None:  # as Model.forward
                qk = qk * fmt.qk_scale[i]
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
            k_ops.kv_append(fmt, store, i, k, v, tables, seq_lens)  # at position seq_lens[row]
            a = k_ops.flash_decode(q, fmt, store, i, tables, seq_lens, len_offset=1)  # + the new token
            h += layer.o(a.reshape(b, m.q_size))
            x = layer.ln2(h)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h += layer.down(F.silu(gate) * up)
        k_ops.increment(seq_lens)  # after the last layer has read it
        return m.lm_head(m.norm(h)).float()

