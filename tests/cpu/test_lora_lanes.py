"""lora_lanes.span, a LoRA adapter's delta on its rows in the fused step, against float64 numpy, and
the same bits for a row whichever rows share its loads of A and B (batch invariance: the step's
test_lora.py checks it through whole steps, at the bench's one shape of rank and rows); natively and
in the AVX2 build."""

from __future__ import annotations

import numpy as np
import pytest

from kvgen.cpu import features, lora_lanes
from kvgen.cpu.lora_lanes import LANES, ROWS
from tests.cpu.isa_build import run_in_build


def _adapter(rng, r: int, n: int, w: int, at: int = 0) -> tuple[np.ndarray, int, int, np.ndarray, np.ndarray]:
    """A flat array as lora.fused_arrays lays a span out, after `at` floats of something else: A [r, n], then
    B's block [w, r] as [w / LANES, r, LANES]; and A, B themselves."""
    a = rng.standard_normal((r, n)).astype(np.float32)
    b = rng.standard_normal((w, r)).astype(np.float32)
    block = b.reshape(w // LANES, LANES, r).transpose(0, 2, 1)
    data = np.concatenate([rng.standard_normal(at).astype(np.float32), a.ravel(), block.ravel()])
    return data, at, at + r * n, a, b


@pytest.mark.parametrize("rows", [1, 2, ROWS - 1, ROWS, ROWS + 1, 2 * ROWS + 1])
@pytest.mark.parametrize("r", [1, 7, 16])
@pytest.mark.parametrize("vectors", [3, 4, 9])  # a dot's whole rounds of chains and the vectors after them
def test_span_adds_x_a_t_b_t_to_its_rows_columns_only(rows, r, vectors):
    """y[row, col:col + w] += (x[row] A^T) B^T for the rows listed in rows[lo:hi] (not in order, not all of
    x's), within float32's rounding; other rows and columns are left as they were."""
    rng = np.random.default_rng(rows * 100 + r * 10 + vectors)
    n, w, col, wide = vectors * LANES, 2 * LANES, LANES, 4 * LANES
    data, a_at, b_at, a, b = _adapter(rng, r, n, w, at=5)
    x = rng.standard_normal((rows + 3, n)).astype(np.float32)
    y = rng.standard_normal((rows + 3, wide)).astype(np.float32)
    listed = rng.permutation(rows + 3)[:rows]
    order = np.concatenate([[rows + 2], listed, [0]]).astype(np.int64)  # lo = 1, hi = rows + 1
    got = y.copy()
    lora_lanes.span(data, a_at, b_at, r, col, w, x, got, order, 1, rows + 1)
    want = y.astype(np.float64)
    want[listed, col:col + w] += (x[listed].astype(np.float64) @ a.T.astype(np.float64)) @ b.T.astype(np.float64)
    scale = np.abs(x[listed]).max() * np.abs(a).max() * np.abs(b).max() * n * r
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale)
    untouched = np.setdiff1d(np.arange(rows + 3), listed)
    assert np.array_equal(got[untouched], y[untouched])
    assert np.array_equal(np.delete(got, np.s_[col:col + w], axis=1), np.delete(y, np.s_[col:col + w], axis=1))


def test_a_rows_delta_is_the_same_bits_whichever_rows_share_the_loads():
    """Each row alone, and in every group of rows around it (the kernels load a vector of A or B once for
    up to ROWS rows, and the rest after a whole group): the same bits, so a sequence's output does not
    depend on how many rows of its adapter share the step."""
    rng = np.random.default_rng(7)
    r, n, w, rows = 16, 36 * LANES, 3 * LANES, 2 * ROWS + 3
    data, a_at, b_at, _, _ = _adapter(rng, r, n, w)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    y = rng.standard_normal((rows, w)).astype(np.float32)
    order = rng.permutation(rows).astype(np.int64)
    alone = y.copy()
    for i in range(rows):
        lora_lanes.span(data, a_at, b_at, r, 0, w, x, alone, order, i, i + 1)
    for lo in range(rows):
        for hi in range(lo + 1, rows + 1):
            got = y.copy()
            lora_lanes.span(data, a_at, b_at, r, 0, w, x, got, order, lo, hi)
            mine = order[lo:hi]
            assert np.array_equal(got[mine], alone[mine]), (lo, hi)


def test_the_avx2_build_too():
    """The same checks in a process built without AVX-512 (its own kernel cache: isa_build.py): 8 lanes,
    ROWS 2 (the sums of more rows would not fit AVX2's 16 vector registers)."""
    if "+avx512f" not in features.FEATURES.split(","):
        pytest.skip("this CPU has no AVX-512: the AVX2 build is what runs here")
    isa = ",".join(f"-{f[1:]}" if f.startswith("+avx512") else f for f in features.FEATURES.split(","))
    code = ("from kvgen.cpu import lora_lanes; assert (lora_lanes.LANES, lora_lanes.ROWS) == (8, 2); "
            "from tests.cpu.test_lora_lanes import test_span_adds_x_a_t_b_t_to_its_rows_columns_only as f, "
            "test_a_rows_delta_is_the_same_bits_whichever_rows_share_the_loads as g; "
            "[f(rows, r, v) for rows in (1, 2, 3, 5) for r in (1, 7, 16) for v in (3, 4, 9)]; g()")
    run_in_build(code, isa)
