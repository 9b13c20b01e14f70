"""Prompt-lookup drafting (no extra model): find the latest earlier place where the sequence's
last n tokens occurred, and propose the tokens that followed it there. Strong wherever output
repeats its input: extraction, quoting, code edits, retrieval-augmented answers."""

from __future__ import annotations

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
        last = tokens[-1]
        # where an n-gram ending in the last token can end: at an earlier copy of that token
        # (a scan for one token, then a few short comparisons: the n-gram windows over the whole
        # sequence in numpy took ~75 us a sequence a step, most of a 16-stream run's drafting time)
        ends = [j for j in range(len(tokens) - 2, -1, -1) if tokens[j] == last]
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for j in ends:  # the most recent occurrence first: the likeliest continuation
                if j >= n - 1 and tokens[j - n + 1:j + 1] == tail:
                    return tokens[j + 1:j + 1 + k]
        return []
