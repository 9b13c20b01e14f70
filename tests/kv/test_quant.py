"""Quantizers of kvgen.engine.kv.quant: error bounds, exact layouts, packing, codebook fitting."""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvgen.engine.kv import quant

SETTINGS = settings(max_examples=100, deadline=None)
TINY = 1e-6  # absolute slack for values whose float16 scale underflows or is subnormal


@st.composite
def tensors(draw, min_dim=8):
    """[rows, D] float32 with zeros, an all-zero group, an outlier, negatives, any magnitude."""
    rows = draw(st.integers(1, 4))
    d = draw(st.sampled_from([d for d in (8, 16, 32, 64, 128) if d >= min_dim]))
    elems = st.floats(-1.0, 1.0, width=32, allow_subnormal=False) | st.just(0.0)
    x = torch.from_numpy(draw(arrays(np.float32, (rows, d), elements=elems))).clone()
    x *= 10.0 ** draw(st.integers(-4, 3))
    if draw(st.booleans()):
        r, start = draw(st.integers(0, rows - 1)), draw(st.sampled_from(range(0, d, 8)))
        x[r, start:start + 8] = 0
    if draw(st.booleans()):
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, d - 1))
        x[r, c] = draw(st.sampled_from([1e4, -1e4, 300.0, -3e3]))
    return x


def with_group(groups=(8, 16, 32)):
    return st.sampled_from(groups).flatmap(lambda g: st.tuples(tensors(min_dim=g), st.just(g)))


def group_absmax(x, group):
    return x.reshape(*x.shape[:-1], -1, group).abs().amax(-1, keepdim=True)


def per_elem(t, group):
    """[..., D // group] -> [..., D], each group's value repeated over its elements."""
    return t.repeat_interleave(group, dim=-1)


# --- fp8 ---------------------------------------------------------------------------------------

@SETTINGS
@given(tensors())
def test_fp8_round_trip_bound(x):
    scale = x.abs().amax(-1, keepdim=True) / quant.FP8_MAX
    q = quant.fp8_quantize(x, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    err = (quant.fp8_dequantize(q, scale) - x).abs()
    # E4M3: 3 mantissa bits -> half an ulp is 2^-4 relative; below 2^-6 (subnormal) the step
    # is 2^-9, so absolute 2^-10 * scale.
    assert (err <= (2**-4 * x.abs() + 2**-10 * scale) * (1 + 1e-6)).all()
    assert (err <= 2**-4 * x.abs().amax(-1, keepdim=True) * (1 + 1e-6)).all()


def test_divide_is_the_correctly_rounded_quotient():
    # The scales' divisions must round like the kernels' IEEE "/": the float64 quotient of two
    # float32 values rounded once to float32 is exactly that. (The GPU half runs this on CUDA,
    # where torch's x / 448.0 multiplies by a rounded reciprocal instead.)
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 1000
    for c in (quant.FP8_MAX, 7.0):
        want = (x.double() / c).float()
        assert torch.equal(quant.divide(x, c), want)


def test_fp8_zero_scale_and_saturation():
    x = torch.tensor([[1.0, -2.0], [1000.0, -1000.0]])
    q = quant.fp8_quantize(x, torch.tensor([[0.0], [1.0]]))
    assert q.float().tolist() == [[0.0, 0.0], [448.0, -448.0]]
    assert quant.fp8_dequantize(q, torch.tensor([[0.0], [2.0]])).dtype == torch.float32


def test_fp8_rounds_to_nearest_even():
    # Between 1 and 2 the E4M3 step is 1/8: 1 + 1/16 is a tie and goes to the even 1.0.
    x = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 1 + 1 / 16 + 1e-3])
    assert quant.fp8_quantize(x, torch.tensor(1.0)).float().tolist() == [1.0, 1.25, 1.125]


# --- q4 ----------------------------------------------------------------------------------------

@SETTINGS
@given(with_group())
def test_q4_round_trip_bound(xg):
    x, group = xg
    packed, scales = quant.q4_quantize(x, group)
    d = x.shape[-1]
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], d // 2)
    assert scales.dtype == torch.float16 and scales.shape == (*x.shape[:-1], d // group)
    y = quant.q4_dequantize(packed, scales, group)
    assert y.dtype == torch.float32 and y.shape == x.shape
    s = per_elem(scales.float(), group)
    assert ((y - x).abs() <= s * (0.5 + 1e-6) + TINY).all()
    # The scale is absmax / 7 in float16, so the bound is also absmax / 14 (up to fp16 rounding).
    assert ((y - x).abs() <= per_elem(group_absmax(x, group)[..., 0], group) / 14 * (1 + 2**-10) + TINY).all()
    # All-zero groups come back as exact zeros.
    zero = per_elem(group_absmax(x, group)[..., 0] == 0, group)
    assert (y[zero] == 0).all()


@SETTINGS
@given(with_group())
def test_q4_requantize_is_identity(xg):
    x, group = xg
    packed, scales = quant.q4_quantize(x, group)
    # A subnormal float16 scale (absmax < 7 * 2^-14) can round down enough to give code -8.
    assume(((scales == 0) | (scales >= 2**-14)).all())
    p2, s2 = quant.q4_quantize(quant.q4_dequantize(packed, scales, group), group)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)


def test_q4_exact_layout():
    # absmax 7 -> scale 1: codes are round-half-even(x) + 8; element 2i is the low nibble.
    x = torch.tensor([[7.0, -7.0, 2.5, 3.5, -0.5, 0.0, 1.0, -3.0]])
    packed, scales = quant.q4_quantize(x, 8)
    assert scales.tolist() == [[1.0]]
    codes = [15, 1, 10, 12, 8, 8, 9, 5]
    assert packed.tolist() == [[codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(4)]]
    assert quant.q4_unpack(packed).tolist() == [codes]


def test_q4_pack_is_bijective():
    b = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    q = quant.q4_unpack(b)
    assert torch.equal((q[..., 0::2] | (q[..., 1::2] << 4)), b)


# --- q3 ----------------------------------------------------------------------------------------

def q3_error_bound_y(codebook):
    """Largest |y - nearest centroid| over y in [-1, 1] (plus float16 rounding of the scale)."""
    c = codebook.double()
    half_gap = ((c[1:] - c[:-1]) / 2).max()
    return float(max(half_gap, c[0] + 1, 1 - c[-1])) + 2**-10


codebooks = st.one_of(
    st.just(quant.normal_codebook()),
    arrays(np.float32, 8, elements=st.floats(-1, 1, width=32)).map(lambda a: torch.from_numpy(np.sort(a))),
    arrays(np.float32, 6, elements=st.floats(-1, 1, width=32)).map(
        lambda a: torch.tensor([-1.0, *np.sort(a), 1.0])),
)


@SETTINGS
@given(with_group(), codebooks)
def test_q3_round_trip_bound(xg, codebook):
    x, group = xg
    packed, scales = quant.q3_quantize(x, codebook, group)
    d = x.shape[-1]
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], d * 3 // 8)
    assert scales.dtype == torch.float16 and scales.shape == (*x.shape[:-1], d // group)
    y = quant.q3_dequantize(packed, scales, codebook, group)
    assert y.dtype == torch.float32 and y.shape == x.shape
    s = per_elem(scales.float(), group)
    assert ((y - x).abs() <= s * q3_error_bound_y(codebook) + TINY).all()
    # Nearest centroid: no other centroid is closer (in the normalised domain).
    yn = torch.where(s > 0, x / torch.where(s > 0, s, 1), 0)
    idx = quant.q3_unpack(packed)
    dist = (yn.unsqueeze(-1) - codebook).abs()
    assert (dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= dist.min(-1).values).all()


@SETTINGS
@given(with_group(), st.integers(0, 3))
def test_q3_requantize_is_identity(xg, seed):
    x, group = xg
    # With the ends at -1, +1 (the default and every fitted codebook) each group's absmax element
    # maps to an end, so dequantized values requantize to the same bytes and scales. Not with a
    # subnormal float16 scale (absmax < 2^-14): its rounding can move the absmax element off the end.
    g = torch.Generator().manual_seed(seed)
    cb = quant.fit_codebook(torch.rand(500, generator=g) * 2 - 1) if seed else quant.normal_codebook()
    packed, scales = quant.q3_quantize(x, cb, group)
    assume(((scales == 0) | (scales >= 2**-14)).all())
    p2, s2 = quant.q3_quantize(quant.q3_dequantize(packed, scales, cb, group), cb, group)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)


def test_q3_exact_layout_and_ties():
    cb = torch.tensor([-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0])
    # absmax 1 -> scale 1, y = x; indices 0..7 pack to bits sum(j << 3j) = 0xFAC688.
    x = cb.clone().unsqueeze(0)
    packed, scales = quant.q3_quantize(x, cb, 8)
    assert scales.tolist() == [[1.0]] and packed.tolist() == [[0x88, 0xC6, 0xFA]]
    # 0.125 and 0.75 are exactly between two centroids: the lower index wins.
    x = torch.tensor([[1.0, 0.125, 0.75, -0.875, 0.3, 0.0, 0.0, 0.0]])
    idx = quant.q3_unpack(quant.q3_quantize(x, cb, 8)[0])
    assert idx.tolist() == [[7, 4, 6, 0, 5, 4, 4, 4]]


def test_q3_zero_group_and_leading_dims():
    x = torch.zeros(2, 3, 16)
    x[1, 2, 8:] = torch.arange(8.0)
    packed, scales = quant.q3_quantize(x, quant.normal_codebook(), 8)
    assert packed.shape == (2, 3, 6) and scales.shape == (2, 3, 2)
    y = quant.q3_dequantize(packed, scales, quant.normal_codebook(), 8)
    # All-zero groups decode to zeros (a zero inside a nonzero group decodes to the nearest
    # centroid, which the default codebook does not have at 0).
    assert (y[:, :, :8] == 0).all() and (y[0] == 0).all() and y[1, 2, 15] == 7.0


def test_q3_pack_is_bijective():
    b = torch.randint(0, 256, (5, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    idx = quant.q3_unpack(b)
    assert idx.shape == (5, 64) and idx.max() <= 7
    assert torch.equal(quant.q3_pack(idx), b)


def test_shape_errors():
    with pytest.raises(ValueError):
        quant.q4_quantize(torch.zeros(2, 24), 16)
    with pytest.raises(ValueError):
        quant.q3_quantize(torch.zeros(2, 12), quant.normal_codebook(), 4)


# --- codebook ----------------------------------------------------------------------------------

def test_normal_codebook():
    c = quant.normal_codebook()
    assert c.dtype == torch.float32 and c[0] == -1 and c[-1] == 1
    assert (c[1:] > c[:-1]).all() and torch.allclose(c, -c.flip(0))


def test_fit_codebook_deterministic_and_better():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(20000, generator=g).clamp(-3, 3) / 3 * 0.4  # concentrated near 0
    w = torch.rand(20000, generator=g)
    c = quant.fit_codebook(y, w)
    assert torch.equal(c, quant.fit_codebook(y, w))
    assert c.dtype == torch.float32 and c.shape == (8,) and (c[1:] >= c[:-1]).all()
    assert c[0] == -1 and c[-1] == 1

    def werr(cb):
        return (w * (y.unsqueeze(-1) - cb).abs().min(-1).values ** 2).sum()

    assert werr(c) < 0.5 * werr(quant.normal_codebook())
    # Subsampling is seeded.
    a = quant.fit_codebook(y, w, max_samples=1000, seed=3)
    assert torch.equal(a, quant.fit_codebook(y, w, max_samples=1000, seed=3))


def test_fit_codebook_weights_pull_centroids():
    y = torch.linspace(-1, 1, 4001)
    plain = quant.fit_codebook(y)
    right = quant.fit_codebook(y, torch.exp(4 * y))
    assert torch.allclose(plain, -plain.flip(0), atol=1e-3)  # symmetric data: ~symmetric codebook
    assert (right[1:7] > plain[1:7]).all()  # every inner centroid moves to the heavy side


def test_fit_codebook_empty():
    assert torch.equal(quant.fit_codebook(torch.zeros(0)), quant.normal_codebook())
