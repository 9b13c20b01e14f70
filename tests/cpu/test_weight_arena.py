"""WeightArena (weight_arena.py): the buffer a GGUF file's tiles are written into, which the fused step reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgen.cpu.weight_arena import ALIGN, WeightArena
from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks, tile_bytes_bound
from tests.cpu.test_weight_blocks import ALL_TYPES, random_blocks, width


def test_arrays_are_carved_aligned_and_apart_then_from_the_heap_when_full():
    arena = WeightArena(1000)
    a = arena.empty((3, 5), np.float32)
    b = arena.empty((7,), np.int8)
    assert a.ctypes.data % ALIGN == 0 and b.ctypes.data % ALIGN == 0
    assert arena.offset(a) is not None and arena.offset(b) >= arena.offset(a) + a.nbytes
    a[...], b[...] = 1.5, -3  # apart: writing one leaves the other
    assert (a == 1.5).all() and (b == -3).all()
    room = arena.room
    c = arena.empty((room + 1,), np.uint8)  # does not fit: a heap array, which the arena does not hold
    assert c.shape == (room + 1,) and arena.offset(c) is None and arena.room == room
    assert arena.offset(np.empty(4, np.uint8)) is None


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_a_files_tiles_in_its_arena_are_the_heaps_bits_within_the_bound(qtype):
    """Every type's tiles written into an arena sized by tile_bytes_bound (rows not a whole tile, two
    tensors fused as q|k|v are) lie in it and equal the tiles written on the heap; the products too."""
    k = width(qtype, 96)
    raws = [random_blocks(qtype, n, k, seed=n) for n in (40, 23)]
    arena = WeightArena(sum(tile_bytes_bound(qtype.name, r.shape[0], k) for r in raws))
    in_arena = BlockLinear(WeightBlocks.cat([WeightBlocks.from_gguf(qtype.name, r, arena) for r in raws]), None)
    on_heap = BlockLinear(WeightBlocks.cat([WeightBlocks.from_gguf(qtype.name, r) for r in raws]), None)
    assert in_arena.arena is arena and on_heap.arena is None
    for name in ("qs", "scales"):
        got, want = getattr(in_arena, name), getattr(on_heap, name)
        assert arena.offset(got) is not None and got.dtype == want.dtype and np.array_equal(got, want)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    assert torch.equal(in_arena(x), on_heap(x))
