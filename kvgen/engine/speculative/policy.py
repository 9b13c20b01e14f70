"""How many tokens to draft: per sequence, from its recent acceptance (the seeds' WithAdaptive:
raise k above 0.8, lower it below 0.4, stop drafting when it stays low), and per step, from the
batch size: a decode step of a small batch is bound by reading the weights, so k+1 query rows
cost about one; a large batch is bound by compute, and every rejected row is lost work."""

from __future__ import annotations

from dataclasses import dataclass

RAISE_ABOVE = 0.8
LOWER_BELOW = 0.4
# Checks at the smallest k whose pooled acceptance decides: below LOWER_BELOW, plain decoding from
# then on. (Counted as checks in a row below it, a head accepting one draft in four never gave up:
# each acceptance lifted the running rate over 0.4 and restarted the count, and it kept paying
# for drafts that were mostly thrown away.)
GIVE_UP_AFTER = 8
SMOOTHING = 0.5  # weight of the latest check in the running acceptance rate
FIRST_K = 4  # a sequence's draft length until its first check (drafters may start lower: first_k)


@dataclass(slots=True)
class DraftLength:
    k: int = FIRST_K
    k_max: int = 8
    rate: float | None = None  # running acceptance rate (exponential average)
    low: int = 0  # checks at k == 1 in the current window of GIVE_UP_AFTER (one drafted token each)
    low_accepted: int = 0  # and how many of their drafts were kept
    off: bool = False  # fell back to plain decoding for good

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` tokens were kept."""
        if drafted < 1 or self.off:
            return
        now = accepted / drafted
        self.rate = now if self.rate is None else SMOOTHING * now + (1 - SMOOTHING) * self.rate
        if self.k == 1:
            self.low, self.low_accepted = self.low + 1, self.low_accepted + accepted
            if self.low == GIVE_UP_AFTER:
                self.off = self.low_accepted < LOWER_BELOW * GIVE_UP_AFTER
                self.low = self.low_accepted = 0
        if self.rate > RAISE_ABOVE:
            self.k = min(self.k + 1, self.k_max)
            self.low = self.low_accepted = 0
        elif self.rate < LOWER_BELOW:
            self.k = max(1, self.k - 1)


def draft_cap(running: int, k_max: int, max_batch: int) -> int:
    """The most tokens any one sequence may draft this step, with `running` sequences decoding or
    queued to: k_max alone, shrinking as the batch grows, none above max_batch."""
    if running > max_batch:
        return 0
    return max(1, k_max // max(1, running)) if running > 1 else k_max
