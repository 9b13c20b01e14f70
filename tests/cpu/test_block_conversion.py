"""block_conversion.py: the compiled loops that write a GGUF tensor's blocks in the kernels' layouts at load
(FileBlocks) against WeightBlocks' numpy parse, the readable reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvgen.cpu.block_conversion import AS_FILED, COMPILED_TYPES
from kvgen.cpu.weight_blocks import BLOCK_TYPES, FileBlocks, WeightBlocks
from tests.cpu.test_weight_blocks import Q, random_blocks, width


def test_every_type_has_a_compiled_conversion():
    assert set(BLOCK_TYPES) == set(AS_FILED) | set(COMPILED_TYPES) and not set(AS_FILED) & set(COMPILED_TYPES)


@pytest.mark.parametrize("qtype", [getattr(Q, t) for t in COMPILED_TYPES], ids=lambda q: q.name)
def test_the_compiled_conversion_is_the_numpy_parse_bit_for_bit(qtype):
    """The compiled loops that write a type's codes and scales straight from the file's bytes give the numpy
    parse's blocks (WeightBlocks._parsed), every bit of every block at random. (AS_FILED's codes are the file's
    bytes, gathered: test_weight_blocks' dequantize tests cover them.)"""
    k = width(qtype, 1024)
    raw = random_blocks(qtype, 40, k, seed=3)
    fast = WeightBlocks.from_gguf(qtype.name, raw)
    assert isinstance(fast, FileBlocks)
    slow = WeightBlocks._parsed(qtype.name, raw.reshape(40, -1, BLOCK_TYPES[qtype.name][1]))
    assert (fast.kind, fast.layout) == (slow.kind, slow.layout)
    for name in ("qs", "d", "m", "ds", "ms"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
