"""ModelRunner's counterpart for a state-space model (model_mamba2.py): a step's rows continue each sequence
from its recurrent state (kv/states.py, owned by the KV manager) instead of attending over paged K/V.

Decode rows (one new token each) of every sequence in the step run as one batch through the recurrence;
each prompt chunk runs on its own through the chunked scan. A sequence's new state is put back at its table's
length after the step's tokens, which the engine then advances the table to. Neither the fused CPU step nor
the GPU kernels run such a model (they are attention's): the decode path is torch, said once at start.
"""

from __future__ import annotations

import logging

import torch

from kvgen.engine.kv.states import StateStore
from kvgen.engine.model_runner import Batch, _adapter, _extra_rows

log = logging.getLogger("kvgen.engine")


class StateRunner:
    """What the engine asks of ModelRunner (run, prompt_logits, decode_path ...) over a recurrent model."""

    def __init__(self, model, states: StateStore):
        self.model, self.states = model, states
        self.device = model.device
        self.kernel_attention = None  # the engine and GetModelInfo ask: never the GPU kernels
        self.fused = None
        self.window = self.chunk = 0
        self.keep_features = False  # no drafter runs over a state model (generator.py)
        self.prompt_logits: dict = {}
        self.draft_logits: dict = {}
        self.features: dict = {}
        self.decode_path, self.decode_path_reason = "torch", model.torch_attention_why
        log.info("decode steps run %s's torch forward: %s", model.cfg.architecture, self.decode_path_reason)

    def run(self, batch: Batch, on_host: bool = True) -> torch.Tensor:
        """Logits [len(batch), vocab] of each sequence's last new token, then (in batch order) the prompt
        positions' logits asked for, as ModelRunner.run; each sequence's state moves on by its n tokens.
        (on_host: ModelRunner.run's; a state model runs on the CPU only, so its logits are there.)"""
        self.prompt_logits = {}
        wanted = [(seq, n, _extra_rows(seq, n)) for seq, n in batch]
        if any(seq.draft for seq, _, _ in wanted):
            raise RuntimeError("a drafted row reached a state model: a state cannot take back rejected drafts")
        if any(_adapter(seq) is not None for seq, _, _ in wanted):  # the adapter store refuses loads (lora.py)
            raise RuntimeError("a LoRA adapter's row reached a state model, which runs no adapter")
        last: list[torch.Tensor | None] = [None] * len(wanted)
        extra: dict[int, torch.Tensor] = {}
        decoding = [i for i, (_, n, m) in enumerate(wanted) if n == 1 and not m]
        if decoding:
            seqs = [wanted[i][0] for i in decoding]
            ids = torch.tensor([[seq.tokens[seq.cache.length]] for seq in seqs])
            states = [torch.stack(parts) for parts in zip(*(self.states.at(s.cache) for s in seqs), strict=True)]
            logits, new = self.model.forward(ids, states)
            for row, (i, seq) in enumerate(zip(decoding, seqs, strict=True)):
                last[i] = logits[row, 0]
                # each row's own copy: a batch's stacked state must not keep the others' alive
                self.states.put(seq.cache, [t[row].clone() for t in new], seq.cache.length + 1)
        for i, (seq, n, m) in enumerate(wanted):
            if last[i] is not None:
                continue
            start = seq.cache.length
            ids = torch.tensor([seq.tokens[start:start + n]])
            rows = torch.arange(n) if m else None  # prompt logprobs: positions start .. start + m - 1, then the last
            state = [t[None] for t in self.states.at(seq.cache)]
            logits, new = self.model.forward(ids, state, rows)
            last[i] = logits[0, -1]
            if m:
                extra[i] = logits[0, :m]
            self.states.put(seq.cache, [t[0] for t in new], start + n)
        out = torch.stack(last)
        if extra:
            out = torch.cat([out, *(extra[i] for i in sorted(extra))])
            at = len(wanted)
            for i in sorted(extra):
                self.prompt_logits[wanted[i][0]] = out[at:at + len(extra[i])]
                at += len(extra[i])
        return out[:len(wanted)]
