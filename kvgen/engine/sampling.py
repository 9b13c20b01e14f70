"""Sampling parameters and the batched sampler (one call per engine step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: list[int] | None = None  # None = the model's EOS tokens
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int = 0  # top alternatives returned per token
    ignore_eos: bool = False

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) for every invalid value."""
        bad = []
        if not self.temperature >= 0:
            bad.append(("temperature", "must be >= 0"))
        if self.top_k < 0:
            bad.append(("top_k", "must be >= 0"))
        if not 0 < self.top_p <= 1:
            bad.append(("top_p", "must be in (0, 1]"))
        if not self.repetition_penalty > 0:
            bad.append(("repetition_penalty", "must be > 0"))
        if self.max_new_tokens < 1:
            bad.append(("max_new_tokens", "must be >= 1"))
        if not 0 <= self.logprobs <= 20:
            bad.append(("logprobs", "must be in [0, 20]"))
        if any(not s for s in self.stop_strings):
            bad.append(("stop_strings", "must not contain empty strings"))
        return bad

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           seen: list[list[int]]) -> list[Sampled]:
    """Pick one token per row of logits [B, V]; `seen` = each row's prompt + output ids."""
    logits = logits.float()
    raw = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = logits.clone()
        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0 and seen[i]:
                idx = torch.tensor(sorted(set(seen[i])), dtype=torch.long)
                vals = logits[i, idx]
                logits[i, idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    tokens = logits.argmax(dim=-1)  # the greedy rows' answer, and a cheap default
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        temps = torch.tensor([params[i].temperature for i in sampled_rows]).unsqueeze(1)
        probs = torch.softmax(logits[rows] / temps, dim=-1)
        for j, i in enumerate(sampled_rows):
            tokens[i] = _sample_row(probs[j], params[i], generators[i])
    out = [Sampled(int(t)) for t in tokens.tolist()]
    if any(p.logprobs for p in params):
        logp = torch.log_softmax(raw, dim=-1)
        for i, p in enumerate(params):
            out[i].logprob = float(logp[i, out[i].token_id])
            if p.logprobs:
                top = logp[i].topk(p.logprobs)
                out[i].top = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return out


def _sample_row(probs: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    if p.top_k or p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if p.top_k:
            keep[p.top_k:] = False
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            before = sorted_p.cumsum(0) - sorted_p
            keep &= before < p.top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p, 1, generator=gen)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=gen))
