"""heap.release_free_pages: buffers a load dropped stop counting in the process's RSS."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from kvgen.engine import heap


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_buffers_leave_the_rss():
    # 64 KiB buffers, under glibc's mmap threshold: freed, they stay in the heap. One kept past each 8 keeps the
    # heap's top in use, so only a trim of the free pages inside it (not of the top alone) can give them back.
    buffers = [np.ones(64 * 1024, np.uint8) for _ in range(4096)]  # 256 MiB, every page written
    kept = buffers[7::8]
    del buffers
    before = _rss_mib()
    assert heap.release_free_pages()
    after = _rss_mib()
    assert before - after > 150, (before, after)
    assert all(int(k[0]) == 1 for k in kept)  # what is still held is untouched
