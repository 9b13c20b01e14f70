"""y = x W^T for a weight in GGUF blocks, as the model and the fused step call it: the activations
rounded to int16 per block of 32 (vector_matmul's rule), then the products on AMX tiles for a call
of AMX_FROM (12) rows or more where the CPU has them (amx_matmul.py), else vector_matmul's vector
kernels.
Both give every row the same bits, so which one ran never shows in a row's output. The kinds with
no tile kernels (q4i, q3h, q2hm, q8h, q8hm and the packed q5, q5m, q6h: weight_blocks.BLOCK_TYPES) run on the
vector kernels at every row count. Under CPU_ACTIVATIONS=int8 (features.INT8) the q4, q8, q5, q5m and q6h kinds
(Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) take int8_matmul.py's kernels instead, at every row count:
activations rounded to int8, not int16, so a row's output still does not depend on the others. q4i, q3h, q2hm
(IQ4_NL, IQ4_XS, Q3_K, Q2_K) and q8h, q8hm (no file type) keep int16 there too."""

from __future__ import annotations

from numba import njit

from kvgen.cpu import amx_matmul, features, int8_matmul, int16_rounding, vector_matmul

# A plain global, so that Numba prunes the tiles' branch where it is False: a build without
# AMX-INT8 cannot even compile their intrinsics.
AMX = features.AMX
INT8 = features.INT8


@njit(cache=True, nogil=True)
def q4_linear(x, qs, scales, layout, y, room):  # pragma: no cover - compiled
    """y = x W^T for a Q4_0 / Q4_1 / Q4_K weight in blocks (scales in vector_matmul's `layout`): x
    rounded to int16 into room (a scratch), then the block kernels: AMX tiles for AMX_FROM rows or
    more where the CPU has them, else the vector kernels (the same bits)."""
    if INT8:  # CPU_ACTIVATIONS=int8: every row count (features.py)
        int8_matmul.q4_linear_int8(x, qs, scales, layout, y)
        return
    xq, dx, xs = int16_rounding.round_rows(x, room[0], room[1], room[2])
    if AMX and x.shape[0] >= amx_matmul.AMX_FROM:
        amx_matmul.q4_matmul(xq, dx, xs, qs, scales, layout, y)
    else:
        vector_matmul.q4_matmul(xq, dx, xs, qs, scales, layout, y)


@njit(cache=True, nogil=True)
def q8_linear(x, qs, scales, layout, y, room):  # pragma: no cover - compiled
    """y = x W^T for a Q8_0 weight in blocks (as q4_linear)."""
    if INT8:
        int8_matmul.q8_linear_int8(x, qs, scales, layout, y)
        return
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    if AMX and x.shape[0] >= amx_matmul.AMX_FROM:
        amx_matmul.q8_matmul(xq, dx, qs, scales, layout, y)
    else:
        vector_matmul.q8_matmul(xq, dx, qs, scales, layout, y)


# The kinds below have no tile kernels: they run on the vector kernels at every row count.

@njit(cache=True, nogil=True)
def q4i_linear(x, qs, scales, layout, y, room):  # pragma: no cover - compiled
    """y = x W^T for nibbles indexing IQ4's 16 values, a scale per block (IQ4_NL: F16; IQ4_XS: SUB)."""
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q4i_matmul(xq, dx, qs, scales, layout, y)


@njit(cache=True, nogil=True)
def q3h_linear(x, qs, scales, y, room):  # pragma: no cover - compiled
    """y = x W^T for packed 3-bit codes with a scale per 16 inputs (Q3_K)."""
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q3h_matmul(xq, dx, qs, scales, y)


@njit(cache=True, nogil=True)
def q2hm_linear(x, qs, scales, y, room, sums):  # pragma: no cover - compiled
    """y = x W^T for packed 2-bit codes with a scale and a minimum per 16 inputs (Q2_K); sums as
    q8hm_linear's."""
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q2hm_matmul(xq, dx, int16_rounding.half_sums(x, sums), qs, scales, y)


@njit(cache=True, nogil=True)
def q8h_linear(x, qs, scales, y, room):  # pragma: no cover - compiled
    """y = x W^T for int8 codes with a scale per 16 inputs (Q3_K)."""
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q8h_matmul(xq, dx, qs, scales, y)


@njit(cache=True, nogil=True)
def q8hm_linear(x, qs, scales, y, room, sums):  # pragma: no cover - compiled
    """y = x W^T for int8 codes with a scale and a minimum per 16 inputs (Q2_K); sums: a flat
    float32 scratch of M K / 16 for x's sums per 16 inputs."""
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q8hm_matmul(xq, dx, int16_rounding.half_sums(x, sums), qs, scales, y)


@njit(cache=True, nogil=True)
def q5_linear(x, qs, scales, y, room):  # pragma: no cover - compiled
    """y = x W^T for packed 5-bit codes with a scale per block (Q5_0)."""
    if INT8:
        int8_matmul.q5_linear_int8(x, qs, scales, y)
        return
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q5_matmul(xq, dx, qs, scales, y)


@njit(cache=True, nogil=True)
def q5m_linear(x, qs, scales, layout, y, room):  # pragma: no cover - compiled
    """y = x W^T for packed 5-bit codes with a scale and a minimum per block (Q5_1, Q5_K)."""
    if INT8:
        int8_matmul.q5m_linear_int8(x, qs, scales, layout, y)
        return
    xq, dx, xs = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q5m_matmul(xq, dx, xs, qs, scales, layout, y)


@njit(cache=True, nogil=True)
def q6h_linear(x, qs, scales, y, room):  # pragma: no cover - compiled
    """y = x W^T for packed 6-bit codes with a scale per 16 inputs (Q6_K)."""
    if INT8:
        int8_matmul.q6h_linear_int8(x, qs, scales, y)
        return
    xq, dx, _ = int16_rounding.round_rows(x, room[0], room[1], room[2])
    vector_matmul.q6h_matmul(xq, dx, qs, scales, y)
