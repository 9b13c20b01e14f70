"""WeightArena (weight_arena.py): the buffer a GGUF file's tiles are written into, which the fused step reads."""

from __future__ import annotations

import os

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


def test_a_saved_arena_maps_back_and_replays_its_carves_over_its_bytes(tmp_path):
    """save writes the carves counted (not those after), as a file of the arena's size whose room past them
    takes no disk; mapped gives writable arrays over those bytes at the same offsets, copy-on-write (the file
    stays as saved), then carves fresh room; another order of carves, another bound, meta or file is refused."""
    from kvgen.cpu.weight_arena import StaleArena

    arena = WeightArena(1 << 20)
    a, b = arena.empty((3, 5), np.float32), arena.empty(7, np.int8)
    a[...], b[...] = np.arange(15).reshape(3, 5), -3
    arena.empty(100, np.uint8)[...] = 9  # carved after the count: not saved
    path = str(tmp_path / "arena")
    arena.save(path, {"key": 1}, 2)
    assert WeightArena.meta_of(path) == {"key": 1} and os.stat(path).st_blocks * 512 < 64 << 10
    mapped = WeightArena.mapped(path, 1 << 20, {"key": 1})
    assert mapped.replaying and mapped.room == arena.buf.size
    a2 = mapped.empty((3, 5), np.float32)
    b2 = mapped.empty((7,), np.int8)
    assert not mapped.replaying and np.array_equal(a2, a) and (b2 == -3).all()
    assert (mapped.offset(a2), mapped.offset(b2)) == (arena.offset(a), arena.offset(b))
    a2[...], fresh = 0, mapped.empty(100, np.uint8)
    assert (fresh == 0).all() and mapped.offset(fresh) == arena.offset(b) + ALIGN
    again = WeightArena.mapped(path, 1 << 20, {"key": 1})
    assert np.array_equal(again.empty((3, 5), np.float32), a)  # the file as saved
    with pytest.raises(StaleArena):
        WeightArena.mapped(path, 1 << 20, {"key": 1}).empty((5, 3), np.float32)
    assert WeightArena.mapped(path, 1 << 19, {"key": 1}) is None
    assert WeightArena.mapped(path, 1 << 20, {"key": 2}) is None
    (tmp_path / "other").write_bytes(b"GGUF" + bytes(100))
    other = str(tmp_path / "other")
    assert WeightArena.mapped(other, 1 << 20, {"key": 1}) is None and WeightArena.meta_of(other) is None
