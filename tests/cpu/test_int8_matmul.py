"""The int8-activation kernels (kvgen/cpu/int8_matmul.py, CPU_ACTIVATIONS=int8) of the q4, q8, q5, q5m and q6h
kinds: the rounding against numpy's, the sums against a numpy reference of the same arithmetic, the error against
gguf-py's fp32 weights within the int8 rounding's bound, and a row's bits alone and in a batch. It runs where the
CPU has AVX512-VNNI (vpdpbusd)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu import features, int8_matmul
from kvgen.cpu.vector_matmul import TILE
from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks
from tests.cpu.test_weight_blocks import quantized, width

Q = gguf.GGMLQuantizationType
Q4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)  # q4's three scale layouts: F16, F16_MIN, SUB_MIN
# every type the int8 kernels run: q4's, q8 (Q8_0), q5 (Q5_0), q5m (Q5_1: F16_MIN, Q5_K: SUB_MIN), q6h (Q6_K)
TYPES = (*Q4_TYPES, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)
N = 72  # not a multiple of TILE: the last tile padded as BlockLinear pads

# `make test-slow`, with the int8 build's suites (test_cpu_activations.py): CPU_ACTIVATIONS=int8 is opt-in, and
# compiling these kernels took ~40 s of `make test`'s 15 minutes
pytestmark = [pytest.mark.skipif(not features.VNNI, reason="this CPU has no AVX512-VNNI (vpdpbusd)"),
              pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    int8_matmul.compile_int8_kernels()  # the parallel callees first (numba/numba#8578)


def activations(rows: int, k: int, seed: int) -> np.ndarray:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).numpy()
    x[rows // 2, :32] *= 1e3  # a block of large values
    x[0, 32:64] = 0.0  # a zero block
    return x


def numpy_quantize(x: np.ndarray, halves: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The docstring's rounding in numpy float32: (codes [M, K] in input order, dx, xs, xi: a sum a block, or
    per 16 inputs)."""
    rows, k = x.shape
    b = x.reshape(rows, k // 32, 32)
    top = np.abs(b).max(-1)
    inv = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    dx = (top / np.float32(127)).astype(np.float32)
    xi = q.astype(np.int32).sum(-1).astype(np.int32)
    xs = (dx * xi.astype(np.float32)).astype(np.float32)
    if halves == 2:
        xi = q.astype(np.int32).reshape(rows, k // 32, 2, 16).sum(-1).reshape(rows, -1).astype(np.int32)
    return q.reshape(rows, k), dx, xs, xi


def test_quantize_rounds_as_numpy_and_lays_out_pairs():
    x = activations(37, 256, seed=1)
    xq, *sums = int8_matmul.quantize_int8(x)
    q, *want = numpy_quantize(x)
    assert np.array_equal(int8_matmul.unorder(xq), q)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(sums, want, strict=True))
    dx = sums[0]
    # dword p of a block: inputs 2p, 2p+1, 2p+16, 2p+17
    assert list(xq[3, 4:8]) == [q[3, 2], q[3, 3], q[3, 18], q[3, 19]]
    assert np.abs(q).max() == 127 and (q[0, 32:64] == 0).all() and dx[0, 1] == 0
    for r in (1, 15):  # fewer rows than ROUND_IN_PARALLEL: the serial loop, the same numbers
        assert all(np.array_equal(a, b[:r]) for a, b in zip(int8_matmul.quantize_int8(x[:r]), (xq, *sums),
                                                             strict=True))


@pytest.mark.parametrize("rows", [3, 37])  # the serial loop and the threads'
def test_quantize_by_halves_keeps_the_inputs_order_and_sums_each_half(rows):
    """q6h's rounding (halves 2): the same codes, in input order, an integer sum per 16 inputs; dx, xs as halves 1."""
    x = activations(rows, 256, seed=2)
    xq, *sums = int8_matmul.quantize_int8(x, 2)
    q, *want = numpy_quantize(x, 2)
    assert np.array_equal(xq, q) and np.array_equal(int8_matmul.unorder(xq, 2), q)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(sums, want, strict=True))
    assert sums[2].shape == (rows, 16) and np.array_equal(sums[2].reshape(rows, 8, 2).sum(-1),
                                                          int8_matmul.quantize_int8(x)[3])


def linear_int8(lin: BlockLinear, x: np.ndarray, y: np.ndarray) -> None:
    """y = x W^T on the int8 kernel of lin's kind (block_matmul's choice under CPU_ACTIVATIONS=int8)."""
    if lin.kind in ("q5", "q6h"):  # one layout each: no layout argument
        getattr(int8_matmul, f"{lin.kind}_linear_int8")(x, lin.qs, lin.scales, y)
    else:
        getattr(int8_matmul, f"{lin.kind}_linear_int8")(x, lin.qs, lin.scales, lin.layout, y)


def _case(qtype, rows: int):
    k = width(qtype, 160)
    raw, ref = quantized(qtype, N, k, seed=rows)
    blocks = WeightBlocks.from_gguf(qtype.name, raw)
    lin = BlockLinear(blocks, None)
    x = activations(rows, k, seed=rows)
    y = np.full((rows, lin.qs.shape[0] * TILE), np.nan, np.float32)
    linear_int8(lin, x, y)
    return blocks, lin, raw, ref, x, y


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 37])
def test_sums_are_the_reference_arithmetics(qtype, rows):
    """Exact integer dots of the weights' codes (less their offset: the integers the weights are made of) and
    the int8 activations, then per block d (dx dot) + m xs added over the blocks (Q4_0: d dx (dot - 8 xi); q6h:
    dx (d0 dot0 + d1 dot1), a dot and a scale per 16 inputs): the kernel's floats within float32 rounding of
    numpy's in float64."""
    blocks, lin, _, _, x, y = _case(qtype, rows)
    assert not np.isnan(y).any()
    q, dx, xs, xi = numpy_quantize(x)
    groups = x.shape[1] // 32
    codes = blocks.codes().numpy().astype(np.int64)  # [N, G, 32]: q4 0..15, the others less their offset
    d, m = (None if t is None else t.numpy().astype(np.float64) for t in blocks.block_scales())  # [N, G(, 2)]
    dx, xs = dx.astype(np.float64)[:, None], xs.astype(np.float64)[:, None]
    if lin.kind == "q6h":  # a dot and a scale per 16 inputs
        dots = np.einsum("rghi,cghi->rcgh", q.reshape(rows, groups, 2, 16).astype(np.int64),
                         codes.reshape(N, groups, 2, 16))
        terms = dx * (d[None] * dots).sum(-1)
    else:
        dots = np.einsum("rgi,cgi->rcg", q.reshape(rows, groups, 32).astype(np.int64), codes)
        if qtype == Q.Q4_0:  # the minimum in the integers: m = -8 d, xs = dx xi
            dots = dots - 8 * xi[:, None]
        terms = d[None] * (dx * dots)
        if m is not None and qtype != Q.Q4_0:
            terms = terms + m[None] * xs
    want, size = terms.sum(-1), np.abs(terms).sum(-1)
    assert (np.abs(y[:, :N] - want) <= 1e-5 * size + 1e-30).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_error_against_the_fp32_weights_is_int8_rounding(qtype, rows):
    """Against gguf-py's dequantized weights times x: within sum_i |w_i| dx / 2 (each activation
    within half a step), and well inside the fp32 product's size."""
    _, _, raw, ref, x, y = _case(qtype, rows)
    w = gguf.quants.dequantize(raw, qtype).reshape(N, -1).astype(np.float64)
    assert np.array_equal(w, ref)
    want = x.astype(np.float64) @ w.T
    step = np.repeat(numpy_quantize(x)[1].astype(np.float64), 32, axis=1)  # dx per input
    bound = (step / 2) @ np.abs(w).T + 1e-5 * (np.abs(x) @ np.abs(w).T)
    err = np.abs(y[:, :N] - want)
    assert (err <= bound).all()
    assert err.max() <= 0.05 * np.abs(x @ np.abs(w).T).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_row_does_not_depend_on_its_neighbours(qtype):
    """Rows in passes of 8, 4, 2 and 1, rounded by the threads from 16 rows: each row's output bits are those it
    gets alone."""
    _, lin, _, _, x, together = _case(qtype, 37)
    for i in (0, 7, 8, 35, 36):
        alone = np.empty((1, together.shape[1]), np.float32)
        linear_int8(lin, x[i:i + 1], alone)
        assert np.array_equal(alone[0], together[i])
