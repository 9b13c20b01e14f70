"""Numba CPU kernels: y = x W^T with W in GGUF's own blocks (Q4_0 / Q4_1 / Q8_0), fp32 activations.

At batch 1 a decode step reads every weight once, so its speed is the weights' bytes over the
memory bandwidth: Q4_1 is 5 bits a weight against fp32's 32. torch's packed int4 / int8 CPU ops
are fast only with bf16 activations (and scales), which lose the file's fidelity and are slow on
CPUs without bf16 instructions; these keep the activations in fp32 and compute exactly what a
dequantized fp32 matmul computes, up to the order of the sums.

Layout (blocks.py makes it): the output rows are cut in tiles of TILE rows, and inside a tile the
TILE rows' bytes for one input position sit side by side, so the innermost loop runs over the
tile's rows with contiguous loads and compiles to AVX2 / AVX-512 vector code on whatever CPU the
kernel is compiled on (LLVM targets the host). Each output element is summed in the same order
whatever the batch, so a row's result does not depend on the other rows.

    q4: qs [N/TILE, G, 16, TILE] uint8, ggml's nibble order: byte j of a block holds input j
        (low nibble) and input j + 16 (high); value = d * q + m (Q4_0: m = -8 d)
    q8: qs [N/TILE, G, 32, TILE] int8; value = d * q
    d, m: [N/TILE, G, TILE] float32;  x [M, K] float32 contiguous;  y [M, N] float32

The kernels release the GIL (nogil): the engine thread runs them while the server's event loop
goes on serving other calls, as it does during torch's ops.

Threads: the kernels run on Numba's OpenMP layer. It links the system's libgomp by a file name
torch's bundled copy does not answer to, so the engine thread holds two worker pools, torch's and
this one (threads.py says why extra pools cost). The measured speeds include that cost. A fused
step runs almost nothing in torch, so there the two pools do not compete. Sharing torch's pool
would take loading torch's libgomp under the name Numba asks for; that is not done.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

# Output rows per tile (measured: 64 beat 32 and 128 on a 2-core AVX2 EPYC). The kernels read it
# from the array's shape: with the constant in the loops, LLVM unrolled them into code 4x slower.
TILE = 64
numba.config.THREADING_LAYER = "omp"  # the same runtime kind as torch's (see Threads above)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def q4_matmul(x, xsum, qs, d, m, y):  # pragma: no cover - compiled
    """xsum [M, G]: each block's sum of x (the m term of every row of the block)."""
    rows = x.shape[0]
    tiles, groups, tile = qs.shape[0], qs.shape[1], qs.shape[-1]  # tile at run time: see TILE
    for t in prange(tiles):
        s = np.empty(tile, np.float32)
        acc = np.empty(tile, np.float32)
        for r in range(rows):
            acc[:] = 0
            for g in range(groups):
                s[:] = 0
                for j in range(16):  # low nibbles, then high: two simple loops vectorize better than one
                    lo = x[r, g * 32 + j]
                    for c in range(tile):
                        s[c] += lo * np.float32(qs[t, g, j, c] & 15)
                for j in range(16):
                    hi = x[r, g * 32 + 16 + j]
                    for c in range(tile):
                        s[c] += hi * np.float32(qs[t, g, j, c] >> 4)
                xs = xsum[r, g]
                for c in range(tile):
                    acc[c] += d[t, g, c] * s[c] + m[t, g, c] * xs
            for c in range(tile):
                y[r, t * tile + c] = acc[c]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def q8_matmul(x, qs, d, y):  # pragma: no cover - compiled
    rows = x.shape[0]
    tiles, groups, tile = qs.shape[0], qs.shape[1], qs.shape[-1]  # tile at run time: see TILE
    for t in prange(tiles):
        s = np.empty(tile, np.float32)
        acc = np.empty(tile, np.float32)
        for r in range(rows):
            acc[:] = 0
            for g in range(groups):
                s[:] = 0
                for j in range(32):
                    xj = x[r, g * 32 + j]
                    for c in range(tile):
                        s[c] += xj * np.float32(qs[t, g, j, c])
                for c in range(tile):
                    acc[c] += d[t, g, c] * s[c]
            for c in range(tile):
                y[r, t * tile + c] = acc[c]


# Several rows: the tile's codes are converted to floats once per block and every row reuses them
# (the one-row kernels above convert per row, which costs more than the multiply from 2 rows on).

@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def q4_matmul_rows(x, xsum, qs, d, m, y):  # pragma: no cover - compiled
    rows = x.shape[0]
    tiles, groups, tile = qs.shape[0], qs.shape[1], qs.shape[-1]
    for t in prange(tiles):
        w = np.empty((32, tile), np.float32)
        s = np.empty(tile, np.float32)
        acc = np.zeros((rows, tile), np.float32)
        for g in range(groups):
            for j in range(16):
                for c in range(tile):
                    w[j, c] = np.float32(qs[t, g, j, c] & 15)
                for c in range(tile):
                    w[j + 16, c] = np.float32(qs[t, g, j, c] >> 4)
            for r in range(rows):
                s[:] = 0
                for k in range(32):
                    xk = x[r, g * 32 + k]
                    for c in range(tile):
                        s[c] += xk * w[k, c]
                xs = xsum[r, g]
                for c in range(tile):
                    acc[r, c] += d[t, g, c] * s[c] + m[t, g, c] * xs
        for r in range(rows):
            for c in range(tile):
                y[r, t * tile + c] = acc[r, c]


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def q8_matmul_rows(x, qs, d, y):  # pragma: no cover - compiled
    rows = x.shape[0]
    tiles, groups, tile = qs.shape[0], qs.shape[1], qs.shape[-1]
    for t in prange(tiles):
        w = np.empty((32, tile), np.float32)
        s = np.empty(tile, np.float32)
        acc = np.zeros((rows, tile), np.float32)
        for g in range(groups):
            for k in range(32):
                for c in range(tile):
                    w[k, c] = np.float32(qs[t, g, k, c])
            for r in range(rows):
                s[:] = 0
                for k in range(32):
                    xk = x[r, g * 32 + k]
                    for c in range(tile):
                        s[c] += xk * w[k, c]
                for c in range(tile):
                    acc[r, c] += d[t, g, c] * s[c]
        for r in range(rows):
            for c in range(tile):
                y[r, t * tile + c] = acc[r, c]
