"""Each sequence's draft length follows its acceptance with the seeds' thresholds, the batch
size caps it, a draft model far behind a sequence with little left to take does not start, and a
drafter whose tokens cost more target time than the kept ones save stops drafting."""

import gc
import time

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.speculative import DraftEconomy, DraftLength, draft_cap, worth_catching_up
from kvgen.engine.speculative.policy import CATCH_UP
from tests.engine.test_batch_invariance import small_model


def test_raises_above_0_8_lowers_below_0_4_holds_between():
    d = DraftLength(k=4, k_max=6)
    d.record(4, 4)
    assert d.k == 5
    d.record(5, 5)
    d.record(6, 6)
    assert d.k == 6  # capped at k_max
    d.record(6, 0)  # running rate 0.5: between the thresholds
    assert d.k == 6
    d.record(6, 0)  # 0.25
    assert d.k == 5


def test_falls_back_to_plain_decoding_when_acceptance_stays_low():
    d = DraftLength(k=2)
    for _ in range(10):
        if d.off:
            break
        d.record(d.k, 0)
    assert d.off and d.k == 1
    d.record(1, 1)  # ignored once off
    assert d.off


def test_gives_up_when_one_draft_in_four_is_kept_not_when_one_in_two_is():
    """A window of checks decides on its pooled acceptance: a sequence keeping one draft in four
    falls back (each kept draft lifts the running rate over 0.4, so counting checks in a row below
    it never would), one keeping every other draft goes on drafting."""
    quarter = DraftLength(k=1)
    for i in range(40):
        quarter.record(1, int(i % 4 == 3))
        if quarter.off:
            break
    assert quarter.off and i < 16
    half = DraftLength(k=1)
    for i in range(40):
        half.record(1, i % 2)
    assert not half.off and half.k == 1


def test_a_kept_draft_that_raises_k_does_not_restart_the_window():
    """A head keeping about one draft in four whose first draft is kept: k rises to 2, then falls
    back to 1. The window counts checks at any k, so the 8th check ends the drafting (2 of 10
    drafted tokens kept). Counted at k == 1 only, the raise restarted the window, and such a head
    drafted ~22 tokens a request on free chat at 10% below plain decoding's speed."""
    d = DraftLength(k=1)
    ks = []
    for i in range(8):
        ks.append(d.k)
        d.record(d.k, int(i % 4 == 0))
    assert ks == [1, 2, 2, 1, 1, 1, 1, 1]
    assert d.off


def test_a_large_batch_drafts_less_and_then_not_at_all():
    assert draft_cap(1, 8, 8) == 8
    assert draft_cap(2, 8, 8) == 4
    assert draft_cap(8, 8, 8) == 1
    assert draft_cap(9, 8, 8) == 0


def test_model_drafters_start_at_one_token_and_grow_with_acceptance(gate_open):
    """In the engine: a draft model (each drafted token costs it a forward) first drafts one token
    and earns more, a check at a time, while its drafts are kept (here it is the target itself:
    all are); prompt lookup (free to propose) starts at its default length. (A self-draft costs
    what it saves: the cost gate, tested below, is held open here.)"""
    small = small_model()
    asked = {}
    for mode in ("draft", "ngram"):
        gen = Generator(*small, EngineOptions(speculative=mode, speculative_tokens=5),
                        draft_model=small[0] if mode == "draft" else None)
        propose = gen.engine.drafter.propose
        asked[mode] = []

        def spy(wanted, propose=propose, mode=mode):
            asked[mode].extend(k for _, k in wanted)
            return propose(wanted)

        gen.engine.drafter.propose = spy
        try:
            gen.generate("the cat sat on the mat and the cat sat on the mat and the cat sat on the",
                         SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
        finally:
            gen.close()
    assert asked["draft"][:5] == [1, 2, 3, 4, 5]
    assert asked["ngram"][0] == 4


def test_a_drafter_catches_up_only_for_enough_tokens_left():
    assert worth_catching_up(0, 1)
    assert worth_catching_up(CATCH_UP * 40, 40)
    assert not worth_catching_up(CATCH_UP * 40 + 1, 40)


def test_when_load_falls_a_draft_model_far_behind_does_not_start(gate_open):
    """8 requests of staggered lengths over a batch cap of 4: nobody drafts until 4 are done
    (26 tokens); the draft model is then a whole context behind the rest. The one with 174
    tokens left catches up and drafts; those with 4-8 left decode plain to the end. Once
    caught up, the draft lags one token (the target's own) or two (after a fully kept draft).
    (The cost gate is held open: this self-draft costs about what it saves, and where the gate
    paused it, a later draft would first catch up what was decoded meanwhile.)"""
    small = small_model()
    gen = Generator(*small, EngineOptions(speculative="draft", speculative_tokens=4, speculative_max_batch=4,
                                          max_running=8), draft_model=small[0])
    drafter = gen.engine.drafter
    propose, asked = drafter.propose, []

    def spy(wanted):
        asked.extend((seq.params.max_new_tokens, drafter.lag(seq), seq.params.max_new_tokens - len(seq.output_ids))
                     for seq, _ in wanted)
        return propose(wanted)

    drafter.propose = spy
    prompt = "the cat sat on the mat and then the dog ran to the cat while it sat on the mat"
    lengths = [20, 22, 24, 26, 30, 32, 34, 200]
    try:
        out = gen.batch_generate([prompt] * 8, [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
                                                for n in lengths])
    finally:
        gen.close()
    assert [len(r.token_ids) for r in out] == lengths
    assert {n for n, _, _ in asked} == {200}
    first_lag = asked[0][1]
    assert first_lag > 26  # the prompt and the tokens decoded under load
    assert all(worth_catching_up(lag, left) for _, lag, left in asked)
    assert all(lag <= 2 for _, lag, _ in asked[1:])


def test_the_cost_gate_weighs_acceptance_against_the_measured_costs():
    e = DraftEconomy()
    assert e.pays(0, 0, 1)  # nothing measured yet: draft
    e.record_step(0.010, 1)  # 10 ms a step of one row
    e.record_draft(0.004, 1)  # 4 ms a drafted token
    assert e.pays(0, 0, 1)  # no acceptance pooled yet
    for _ in range(8):
        e.record_check(1, 0)
    e.record_check(4, 1)  # pooled ~8%: a kept draft saves ~0.8 ms, a draft costs 4
    assert not e.pays(0, 0, 1)
    assert e.pays(20, 20, 1)  # a sequence whose drafts are all kept outweighs the pool
    assert not e.pays(1, 1, 1)  # one kept draft does not (drawn toward the pool)
    cheap = DraftEconomy(draft_seconds=0.0001, drafted=10, kept=1)
    cheap.record_step(0.010, 1)
    assert cheap.pays(10, 1, 1)  # 10% kept, nearly free: worth it


def test_the_step_time_fit_prices_a_verifying_row_and_the_batch_decides():
    """Steps of 10 ms + 2.5 ms a row: a kept draft saves its sequence's share of a step, 10/n +
    2.5 ms, and every drafted row costs 2.5 ms. Half kept pays alone and not among 8; 90% does."""
    e = DraftEconomy()
    for _ in range(3):
        for rows in range(1, 17):
            e.record_step(0.010 + 0.0025 * rows, rows)
    fixed, row = e.step_cost()
    assert abs(fixed - 0.010) < 1e-9 and abs(row - 0.0025) < 1e-9
    e.record_draft(0.0001, 1)  # a lookup: ~free
    e.record_check(100, 50)
    assert e.pays(50, 25, 1)  # 0.5 x 12.5 ms > 2.6 ms
    assert not e.pays(50, 25, 8)  # 0.5 x 3.75 ms < 2.6 ms
    assert e.pays(50, 45, 8)  # 0.9 x 3.75 ms > 2.6 ms
    same = DraftEconomy()
    for _ in range(20):
        same.record_step(0.030, 8)  # rows never varied: a row's cost is not told apart
    fixed, row = same.step_cost()
    assert abs(fixed - 0.030) < 1e-9 and row == 0.0


class Scripted:
    """Drafts the target's own greedy continuation (every draft kept), `cost` seconds a token."""

    wants_features = False
    first_k = 1

    def __init__(self, reference: list[int], cost: float):
        self.reference, self.cost = reference, cost

    def propose(self, wanted):
        out = {}
        for seq, k in wanted:
            at = len(seq.output_ids)
            draft = self.reference[at:at + k]
            if draft:
                time.sleep(self.cost * len(draft))
                out[seq] = (draft, None)
        return out

    def lag(self, seq):
        return 0

    def forget(self, seq):
        pass


def test_a_drafter_slower_than_the_steps_it_saves_stops_after_its_probe():
    """Every draft is kept; a free drafter drafts to the end, one that takes 100x the time of the
    target's step per token stops once that is measured: its first draft (the probe) only."""
    gc.collect()  # earlier tests' garbage collected now, not in a timed step (the gate weighs step times)
    small = small_model()
    prompt, params = "the cat sat on the mat", SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    gen = Generator(*small, EngineOptions())
    try:
        reference = gen.generate(prompt, params).token_ids
        step = time.perf_counter()
        gen.generate(prompt, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
        step = (time.perf_counter() - step) / 10
    finally:
        gen.close()
    drafted = {}
    for cost in (0.0, 100 * step):
        gen = Generator(*small, EngineOptions(speculative="ngram", speculative_tokens=4))
        gen.engine.drafter = Scripted(reference, cost)
        try:
            assert gen.generate(prompt, params).token_ids == reference
        finally:
            gen.close()
        drafted[cost] = gen.engine.drafted_tokens
        assert gen.engine.accepted_tokens == drafted[cost]
    assert drafted[0.0] >= 30  # 40 tokens, nearly all drafted
    assert drafted[100 * step] == 1
