"""Give the C heap's free pages back to the system after a load.

A model's load makes and drops many temporary buffers (a tensor's blocks parsed, its scales tiled, torch's
intermediates), most of them too small for glibc to map and unmap on their own: freed, they stay in the
heap, resident, counted in the server's RSS for as long as it runs (87 MiB after converting the 1.7B Q2_K
file, bench/results/models.md). glibc's malloc_trim hands every arena's free pages back; elsewhere (musl,
macOS) there is no such call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util

try:
    _trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError, TypeError):  # no C library found, or one without malloc_trim
    _trim = None


def release_free_pages() -> bool:
    """Return the heap's free pages to the system; True where the C library can (glibc)."""
    if _trim is None:
        return False
    _trim(0)
    return True
