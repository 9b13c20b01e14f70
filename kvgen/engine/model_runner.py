"""From a scheduled batch to logits: build the step's inputs from the sequences, run Model.forward
with the attention backend picked at start-up, hand back float32 logits on the CPU for sampling.
(The shape of nano-vllm's model_runner.py.)

The backend is picked once, here, by asking kvgen.gpu (the engine's one import of it) whether
its kernels serve the KV format / head_dim / window / chunk. Where they do (CUDA), decode-only
steps run Model.forward with KernelAttention over a KernelStep, replayed from a CUDA graph per
batch-size bucket (kvgen.gpu.graphs); every other step (prefill, mixed, the CPU) runs it with
TorchAttention over a Step. A format that keeps an exact tail (kv/stage.py ExactTail: each
sequence's newest block and first token unquantized) runs on the kernels too: before each kernel
step the runner hands it the rows' blocks, offsets and positions (host-known), it takes and gives
back slots and flushes full blocks there (ExactTail.prepare_decode), and inside the step the
kernels read its slot maps on the device.

A kernel decode step is staged on the host in one int32 buffer, one row per sequence and one
copy to the device per step (fill_rows):
    tokens        the new token
    seq_lens      tokens already cached = the new token's position (-1: padding row)
    block_tables  the sequence's blocks, padded with -1 to a fixed width (the most blocks a
                  sequence can have), so every step has the same shapes
A batch of n rows is padded to the smallest bucket >= n (1, 2, 4, ... up to max_rows) with
padding rows (token 0, seq_len -1, table all -1): kv_append writes nothing for them,
flash_decode returns zeros, and their logits are dropped. Padding happens with graphs off too,
so both run the same kernels on the same shapes and give the same tokens; graphs off is the
same step run eagerly (the baseline when debugging a capture). The step ends by advancing the
device-side lengths (GraphRunner copies them back to the step's input); the runner still seeds
them from the host every step: tokens come from host sampling anyway, and the host stays the
one source of truth for lengths.

The runner reads the sequences and their caches and changes neither: the engine advances the
caches after the step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvgen import gpu
from kvgen.cpu.threads import in_fresh_thread
from kvgen.engine.attention import KernelAttention, KernelStep, Step
from kvgen.engine.fused_decode import FusedDecode
from kvgen.engine.lora import LoraBatch
from kvgen.engine.model import Model
from kvgen.gpu import ops as gpu_ops  # imports without CuPy; called only on a kernel step
from kvgen.gpu.graphs import GraphRunner, buckets_for

Batch = Sequence[tuple]  # (sequence, new tokens this step): the scheduler's batch
Row = tuple[int, int, Sequence[int]]  # (new token, tokens already cached, block ids)

log = logging.getLogger("kvgen.engine")


def pick_kernel_attention(device: torch.device, fmt, head_dim: int, window: int = 0, chunk: int = 0,
                          kernels=None) -> KernelAttention | None:
    """KernelAttention where the GPU kernels serve this cache, else None (torch attention).
    kernels: stand-ins for kvgen.gpu.ops that run on the CPU (tests); default the real ones,
    on CUDA only. A format keeping an exact tail (stage.ExactTail) is served as it is: the
    kernels read its slot maps, which the runner prepares on the host before each step."""
    on_device = device.type == "cuda" or kernels is not None  # stand-ins run wherever their tensors are
    if not on_device or not gpu.supports(fmt.name, head_dim, window, chunk):
        return None
    return KernelAttention(kernels or gpu_ops)


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


class ModelRunner:
    """Runs `model` over a pool's `store` of format `fmt` (see the module doc).

    window, chunk: the attention span (sliding window / chunked; 0 = off).
    cuda_graphs: capture / replay kernel decode steps (False: the same padded step, eagerly).
    max_rows: the most sequences in a step (the scheduler's max_running), sets the buckets.
    width: block-table columns of a kernel step (the most blocks one sequence can hold;
        default: enough for the model's context).
    kernels: see pick_kernel_attention.
    fused: run decode rows through FusedDecode where it supports the model and format (False:
        always Model.forward; tests compare the two).
    """

    def __init__(self, model: Model, fmt, store: dict, *, window: int = 0, chunk: int = 0,
                 cuda_graphs: bool = True, max_rows: int = 64, width: int | None = None, kernels=None,
                 fused: bool = True):
        self.model, self.fmt, self.store = model, fmt, store
        self.device = model.device
        self.window, self.chunk = window, chunk
        self.width = width or -(-model.cfg.context_length // fmt.block_size)
        self.kernel_attention = None if model.torch_attention_why else pick_kernel_attention(  # Model's why
            self.device, fmt, model.cfg.head_dim, window, chunk, kernels)
        self.graphs: GraphRunner | None = None
        if self.kernel_attention is not None:
            # Buckets are captured lazily, on the first step of each size: the warm-up run before
            # a capture writes the same K/V to the same slots as the replay after it (fp8 too: the
            # second write of a row finds the block's scale already grown), so real inputs do.
            self.graphs = GraphRunner(self._kernel_forward, buckets=buckets_for(max_rows),
                                      pad_values={"tokens": 0, "seq_lens": -1, "block_tables": -1},
                                      inplace=("seq_lens",), enabled=cuda_graphs)
        self._staging = torch.empty((0, 2 + self.width), dtype=torch.int32)
        self.seq_lens: torch.Tensor | None = None  # the last kernel step's lengths, advanced on the device
        self.prompt_logits: dict = {}  # the last step's, see run()
        self.draft_logits: dict = {}  # the last step's, see run()
        # keep_features: every step returns its tokens' final hidden states (an EAGLE head drafts
        # from them), fused or through torch attention: the kernel path's graphs return logits only
        self.keep_features = False
        # small decode steps as one compiled call (fused_decode.py), where the model and format allow it
        fusable = fused and not (window or chunk) and FusedDecode.supports(model, fmt)
        self.fused = FusedDecode(model) if fusable else None
        # several rows of one sequence (prompt chunks, drafts) run fused over plain fp32 KV only: a
        # quantized block's later rows can move its scale (requantizing the earlier ones) before
        # the earlier rows attend, and an exact tail would need its slots for every block of a chunk
        self._fused_chunks = fmt.name == "fp32"
        if self.fused is not None:
            in_fresh_thread(self.fused.compile)  # its OpenMP pool goes with the thread (threads.py)
        self.decode_path, self.decode_path_reason = self._decode_path(fused, window, chunk)
        if self.decode_path == "torch":
            log.info("decode steps run Model.forward: %s", self.decode_path_reason)
        else:  # (each path says itself at start: one line tells an operator which code serves)
            log.info("decode steps run %s", "the fused step (kvgen/cpu/decode_step.py)" if self.decode_path == "fused"
                     else "the CUDA kernels (kvgen/gpu)")
        self.features: dict = {}  # the last step's: seq -> [n, hidden] of its new tokens

    def _decode_path(self, fused: bool, window: int, chunk: int) -> tuple[str, str]:
        """Which code runs a plain decode step ("fused", "cuda-kernels" or "torch") and, for torch,
        why not a faster one (GetModelInfo reports both; the log says it at start)."""
        if self.fused is not None:
            return "fused", ""
        if self.kernel_attention is not None:
            return "cuda-kernels", ""
        model = self.model
        if model.torch_attention_why:
            return "torch", model.torch_attention_why
        if window or chunk:
            return "torch", (f"attention window {window} / chunk {chunk}: neither the fused step nor the kernels "
                             "mask keys")
        if model.device.type == "cuda":
            return "torch", (f"KV format {self.fmt.name} at head dim {model.cfg.head_dim}: the CUDA kernels do "
                             "not serve it")
        if not fused:
            return "torch", "the fused step is turned off"
        return "torch", FusedDecode.why_not(model, self.fmt) or ""

    def run(self, batch: Batch, on_host: bool = True) -> torch.Tensor:
        """Logits [len(batch), vocab], float32 on the CPU (valid until the next call), of each
        sequence's last new token (on_host False: where the model ran, for a caller that reduces them
        there; only for a batch with neither drafts nor prompt logprobs); writes the new tokens' K/V
        into the store. Sequences that asked for prompt logprobs also get the logits of their prompt
        positions in this step, in self.prompt_logits (seq -> [m, vocab], predicting prompt tokens start+1 .. start+m);
        sequences with a draft (speculative decoding: the step feeds their last token and the
        drafted ones) get the logits of every position but the last in self.draft_logits."""
        self.prompt_logits, self.draft_logits, self.features = {}, {}, {}
        wanted = [(seq, n, _extra_rows(seq, n)) for seq, n in batch]
        if not on_host and any(m for _, _, m in wanted):
            raise ValueError("logits left on the device for a batch with drafts or prompt logprobs")
        fusable = [i for i, w in enumerate(wanted) if self._fusable(*w)]
        if fusable and len(fusable) == len(wanted):
            logits = self._fused_step(wanted)
        elif fusable:
            logits = self._split_step(batch, wanted, fusable)
        elif self.kernel_attention is not None and not self.keep_features and all(
                n == 1 and not m and _adapter(seq) is None and seq.cache.kv_start == 0 for seq, n, m in wanted):
            # (a compressed table, kv_start > 0, holds fewer rows than positions: the kernels read `length`
            # rows from the block table, torch attention reads it as a sliding window's)
            logits = self._decode_with_kernels(batch)
        else:
            logits = self._forward(batch, wanted)
        if on_host and logits.is_cuda:
            logits = logits.cpu()  # sampling runs on the CPU
        at = len(batch)
        for seq, _, m in wanted:
            if m:
                (self.draft_logits if seq.draft else self.prompt_logits)[seq] = logits[at:at + m]
                at += m
        return logits[:len(batch)]

    def _fusable(self, seq, n: int, m: int) -> bool:
        """Whether seq's rows this step can run in FusedDecode: one new token, or (over plain fp32
        KV) a prompt chunk or a draft's k + 1, from the start of its cache (no window). A prompt
        row then goes through the very operations a decode row does, whatever the chunk: its K/V
        and logits do not depend on how the prompt was cut, on what shares the step, or on
        whether the prefix cache supplied the tokens before it. A LoRA adapter's rows too: the step adds
        their deltas (fused_decode.py)."""
        return (self.fused is not None and seq.cache.kv_start == 0
                and (n == 1 and not m or self._fused_chunks and (not seq.draft or m == n - 1)))

    def _split_step(self, batch: Batch, wanted, fusable: list[int]) -> torch.Tensor:
        """A step that mixes decode rows with prompt chunks: the decode rows run fused, the rest
        through Model.forward, so a decoding sequence's rows are computed the same way whatever
        shares its step. Logits
        in run()'s order: each sequence's last row, then every sequence's extra rows."""
        chosen = set(fusable)
        rest = [i for i in range(len(wanted)) if i not in chosen]
        fused = self._fused_step([wanted[i] for i in fusable])
        both = torch.cat([fused, self._forward([batch[i] for i in rest], [wanted[i] for i in rest])])
        last, extra = {}, {}  # batch index -> row of `both` holding its last token / its extra rows
        for idx, base in ((fusable, 0), (rest, len(fused))):
            at = base + len(idx)  # each part: its sequences' last rows, then their extra rows
            for row, i in enumerate(idx):
                last[i], extra[i] = base + row, range(at, at + wanted[i][2])
                at += wanted[i][2]
        order = range(len(wanted))
        return both[[last[i] for i in order] + [r for i in order for r in extra[i]]]

    def _fused_step(self, wanted) -> torch.Tensor:
        """A step through FusedDecode: one row per new token, a sequence's n tokens (a prompt
        chunk, or a draft's k + 1) as n rows at consecutive positions over the same block table
        (each row writes its K/V before any row attends, and attends up to its own position: the
        causal mask of a prefill chunk). Logits in run()'s order: each sequence's last row, then
        its extra rows (the first m of its rows: prompt positions asked for, or every draft row
        but the last); no other row's logits are computed."""
        rows, last, extra, adapters = [], [], [], []
        for seq, n, m in wanted:
            start = seq.cache.length
            tokens = (seq.tokens + seq.draft)[start:start + n] if seq.draft else seq.tokens[start:start + n]
            extra.extend(range(len(rows), len(rows) + m))
            rows.extend((t, start + i, seq.cache.blocks) for i, t in enumerate(tokens))
            adapters.extend([_adapter(seq)] * len(tokens))
            last.append(len(rows) - 1)
        if not self.keep_features:
            return self.fused(rows, self.store, self.fmt, need=last + extra, adapters=adapters)
        features = np.empty((len(rows), self.model.cfg.hidden_size), np.float32)
        logits = self.fused(rows, self.store, self.fmt, need=last + extra, features=features, adapters=adapters)
        self._keep_features(wanted, torch.from_numpy(features))
        return logits

    def _keep_features(self, wanted, features: torch.Tensor) -> None:
        """self.features from a step's final hidden states [rows, hidden], each sequence's n
        rows in wanted's order (both step paths lay their rows out so)."""
        at = 0
        for seq, n, _ in wanted:
            self.features[seq] = features[at:at + n]
            at += n

    # ---- TorchAttention: any step ----

    def _forward(self, batch: Batch, wanted) -> torch.Tensor:
        ids, positions, blocks, offsets, qlens, ctx, rows, tables, starts = [], [], [], [], [], [], [], [], []
        prompt_rows = []  # after every sequence's last row: the prompt positions asked for
        row = -1
        for seq, n, m in wanted:
            start = seq.cache.length
            ids.extend((seq.tokens + seq.draft)[start:start + n] if seq.draft else seq.tokens[start:start + n])
            positions.append(torch.arange(start, start + n))
            b, o = seq.cache.slots(start, n)
            blocks.append(b)
            offsets.append(o)
            qlens.append(n)
            ctx.append(start + n)
            prompt_rows.extend(range(row + 1, row + 1 + m))
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
            logits_rows=torch.tensor(rows + prompt_rows),
            is_decode=all(n == 1 for n in qlens),
            kv_starts=starts if any(starts) else None,
            window=self.window,
            chunk=self.chunk,
        )
        input_ids = torch.tensor(ids)
        lora = LoraBatch.of([(_adapter(seq), n) for seq, n, _ in wanted], self.device)
        if self.device.type != "cpu":
            step, input_ids = _to_device(step, self.device), input_ids.to(self.device)
        if not self.keep_features:
            return self.model.forward(input_ids, step, self.fmt, self.store, lora=lora)
        out: list = []
        logits = self.model.forward(input_ids, step, self.fmt, self.store, features=out, lora=lora)
        self._keep_features(wanted, out[0])
        return logits

    # ---- KernelAttention: decode-only steps, through CUDA graphs ----

    def _decode_with_kernels(self, batch: Batch) -> torch.Tensor:
        rows = [(seq.tokens[seq.cache.length], seq.cache.length, seq.cache.blocks) for seq, _ in batch]
        n = len(rows)
        bucket = self.graphs.bucket_for(n) or n  # past the largest bucket: eager and unpadded
        if self._staging.shape[0] < bucket:
            # pinned: a faster copy; reuse is safe because the copy below is synchronous
            self._staging = torch.empty((bucket, 2 + self.width), dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        fill_rows(self._staging.numpy(), rows, bucket)
        staged = self._staging[:bucket].to(self.device)
        inputs = {"tokens": staged[:, 0].contiguous(), "seq_lens": staged[:, 1].contiguous(),
                  "block_tables": staged[:, 2:].contiguous()}
        # inference mode on every call: the graph runner's static copies are made inside it, and
        # inference tensors may only be updated in place under it
        with torch.inference_mode():
            if self.fmt.recent_slots:  # the exact tail's slots, on the host, before the graph reads them
                bs = self.fmt.block_size
                self.fmt.prepare_decode(self.store, [blocks[pos // bs] for _, pos, blocks in rows],
                                        [pos % bs for _, pos, _ in rows], [pos for _, pos, _ in rows])
            logits = self.graphs(inputs)
        self.seq_lens = inputs["seq_lens"][:n]
        return logits[:n]

    def _kernel_forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model.forward over staged device inputs only: what the graph runner captures."""
        step = KernelStep.of(inputs["block_tables"], inputs["seq_lens"])
        logits = self.model.forward(inputs["tokens"].long(), step, self.fmt, self.store, self.kernel_attention)
        self.kernel_attention.advance(step)  # after the last layer has read the lengths
        return logits


def _adapter(seq):
    """seq's LoRA adapter (lora.Adapter), None for the base model (and for a draft model's rows)."""
    return getattr(seq, "adapter", None)


def _extra_rows(seq, n: int) -> int:
    """How many of this step's n positions of seq need logits besides the last: a draft's
    (every position verifies the next drafted token), or those that predict a prompt token whose
    logprob is still owed (0 unless seq asked for prompt logprobs; after a preemption they are
    owed no more)."""
    if seq.draft:
        return n - 1
    if seq.prompt_logprobs is None:
        return 0
    start = seq.cache.length
    if len(seq.prompt_logprobs) != start + 1:
        return 0
    return max(0, min(n, len(seq.prompt_ids) - 1 - start))


def _to_device(step: Step, device: torch.device) -> Step:
    return dataclasses.replace(
        step, positions=step.positions.to(device), write_blocks=step.write_blocks.to(device),
        write_offsets=step.write_offsets.to(device), block_tables=step.block_tables.to(device),
        logits_rows=step.logits_rows.to(device))
