"""One buffer that a model's block weights are carved from, codes and scales of every kind alike.

The fused decode step reads every weight from flat byte buffers at offsets in its table
(decode_step._linear). When the loader writes each BlockLinear's tiles into one arena, the step takes
the arena itself as that buffer and nothing is copied: a second write of the whole model into fresh
memory was 0.7-0.9 s of a 1.7B model's 4.1 s start (#41), and a second model-sized peak.

The buffer is reserved, not filled: its pages are only made when an array carved from it is written,
so an arena sized by an upper bound (weight_blocks.tile_bytes_bound) costs the bytes used, no more.
"""

from __future__ import annotations

import numpy as np

ALIGN = 64  # every array starts on a cache line


class WeightArena:
    def __init__(self, nbytes: int):
        self.buf = np.empty(max(nbytes, ALIGN), np.uint8)  # numpy asks for huge pages at this size
        self._base = self.buf.ctypes.data
        self._at = -self._base % ALIGN

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array from the arena; from the heap once the arena is full (the
        step then copies the weights it holds: fused_decode._Weights)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self._at + n > self.buf.size:
            return np.empty(shape, dtype)
        a = self.buf[self._at:self._at + n].view(dtype).reshape(shape)
        self._at += n + -n % ALIGN
        return a

    def offset(self, a: np.ndarray) -> int | None:
        """Where a (C-contiguous) lies in the arena, in bytes; None if it is not inside it."""
        at = a.ctypes.data - self._base
        return at if 0 <= at and at + a.nbytes <= self.buf.size and a.flags.c_contiguous else None

    @property
    def room(self) -> int:
        """Bytes left to carve (alignment included)."""
        return self.buf.size - self._at
