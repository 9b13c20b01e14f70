"""Sampling parameters and the batched sampler (one call per engine step).

The order of what happens to a row's logits follows vLLM's: logit bias, penalties (repetition
over prompt and output, presence and frequency over the output), min_new_tokens' ban on stop
tokens, the constraint's mask; then greedy takes the argmax, or temperature, top-k, top-p and
min-p (transformers' warper order) shape the distribution that is sampled. Logprobs are of the
model's own distribution, before any of it (vLLM's default).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from kvgen.engine.constraint import Constraint

MAX_LOGIT_BIAS = 1024  # entries: the bias is applied per row and per step
MAX_N = 16  # parallel samples per request: each is a running sequence


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
    constraint: Constraint | None = None  # the output must match it (a mask per step)
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0  # stop tokens are banned until this many were generated
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and top k
    speculative: bool | None = None  # draft and verify (None: the server's SPECULATIVE decides)
    n: int = 1  # parallel samples of the prompt (computed once; the others fork from its KV)

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
        if not 0 <= self.min_p <= 1:
            bad.append(("min_p", "must be in [0, 1]"))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad.append((name, "must be in [-2, 2]"))
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            bad.append(("min_new_tokens", f"must be in [0, max_new_tokens ({self.max_new_tokens})]"))
        if not 1 <= self.n <= MAX_N:
            bad.append(("n", f"must be in [1, {MAX_N}]"))
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad.append(("prompt_logprobs", "must be in [0, 20]"))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad.append(("logit_bias", f"at most {MAX_LOGIT_BIAS} entries; got {len(self.logit_bias)}"))
        elif any(not -100 <= b <= 100 for b in self.logit_bias.values()):  # NaN fails too
            bad.append(("logit_bias", "biases must be in [-100, 100]"))
        return bad

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else asked: the raw logits' argmax is the whole answer (on a GPU the
        engine takes it there and copies one id a row back, not the row's logits)."""
        return (self.temperature == 0 and not self.logprobs and not self.logit_bias and self.repetition_penalty == 1.0
                and not self.presence_penalty and not self.frequency_penalty and not self.min_new_tokens
                and self.constraint is None and self.prompt_logprobs is None and self.n == 1)


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           seen: list[list[int]], *, outputs: list[list[int]] | None = None, stops: list[set[int]] | None = None,
           bitmask: torch.Tensor | None = None, masked: list[int] | None = None) -> list[Sampled]:
    """Pick one token per row of logits [B, V] in one batched pass. seen: each row's prompt +
    output ids (read for rows with a repetition penalty); outputs: each row's generated ids
    (presence / frequency penalties, min_new_tokens); stops: each row's stop ids (min_new_tokens);
    bitmask [len(masked), ceil(V/32)] int32: the allowed tokens of the rows in `masked` (bit t%32
    of word t//32), from a constraint."""
    raw = logits.float()
    logits = adjust(raw, params, seen, outputs, stops, bitmask, masked or [])
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


def token_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[Sampled]:
    """The model's logprob of each next_ids[i] under logits[i] [n, V], with the top k: prompt
    logprobs, one chunk of a prompt at a time."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(next_ids)[:, None])[:, 0].tolist()
    if not k:
        return [Sampled(t, lp) for t, lp in zip(next_ids, chosen, strict=True)]
    top = logp.topk(k)
    return [Sampled(t, lp, list(zip(ti, tv, strict=True)))
            for t, lp, ti, tv in zip(next_ids, chosen, top.indices.tolist(), top.values.tolist(), strict=True)]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, ceil(V/32)] int32 words -> [R, V] bool (bit j of word w allows token 32*w + j).
    numpy's unpackbits over the words' little-endian bytes: torch's shifts over [R, V/32, 32]
    int32 took ~25 ms a step for 8 rows of SmolLM2's vocabulary, a fifth of a 16-row step."""
    words = np.ascontiguousarray(bitmask.numpy()).astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def adjust(logits: torch.Tensor, params: list[SamplingParams], seen: list[list[int]] | None = None,
           outputs: list[list[int]] | None = None, stops: list[set[int]] | None = None,
           bitmask: torch.Tensor | None = None, masked: list[int] = ()) -> torch.Tensor:
    """Logit bias, penalties, the constraint's mask and min_new_tokens' ban on stop tokens: each
    only for the rows that ask (a row that asks for none of it costs nothing). Same arguments as
    sample(); returns new logits (or the same tensor, when no row asks)."""
    logits = _penalise(logits, params, seen or [[] for _ in params])
    counted = [i for i, p in enumerate(params) if p.logit_bias or p.presence_penalty or p.frequency_penalty]
    banning = [i for i, p in enumerate(params) if outputs is not None and stops is not None
               and len(outputs[i]) < p.min_new_tokens and stops[i]]
    if not (counted or banning or masked):
        return logits
    logits = logits.clone()
    for i in counted:
        p = params[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias))
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()))
        if (p.presence_penalty or p.frequency_penalty) and outputs is not None and outputs[i]:
            counts = Counter(outputs[i])
            ids = torch.tensor(list(counts))
            n = torch.tensor(list(counts.values()), dtype=logits.dtype)
            logits[i, ids] -= n * p.frequency_penalty + p.presence_penalty  # OpenAI's / vLLM's formula
    if masked:
        allowed, view = unpack_bitmask(bitmask, logits.shape[1]).numpy(), logits.numpy()
        for j, i in enumerate(masked):
            np.copyto(view[i], -np.inf, where=~allowed[j])
    for i in banning:
        ids = torch.tensor([t for t in stops[i] if t < logits.shape[1]])
        # A constraint that can only end now wins over min_new_tokens: never leave a row nothing.
        if len(ids) and bool(torch.isfinite(logits[i]).sum() > torch.isfinite(logits[i, ids]).sum()):
            logits[i, ids] = -math.inf
    return logits
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
    """Inverse-CDF sampling of each row's distribution with one uniform draw from the row's own
    generator (so a seed gives the same tokens whatever the batch): the token whose interval of
    the row's cumulative mass holds u x total. One draw a row: the Gumbel-max trick drew an
    exponential per vocabulary entry, ~1 ms a row of SmolLM2's 49,152, a quarter of a 16-row
    decode step. The sums are float64, so even the least likely token keeps its own interval."""
    cdf = distribution(logits, params, normalise=False).double().cumsum(-1)
    total = cdf[:, -1]
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in gens])
    # below the total whatever u's rounding: the last token with mass is the last one reachable
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)  # (NaN rows)


def distribution(logits: torch.Tensor, params: list[SamplingParams], normalise: bool = True) -> torch.Tensor:
    """What each (non-greedy) row samples from: temperature, then top-k, top-p and min-p in
    transformers' order, as masks over one sort of every row. logits: already adjusted."""
    temps = torch.tensor([p.temperature for p in params])[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    top_k = torch.tensor([p.top_k or probs.shape[1] for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params])[:, None]
    if bool((top_k < probs.shape[1]).any() or (top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1])[None, :]
        sorted_p = sorted_p * (rank < top_k)
        # top-p over what top-k kept, renormalised: the smallest prefix whose mass reaches top_p
        # (the first token always stays)
        mass = sorted_p.sum(-1, keepdim=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p * mass
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p * keep)
    min_p = torch.tensor([p.min_p for p in params])[:, None]
    if bool((min_p > 0).any()):
        # drop what is below min_p x the top token (ratios survive the zeroing above, so this is
        # transformers' MinPLogitsWarper on their renormalised output)
        probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    return probs / probs.sum(-1, keepdim=True) if normalise else probs
