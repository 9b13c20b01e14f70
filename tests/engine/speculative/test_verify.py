"""accept(): greedy keeps exactly the target's choices; sampling keeps the target's distribution
whatever the draft (rejection sampling), checked with a chi-square test over many draws."""

import math

import pytest
import torch

from kvgen.engine.sampling import SamplingParams, distribution
from kvgen.engine.speculative import accept

V = 8


def _raw(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_keeps_the_drafts_the_target_would_pick_then_its_own():
    raw = _raw(0, 4)
    want = raw.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    out = accept(raw, want[:3], None, greedy, None, [], [], set())
    assert [s.token_id for s in out] == want  # every draft kept, plus the bonus token
    wrong = (want[1] + 1) % V
    out = accept(raw, [want[0], wrong, want[2]], None, greedy, None, [], [], set())
    assert [s.token_id for s in out] == want[:2]  # the first miss is replaced by the target's token


def test_greedy_applies_penalties_with_the_drafts_as_outputs():
    raw = torch.zeros(3, V)
    raw[:, 5] = 1.0
    raw[:, 6] = 0.9
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    out = accept(raw, [5, 5], None, params, None, [], [], set())
    # after emitting 5 once, its penalised logit 0.5 loses to 6
    assert [s.token_id for s in out] == [5, 6]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    stat = float((((counts - n * probs) ** 2) / (n * probs))[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: chi-square(dof) -> approximately normal
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("drafter", ["point", "bad_model"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8, presence_penalty=0.5)])
def test_sampled_tokens_follow_the_target_distribution(drafter, params):
    raw = _raw(1, 3)
    p0 = distribution(raw[:1], [params])[0]
    # a deliberately bad draft: it proposes the target's least likely token most of the time
    q = torch.full((2, V), 0.02)
    q[:, int(p0.argmin())] = 1 - 0.02 * (V - 1)
    rng = torch.Generator().manual_seed(7)
    counts = torch.zeros(V)
    firsts = 4000
    for _ in range(firsts):
        if drafter == "point":
            draft, dq = [int(p0.argmin()), 0], None
        else:
            draft = torch.multinomial(q, 1, generator=rng)[:, 0].tolist()
            dq = q
        out = accept(raw, draft, dq, params, rng, [], [], set())
        counts[out[0].token_id] += 1
    assert _chi_square_p(counts, p0) > 1e-3, (counts / firsts, p0)
