"""Prompt-lookup drafting (no extra model): find the latest earlier place where the sequence's
last n tokens occurred, and propose the tokens that followed it there. Strong wherever output
repeats its input: extraction, quoting, code edits, retrieval-augmented answers."""

from __future__ import annotations

import numpy as np

from kvgen.engine.speculative.policy import FIRST_K


class PromptLookup:
    """Drafts from the sequence's own tokens; longer n-grams are tried first (fewer, better matches)."""

    wants_features = False  # the engine hands the target's hidden states only to drafters that ask
    first_k = FIRST_K  # a sequence's first draft length: lookups cost nothing to propose

    def __init__(self, max_ngram: int = 4, min_ngram: int = 3):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, wanted: list[tuple[object, int]]) -> dict[object, tuple[list[int], None]]:
        """For each (sequence, k): its drafted tokens (none where nothing matches), and no
        distribution: a lookup proposes with certainty (verify.py treats it as a point mass)."""
        out = {}
        for seq, k in wanted:
            draft = self.lookup(seq.tokens, k)
            if draft:
                out[seq] = (draft, None)
        return out

    def lag(self, seq) -> int:
        """Nothing to read before drafting: a lookup reads the tokens as they are."""
        return 0

    def forget(self, seq) -> None:
        """Nothing is kept per sequence."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of tokens' last n-gram."""
        if k < 1 or len(tokens) <= self.min_ngram:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            # windows that end before the last token, so at least one token follows each
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence: the likeliest continuation
                return ids[start:start + k].tolist()
        return []
