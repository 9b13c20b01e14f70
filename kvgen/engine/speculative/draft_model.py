"""Drafting with a cheaper model that shares the target's vocabulary (DRAFT_MODEL, at
DRAFT_WEIGHT_DTYPE: by default the embedded model's own Q4_1 blocks on the CPU drafting for it at
fp32 weights: ~5x faster per token than the fp32 model, and it agrees with it almost always).

The draft keeps its own paged KV, in a BlockPool of its own (DRAFT_KV_MB) of the same block and
table machinery as the target's: its blocks never compete with the requests' own, so drafting
can neither preempt a request nor hold blocks a request is waiting for; when its pool is full a
sequence simply is not drafted for. For each sequence it remembers which tokens its cache
holds: a later proposal keeps the longest prefix the sequence still agrees with (rejected
drafts and anything a preemption changed are dropped) and feeds the rest in one chunk.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.sampling import adjust, distribution, sample
from kvgen.errors import PoolExhausted

PLAIN = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class DraftModel:
    def __init__(self, model: Model, kv_mb: float = 128.0, block_size: int = 16, max_rows: int = 64):
        cfg = model.cfg
        fmt = make_format(PLAIN[model.act_dtype], cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                          compute_dtype=model.act_dtype)
        self.model = model
        self.pool = BlockPool.from_budget(fmt, kv_mb, model.device)
        self.runner = ModelRunner(model, fmt, self.pool.store, max_rows=max_rows,
                                  width=min(self.pool.capacity, -(-cfg.context_length // block_size)))
        self._caches: dict[object, tuple[PagedKVCache, list[int]]] = {}  # seq -> (cache, tokens it holds)

    wants_features = False  # the engine hands the target's hidden states only to drafters that ask
    # A sequence's first draft length: each drafted token costs a forward of the draft, so a
    # sequence starts with one and its acceptance earns it more (above 0.8: one more a check).
    first_k = 1

    def propose(self, wanted: list[tuple[object, int]]) -> dict[object, tuple[list[int], torch.Tensor | None]]:
        """For each (sequence, k): k drafted tokens and, for sampled requests, the distribution
        each was drawn from ([k, V]; None for greedy ones). All sequences decode together."""
        live = []
        for seq, k in wanted:
            tokens = seq.tokens
            cache, held = self._caches.get(seq) or (PagedKVCache(self.pool), [])
            cache.truncate(_reusable(held, tokens))
            try:
                cache.reserve(len(tokens) - cache.length + k - 1)
            except PoolExhausted:
                self.forget(seq)
                continue
            self._caches[seq] = (cache, tokens[:cache.length])
            row = SimpleNamespace(tokens=list(tokens), cache=cache, prompt_logprobs=None, draft=[])
            live.append((seq, k, row, [], []))
        out = {}
        n_new = {id(r): len(r.tokens) - r.cache.length for _, _, r, _, _ in live}
        while live:
            logits = self.runner.run([(r, n_new[id(r)]) for _, _, r, _, _ in live])
            still = []
            for (seq, k, row, drafted, qs), raw in zip(live, logits, strict=True):
                n = n_new[id(row)]
                row.cache.advance(n)
                self._caches[seq][1].extend(row.tokens[row.cache.length - n:row.cache.length])
                token, q = pick(raw[None], seq, row.tokens)
                drafted.append(token)
                qs.append(q)
                row.tokens.append(token)
                n_new[id(row)] = 1
                if len(drafted) < k:
                    still.append((seq, k, row, drafted, qs))
                else:
                    out[seq] = (drafted, None if qs[0] is None else torch.stack(qs))
            live = still
        return out

    def lag(self, seq) -> int:
        """The tokens of seq the draft must prefill before its next draft (all of them at first)."""
        held = self._caches.get(seq)
        return len(seq.tokens) - (_reusable(held[1], seq.tokens) if held else 0)

    def forget(self, seq) -> None:
        """seq is done: its draft blocks go back."""
        held = self._caches.pop(seq, None)
        if held is not None:
            held[0].reset()

    @property
    def sequences(self) -> int:
        return len(self._caches)


def pick(raw: torch.Tensor, seq, tokens: list[int]) -> tuple[int, torch.Tensor | None]:
    """A drafted token under the request's own sampling, from the draft's logits [1, V] (greedy:
    its argmax, no distribution; else drawn from q with the request's generator, and q)."""
    p = seq.params
    seen = [tokens] if p.repetition_penalty != 1.0 else [[]]
    outputs = [tokens[len(seq.prompt_ids):]]
    if p.greedy:
        return sample(raw, [p], [None], seen, outputs=outputs, stops=[seq.stop_ids])[0].token_id, None
    q = distribution(adjust(raw.float(), [p], seen, outputs, [seq.stop_ids]), [p])[0]
    return int(torch.multinomial(q, 1, generator=seq.rng)), q


def _reusable(held: list[int], tokens: list[int]) -> int:
    """How much of a draft cache holding `held` serves `tokens`: their common prefix, less the last
    token, which is fed again (its logits are needed)."""
    return min(_common_prefix(held, tokens), len(tokens) - 1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the cache follows the sequence): one comparison in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
