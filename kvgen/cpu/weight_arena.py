"""One buffer that a model's block weights are carved from, codes and scales of every kind alike.

The fused decode step reads every weight from flat byte buffers at offsets in its table
(decode_step._linear). When the loader writes each BlockLinear's tiles into one arena, the step takes
the arena itself as that buffer and nothing is copied: a second write of the whole model into fresh
memory was 0.7-0.9 s of a 1.7B model's 4.1 s start (#41), and a second model-sized peak.

The buffer is reserved, not filled: its pages are only made when an array carved from it is written,
so an arena sized by an upper bound (weight_blocks.tile_bytes_bound) costs the bytes used, no more.

An arena can be saved to a file (save) and mapped back from it on a later start (mapped): the carves
are then replayed, each the same shape and dtype at the same offset as when it was saved, over bytes
already written, so the loader carves its arrays as before and skips writing them (`replaying`). The
mapping is private: the pages come from the page cache as they are read, a write copies only the page it
touches, and the file is never changed (engine/tile_cache.py decides when a saved arena may be used).
"""

from __future__ import annotations

import json
import mmap
import os

import numpy as np

ALIGN = 64  # every array starts on a cache line
MAGIC = b"kvgen-arena-1\n"
PAGE = mmap.PAGESIZE


class StaleArena(Exception):
    """A mapped arena's carves did not replay as saved: the loader asked for other arrays than those the
    file holds. Nothing carved from it may be used."""


class WeightArena:
    def __init__(self, nbytes: int, buf: np.ndarray | None = None, saved: list | None = None):
        if buf is None:
            raw = np.empty(max(nbytes, ALIGN) + ALIGN, np.uint8)  # numpy asks for huge pages at this size
            buf = raw[-raw.ctypes.data % ALIGN:][:max(nbytes, ALIGN)]
        self.buf = buf  # starts on a cache line: offsets are the same in a saved arena mapped back
        self._base = self.buf.ctypes.data
        self._at = 0
        self.carves: list[tuple[tuple[int, ...], str]] = []  # (shape, dtype) of every array carved, in order
        self._ends: list[int] = []  # where each carve ends (its alignment included)
        self.saved = saved or []  # the carves a mapped arena replays (empty: a new arena)

    @property
    def replaying(self) -> bool:
        """Whether the next carve replays a saved one: its bytes are already in place, to be read, not written."""
        return len(self.carves) < len(self.saved)

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous array from the arena (while `replaying`, the saved one's bytes); from
        the heap once the arena is full (the step then copies the weights it holds: fused_decode._Weights)."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        if self.replaying and self.saved[len(self.carves)] != (shape, dtype.str):
            raise StaleArena(f"carve {len(self.carves)} asks for {shape} {dtype.str}; the saved arena holds "
                             f"{self.saved[len(self.carves)]}")
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self._at + n > self.buf.size:
            return np.empty(shape, dtype)
        a = self.buf[self._at:self._at + n].view(dtype).reshape(shape)
        self._at += n + -n % ALIGN
        self._ends.append(self._at)
        self.carves.append((shape, dtype.str))
        return a

    def offset(self, a: np.ndarray) -> int | None:
        """Where a (C-contiguous) lies in the arena, in bytes; None if it is not inside it."""
        at = a.ctypes.data - self._base
        return at if 0 <= at and at + a.nbytes <= self.buf.size and a.flags.c_contiguous else None

    @property
    def room(self) -> int:
        """Bytes left to carve (alignment included)."""
        return self.buf.size - self._at

    def save(self, path: str, meta: dict, carves: int) -> None:
        """Write the first `carves` arrays carved (all written by then: a caller that goes on carving, in
        another thread, counts them first), their shapes and meta (the caller's key) to path, whole or not
        at all: into a file beside it, renamed over it when complete (a process that has the old file mapped
        keeps it). The file's size is the arena's: the room past the carves is a hole that takes no disk."""
        used = self._ends[carves - 1] if carves else 0
        head = json.dumps({"meta": meta, "size": self.buf.size, "carves": self.carves[:carves]}).encode()
        start, part = _data_start(len(head)), f"{path}.{os.getpid()}.part"
        try:
            with open(part, "wb") as f:
                f.write(MAGIC + len(head).to_bytes(8, "little") + head)
                f.seek(start)
                f.write(memoryview(self.buf[:used]))
                f.truncate(start + self.buf.size)
            os.replace(part, path)
        except BaseException:
            if os.path.exists(part):
                os.unlink(part)
            raise

    @staticmethod
    def meta_of(path: str) -> dict | None:
        """The meta a saved arena was saved with; None if path is not one."""
        try:
            with open(path, "rb") as f:
                head, _ = _read_head(f)
        except (OSError, ValueError):
            return None
        return head.get("meta")

    @classmethod
    def mapped(cls, path: str, nbytes: int, meta: dict) -> WeightArena | None:
        """The arena saved at path with meta, mapped privately, to replay its carves; None if path holds no
        such arena of nbytes (another meta, an older format, cut short, or saved for another bound)."""
        try:
            with open(path, "rb") as f:
                head, start = _read_head(f)
                if head.get("meta") != meta or head["size"] != max(nbytes, ALIGN) or \
                        os.fstat(f.fileno()).st_size != start + head["size"]:
                    return None
                m = mmap.mmap(f.fileno(), head["size"], access=mmap.ACCESS_COPY, offset=start)
        except (OSError, ValueError, KeyError):
            return None
        m.madvise(mmap.MADV_WILLNEED)  # read ahead what is not in the page cache yet
        saved = [(tuple(shape), dtype) for shape, dtype in head["carves"]]
        return cls(head["size"], np.frombuffer(m, np.uint8), saved)


def _data_start(head_bytes: int) -> int:
    """Where a saved arena's bytes begin: the first page after the magic, the header's length and the header."""
    return -(-(len(MAGIC) + 8 + head_bytes) // PAGE) * PAGE


def _read_head(f) -> tuple[dict, int]:
    """(header, where the bytes begin) of the saved arena open in f; ValueError if f holds none."""
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a saved arena")
    n = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(n)), _data_start(n)
