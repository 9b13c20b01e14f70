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
        """(field, problem) for every invalid value. Limits on sizes keep one request's stop
        matching and logprobs from costing every other sequence in the batch."""
        max_stop_strings, max_stop_chars, max_stop_ids = 16, 256, 64
        inf = float("inf")
        bad = []
        if not 0 <= self.temperature < inf:  # NaN fails every comparison
            bad.append(("temperature", "must be finite and >= 0"))
        if self.top_k < 0:
            bad.append(("top_k", "must be >= 0"))
        if not 0 < self.top_p <= 1:
            bad.append(("top_p", "must be in (0, 1]"))
        if not 0 < self.repetition_penalty < inf:
            bad.append(("repetition_penalty", "must be finite and > 0"))
        if self.max_new_tokens < 1:
            bad.append(("max_new_tokens", "must be >= 1"))
        if not 0 <= self.logprobs <= 20:
            bad.append(("logprobs", "must be in [0, 20]"))
        if any(not s for s in self.stop_strings):
            bad.append(("stop_strings", "must not contain empty strings"))
        if len(self.stop_strings) > max_stop_strings:
            bad.append(("stop_strings", f"at most {max_stop_strings} strings; got {len(self.stop_strings)}"))
        if any(len(s) > max_stop_chars for s in self.stop_strings):
            bad.append(("stop_strings", f"each at most {max_stop_chars} characters"))
        if self.stop_token_ids is not None and len(self.stop_token_ids) > max_stop_ids:
            bad.append(("stop_token_ids", f"at most {max_stop_ids} ids; got {len(self.stop_token_ids)}"))
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
    """Pick one token per row of logits [B, V] in one batched pass; `seen` = each row's prompt
    + output ids (only read for rows with a repetition penalty)."""
    raw = logits.float()
    logits = _penalise(raw, params, seen)
    # the greedy rows' answer; max() gives argmax's first-maximum index in a third of its time
    tokens = logits.max(dim=-1).indices
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows)
        tokens[idx] = _sample_rows(logits[idx], [params[i] for i in rows], [generators[i] for i in rows])
    out = [Sampled(int(t)) for t in tokens.tolist()]
    if any(p.logprobs for p in params):
        logp = torch.log_softmax(raw, dim=-1)
        chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
        k = max(p.logprobs for p in params)
        top = logp.topk(k)
        for i, p in enumerate(params):
            out[i].logprob = chosen[i]
            if p.logprobs:
                out[i].top = list(zip(top.indices[i, :p.logprobs].tolist(), top.values[i, :p.logprobs].tolist(),
                                      strict=True))
    return out


def _penalise(logits: torch.Tensor, params: list[SamplingParams], seen: list[list[int]]) -> torch.Tensor:
    """CTRL-style repetition penalty for every row at once (positive logits / p, negative * p)."""
    pen = [p.repetition_penalty for p in params]
    if all(x == 1.0 for x in pen):
        return logits
    hit = torch.zeros_like(logits, dtype=torch.bool)
    rows = [i for i, x in enumerate(pen) if x != 1.0 and seen[i]]
    if rows:
        width = max(len(seen[i]) for i in rows)
        ids = torch.tensor([seen[i] + [seen[i][0]] * (width - len(seen[i])) for i in rows])
        hit[torch.tensor(rows)] = hit[torch.tensor(rows)].scatter(1, ids, True)
    p = torch.tensor(pen, dtype=logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(hit, penalised, logits)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]):
    """Temperature, top-k and top-p as masks over one sort of every row, then the Gumbel-max
    trick with each row's own generator (so a seed gives the same tokens whatever the batch)."""
    temps = torch.tensor([p.temperature for p in params])[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    top_k = torch.tensor([p.top_k or probs.shape[1] for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params])[:, None]
    if bool((top_k < probs.shape[1]).any() or (top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1])[None, :]
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = (rank < top_k) & ((sorted_p.cumsum(-1) - sorted_p) < top_p)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p * keep)
    noise = torch.stack([torch.empty(probs.shape[1]).exponential_(generator=g) for g in gens])
    return (probs / noise).argmax(dim=-1)
