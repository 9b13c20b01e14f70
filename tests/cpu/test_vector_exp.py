"""vector_exp.py's IR kernels against float64 numpy: softmax numerators and their sum, SiLU times up."""

from __future__ import annotations

import numpy as np
import pytest

from kvgen.cpu import vector_exp


@pytest.mark.parametrize("n", [1, 7, 16, 37, 256])
def test_exp_shifted_is_exp_of_the_shifted_scores_and_sums_them(n):
    """Scores from far below the max (clamped at exp(-87)) up to it; n below, at and past whole
    vectors. What lies past n is left alone."""
    rng = np.random.default_rng(n)
    s = (rng.random(n + 16) * 100 - 95).astype(np.float32)
    s[n // 2] = -200  # past the clamp
    top = np.float32(s[:n].max())
    want = np.exp(np.maximum(s[:n].astype(np.float64) - top, -87))
    got = s.copy()
    total = vector_exp.exp_shifted(got, n, top)
    np.testing.assert_allclose(got[:n], want, rtol=1e-5, atol=0)
    assert total == pytest.approx(want.sum(), rel=1e-6)
    assert np.array_equal(got[n:], s[n:])


def test_a_scores_exp_does_not_depend_on_its_place():
    """A score's exp is the same bits in a vector's lane and in the tail after the last whole
    vector (the same operations): a row's weights do not depend on how many keys it has."""
    rng = np.random.default_rng(3)
    s = (rng.random(37) * -20).astype(np.float32)
    top = np.float32(0)
    tail = s.copy()
    vector_exp.exp_shifted(tail, 37, top)
    moved = np.concatenate([s[32:], s[:32]])  # the tail's scores now in the first vector's lanes
    vector_exp.exp_shifted(moved, 37, top)
    assert np.array_equal(moved[:5], tail[32:])


def test_exp_shifted_refuses_more_scores_than_it_holds():
    with pytest.raises(ValueError):
        vector_exp.exp_shifted(np.zeros(8, np.float32), 9, np.float32(0))


@pytest.mark.parametrize("n", [5, 64, 1536])
def test_silu_mul_is_silu_of_the_gate_times_up(n):
    """gate / (1 + exp(-gate)) * up, gates past exp's range included (silu is then 0 or the gate)."""
    rng = np.random.default_rng(n)
    gu = (rng.standard_normal(2 * n) * 8).astype(np.float32)
    gu[0], gu[n - 1] = 200, -200
    out = np.empty(n, np.float32)
    vector_exp.silu_mul(gu, out)
    g, u = gu[:n].astype(np.float64), gu[n:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-30)
