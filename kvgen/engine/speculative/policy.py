"""How many tokens to draft: per sequence, from its recent acceptance (the seeds' WithAdaptive:
raise k above 0.8, lower it below 0.4, stop drafting when it stays low), and per step, from the
batch size: a decode step of a small batch is bound by reading the weights, so k+1 query rows
cost about one; a large batch is bound by compute, and every rejected row is lost work; and from
the measured costs: a drafter whose tokens cost more than the kept ones save stops drafting."""

from __future__ import annotations

from dataclasses import dataclass

RAISE_ABOVE = 0.8
LOWER_BELOW = 0.4
# Checks whose pooled acceptance (kept / drafted tokens over the window, whatever k each had)
# decides: below LOWER_BELOW, plain decoding from then on. (Counted as checks in a row below it, a
# head keeping one draft in four never gave up: each kept draft lifted the running rate over 0.4
# and restarted the count. Counted at k == 1 only, it still drafted ~22 tokens a request: each
# kept draft raised k and restarted the window. An EAGLE head keeping 26% on free chat then cost
# 10% of plain decoding's speed: a drafted token costs a head and LM-head forward and a verified
# row, about as much as the step it saves when kept.)
GIVE_UP_AFTER = 8
SMOOTHING = 0.5  # weight of the latest check in the running acceptance rate
FIRST_K = 4  # a sequence's draft length until its first check (drafters may start lower: first_k)
# A draft model must first read the context it has not seen (its own prefill) before it drafts.
# Under load nobody drafts (draft_cap), so when load falls a long-running sequence's draft is far
# behind: 16 streams of staggered lengths lost 12-42% to the last ones catching up ~150 tokens to
# draft their last 6-48 (int4 draft, fp32 target, Sapphire Rapids). There catching up cost ~3 ms
# a token (measured), and an accepted draft saves an estimated ~24 ms of target time at batch 1
# and ~4 ms at batch 8, where drafting resumes (from the bench's decode rates and speed-ups).
# So a sequence resumes only when its lag is at most CATCH_UP times the tokens it may still take:
# right at batch 4-8, cautious at batch 1. (A lookup's lag is 0; a fresh request's first draft is
# left to the draft_cap: its lag is its prompt, and the break-even, ~8 tokens of lag a token left
# at batch 1, favours it where requests start alone.)
CATCH_UP = 2


# What a drafted token is worth, measured. A decode step over r rows takes about F + c r: F is
# what every step pays however many rows it has (reading the weights, per-step overhead), c each
# row's compute. A kept draft saves its sequence a step, so that sequence's share of one, F/n + c
# with n sequences in the step; every drafted token costs its verifying row, c, and the drafter's
# own time per token, d. So a sequence drafts while its acceptance a gives a (F/n + c) > c + d.
# F and c are fitted to the decode steps the engine times (rows vary with the load and the drafts;
# until they have varied, c is taken as 0: all of a step is F). Measured here (2 cores, Q4_1):
# F ~10 ms and c ~2.7 ms, so at 8 sequences a draft must be kept ~70% of the time to pay, at 1
# ~20%; a GPU's c is ~0. Drafters' d: prompt lookup ~nothing; a draft model at int4 for an fp32
# target ~a fifth of a step; the EAGLE head trained here ~5 ms a token (its LM head is a fifth of
# SmolLM2's weights) keeping ~22% of drafts: it cost 10% at batch 1 and 17% at 16 streams (each
# sequence's window of GIVE_UP_AFTER checks drafting at a loss) before this gate.
PRIOR = 4.0  # drafted tokens' worth of the drafter's pooled acceptance in a sequence's estimate
DECAY = 0.9  # weight of the past in the drafter's cost and the pooled acceptance
FIT_DECAY = 0.98  # weight of the past in the step-time fit (~50 steps: loads and drafts vary slowly)
MIN_SPREAD = 1.0  # rows' variance in the fit's steps below which c is not told apart from F


@dataclass(slots=True)
class DraftEconomy:
    """One engine's measured costs and its drafter's acceptance over every sequence."""

    draft_seconds: float | None = None  # d: the drafter's time per drafted token
    drafted: float = 0.0  # pooled over sequences, decayed per check
    kept: float = 0.0
    # the step-time fit's decayed sums: weight, rows, seconds, rows^2, rows x seconds
    steps: float = 0.0
    rows: float = 0.0
    seconds: float = 0.0
    rows2: float = 0.0
    rows_seconds: float = 0.0

    def record_draft(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.draft_seconds = _average(self.draft_seconds, seconds / tokens)

    def record_step(self, seconds: float, rows: int) -> None:
        """One decode step (no prompt chunk): its time over its rows, drafts' included."""
        f = FIT_DECAY
        self.steps, self.rows, self.seconds = f * self.steps + 1, f * self.rows + rows, f * self.seconds + seconds
        self.rows2, self.rows_seconds = f * self.rows2 + rows * rows, f * self.rows_seconds + rows * seconds

    def record_check(self, drafted: int, kept: int) -> None:
        self.drafted = DECAY * self.drafted + drafted
        self.kept = DECAY * self.kept + kept

    def step_cost(self) -> tuple[float, float] | None:
        """(F, c): a decode step's fixed seconds and seconds per row, fitted; None before a step."""
        if not self.steps:
            return None
        rows, seconds = self.rows / self.steps, self.seconds / self.steps
        spread = self.rows2 / self.steps - rows * rows
        c = 0.0
        if spread >= MIN_SPREAD:  # a least-squares slope, kept within what the steps took
            c = min(max((self.rows_seconds / self.steps - rows * seconds) / spread, 0.0), seconds / rows)
        return seconds - c * rows, c

    def pays(self, drafted: int, kept: int, sequences: int) -> bool:
        """Whether a sequence that kept `kept` of its `drafted` tokens should draft again in a
        step of `sequences`: its acceptance (drawn toward the pooled one while it has few checks)
        times its share of a step must beat a drafted token's row and drafting time. Until the
        costs are measured, it does."""
        cost = self.step_cost()
        if self.draft_seconds is None or cost is None or not self.drafted:
            return True
        fixed, row = cost
        rate = (kept + PRIOR * self.kept / self.drafted) / (drafted + PRIOR)
        return rate * (fixed / max(1, sequences) + row) > row + self.draft_seconds


def _average(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1 - DECAY) * new


@dataclass(slots=True)
class DraftLength:
    k: int = FIRST_K
    k_max: int = 8
    rate: float | None = None  # running acceptance rate (exponential average)
    checks: int = 0  # checks in the current window of GIVE_UP_AFTER
    drafted: int = 0  # and the tokens they drafted
    kept: int = 0  # and kept
    off: bool = False  # fell back to plain decoding for good

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` tokens were kept."""
        if drafted < 1 or self.off:
            return
        now = accepted / drafted
        self.rate = now if self.rate is None else SMOOTHING * now + (1 - SMOOTHING) * self.rate
        self.checks, self.drafted, self.kept = self.checks + 1, self.drafted + drafted, self.kept + accepted
        if self.checks == GIVE_UP_AFTER:
            self.off = self.kept < LOWER_BELOW * self.drafted
            self.checks = self.drafted = self.kept = 0
        if self.rate > RAISE_ABOVE:
            self.k = min(self.k + 1, self.k_max)
        elif self.rate < LOWER_BELOW:
            self.k = max(1, self.k - 1)


def worth_catching_up(lag: int, left: int) -> bool:
    """Whether a drafter `lag` tokens behind a sequence that may take `left` more should start."""
    return lag <= CATCH_UP * left


def draft_cap(running: int, k_max: int, max_batch: int) -> int:
    """The most tokens any one sequence may draft this step, with `running` sequences decoding or
    queued to: k_max alone, shrinking as the batch grows, none above max_batch."""
    if running > max_batch:
        return 0
    return max(1, k_max // max(1, running)) if running > 1 else k_max
