"""int16_rounding.py: the int16 activations the block kernels multiply by, held to a numpy writing of the
module's rule, bit for bit (float32 throughout, as the compiled code without fastmath)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgen.cpu import int16_rounding


def numpy_rounding(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xq, dx, xs) by the rule: per block of 32, top = the largest |x|, dx = top / 32767, xq = x (32767 /
    top) rounded half to even (0 where top is 0), xs the block's sum added as lanes l, l + 8, l + 16, l + 24
    first, then neighbouring pairs."""
    b = x.reshape(x.shape[0], -1, 32)
    top = np.abs(b).max(-1)
    dx = top / np.float32(32767)
    inv = np.where(top > 0, np.float32(32767) / np.where(top > 0, top, np.float32(1)), np.float32(0))
    xq = np.rint(b * inv[..., None]).astype(np.int16).reshape(x.shape)
    s8 = (b[..., 0:8] + b[..., 8:16]) + (b[..., 16:24] + b[..., 24:32])
    s4 = s8[..., 0::2] + s8[..., 1::2]
    s2 = s4[..., 0::2] + s4[..., 1::2]
    return xq, dx, s2[..., 0] + s2[..., 1]


def activations(rows: int, k: int, seed: int) -> np.ndarray:
    """Random rows of very different sizes, with a block of zeros and a block whose inputs sit on
    half steps of their scale (32767 / top times each is an odd number of halves: rint's ties)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-6, 6, (rows, 1))).astype(np.float32)
    x[0, :32] = 0
    if k >= 64:
        x[-1, 32:64] = np.float32(32767) / 65534 * rng.choice([-1, 1, 3, -5], 32)
        x[-1, 32] = 5 * np.float32(32767) / 65534  # the block's top: every input is (2j + 1) / 2 steps
    return x


@pytest.mark.parametrize("rows", [1, 15, 16, 37])  # under and over ROUND_IN_PARALLEL: one loop, or cut in parts
def test_quantize_is_the_rule_bit_for_bit(rows):
    x = activations(rows, 96, seed=rows)
    xq, dx, xs = int16_rounding.quantize(x)
    want = numpy_rounding(x)
    assert xq.dtype == np.int16 and dx.dtype == xs.dtype == np.float32
    for got, ref in zip((xq, dx, xs), want, strict=True):
        assert got.shape == ref.shape and np.array_equal(got, ref)
    assert not xq[0, :32].any() and dx[0, 0] == 0  # the block of zeros: codes and scale 0
    step = np.repeat(dx.astype(np.float64), 32, 1)  # within half a step (and x (32767 / top)'s float32 rounding)
    assert (np.abs(xq * step - x) <= step * (0.5 + 1e-3)).all()


def test_round_rows_writes_the_front_of_a_scratch_and_reads_a_view():
    """round_rows fills the front of a larger flat scratch (a decode step's, reused across widths) and
    rounds a strided view of x as its contiguous copy."""
    room = int16_rounding.scratch(8, 256)
    base = activations(5, 192, seed=3)
    x = base[:, 32:160]  # a view: its rows 192 apart
    xq, dx, xs = int16_rounding.round_rows(x, *room)
    assert xq.shape == (5, 128) and dx.shape == xs.shape == (5, 4)
    assert np.shares_memory(xq, room[0]) and np.shares_memory(dx, room[1])
    for got, ref in zip((xq, dx, xs), numpy_rounding(np.ascontiguousarray(x)), strict=True):
        assert np.array_equal(got, ref)


def test_a_row_rounds_the_same_alone_or_among_many():
    x = activations(40, 64, seed=5)
    together = int16_rounding.quantize(x)
    for r in (0, 17, 39):
        alone = int16_rounding.quantize(x[r:r + 1].copy())
        assert all(np.array_equal(a[0], t[r]) for a, t in zip(alone, together, strict=True))


def test_half_sums_add_each_16_inputs_left_to_right():
    x = activations(3, 96, seed=7)
    xs = int16_rounding.half_sums(x, np.empty(3 * 96 // 16 + 5, np.float32))
    want = np.cumsum(x.reshape(3, 6, 16), axis=-1, dtype=np.float32)[..., -1]  # numpy's add.accumulate: in order
    assert xs.shape == (3, 6) and np.array_equal(xs, want)
