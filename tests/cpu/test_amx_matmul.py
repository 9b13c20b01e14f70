"""The AMX tile matmuls (amx_matmul.py): the same bits as vector_matmul's vector kernels, row for row,
for every weight kind, row count and tile split; the activations' bytes as the tiles read them.
They run where the CPU has AMX-INT8 and Linux grants it (elsewhere there is nothing to run)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu import amx_matmul, features, int16_rounding, vector_matmul
from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks
from tests.cpu.test_weight_blocks import TYPES, quantized, width

Q = gguf.GGMLQuantizationType
# the types of the kinds with tiles (q4, q8), one for each layout of their scales
# (vector_matmul.LAYOUTS): an fp16 d (and m, or Q4_0's -8 d) per block, or a super-block's
# fp16 d times an int8 a block (Q4_K; q8's SUB layout has no file type since IQ4_XS runs as q4i)
TILE_TYPES = (*TYPES, Q.Q4_K)

needs_amx = pytest.mark.skipif(not features.AMX, reason="this CPU (or Linux) gives no AMX-INT8: the vector "
                                                           "kernels run every step")


def _both(qtype, n: int, k: int, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(vector kernels' y, tile kernels' y) for one random weight and activation."""
    k = width(qtype, k)
    lin = BlockLinear(WeightBlocks.from_gguf(qtype.name, quantized(qtype, n, k, seed)[0]), None)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).numpy()
    x[rows // 2] *= 1e4  # a row of large activations: its int16 codes use their high bytes fully
    xq, dx, xs = int16_rounding.quantize(x)
    ys = [np.full((rows, lin.qs.shape[0] * vector_matmul.TILE), np.nan, np.float32) for _ in range(2)]
    if lin.kind == "q4":
        vector_matmul.q4_matmul(xq, dx, xs, lin.qs, lin.scales, lin.layout, ys[0])
        amx_matmul.q4_matmul(xq, dx, xs, lin.qs, lin.scales, lin.layout, ys[1])
    else:
        vector_matmul.q8_matmul(xq, dx, lin.qs, lin.scales, lin.layout, ys[0])
        amx_matmul.q8_matmul(xq, dx, lin.qs, lin.scales, lin.layout, ys[1])
    return ys[0], ys[1]


@needs_amx
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [12, 16, 17, 31, 70])
@pytest.mark.parametrize("n, k", [(72, 160), (960, 576), (16 * 17, 1536)])
def test_tiles_give_the_vector_kernels_bits(qtype, rows, n, k):
    """Bit-identical outputs for each scale layout: whole and padded row blocks (12, 17, 31, 70
    rows), an odd number of blocks (160 inputs; the super-block types' 512), weight tiles in pairs
    and alone (5 and 17 tiles over 2 threads, more than TILES_AT_ONCE), and every output written
    (none left NaN)."""
    vector, tiles = _both(qtype, n, k, rows, seed=rows)
    assert not np.isnan(tiles).any()
    assert np.array_equal(vector, tiles)


@needs_amx
def test_a_step_of_many_rows_takes_the_tiles_and_a_row_keeps_its_bits():
    """Through BlockLinear (what the model calls): 40 rows at once (tiles) give each row the bits
    it gets alone (vector kernels)."""
    assert amx_matmul.AMX_FROM <= 40
    lin = BlockLinear(WeightBlocks.from_gguf("Q4_1", quantized(TYPES[1], 96, 576)[0]), None)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5))
    together = lin(x)
    for i in (0, 17, 39):
        assert torch.equal(lin(x[i:i + 1])[0], together[i])


@needs_amx
def test_split_lays_out_each_rows_bytes_as_the_tiles_read_them():
    """256 hi + lo gives back every int16 (hi signed, lo unsigned), in [row block, block, lo | hi,
    16 rows, 32] order; the padding rows of the last block are not the data's."""
    rows, k = 37, 96
    xq = np.random.default_rng(0).integers(-32767, 32768, (rows, k)).astype(np.int16)
    out = amx_matmul.split(xq).reshape(3, k // 32, 2, 16, 32)
    lo = out[:, :, 0].transpose(0, 2, 1, 3).reshape(48, k)[:rows].astype(np.int32)
    hi = out[:, :, 1].view(np.int8).transpose(0, 2, 1, 3).reshape(48, k)[:rows].astype(np.int32)
    assert np.array_equal(256 * hi + lo, xq.astype(np.int32))
