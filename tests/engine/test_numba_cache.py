"""Numba's disk cache across processes: a later start loads what an earlier one compiled.

A cached function that calls a parallel one segfaults when a process loads it from the cache
before the parallel callee, if it was compiled in a process that had loaded that callee from the
cache (numba/numba#8578). A server start after a test run, or a second replica after the first,
is exactly that sequence; blocks.compile_kernels loads the callees first (and FusedDecode.compile
does the same for its step's).
"""

from __future__ import annotations

import subprocess
import sys

CALLEES = """
import numpy as np
from kvgen.engine import cpu_kernels as ck
x = np.zeros((2, 64), np.float32)
y, d = np.zeros((2, ck.TILE), np.float32), np.zeros((1, 2, ck.TILE), np.float32)
xq, dx, xs = ck.quantize(x)
ck.q4_matmul(xq, dx, xs, np.zeros((1, 2, 8, ck.TILE, 2), np.uint8), d, d, y)
ck.q8_matmul(xq, dx, np.zeros((1, 2, 16, ck.TILE, 2), np.int8), d, y)
if ck.AMX:  # and the tiles' kernels (amx_kernels.py), where this CPU runs them
    from kvgen.engine import amx_kernels as ak
    ak.q4_matmul(xq, dx, xs, np.zeros((1, 2, 8, ck.TILE, 2), np.uint8), d, d, y)
    ak.q8_matmul(xq, dx, np.zeros((1, 2, 16, ck.TILE, 2), np.int8), d, y)
"""
START = "from kvgen.engine.blocks import compile_kernels; compile_kernels()"


def _run(code: str, cache) -> subprocess.CompletedProcess:
    env = {"NUMBA_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_starts_after_the_kernels_were_cached_alone_load_the_cache_safely(tmp_path):
    first = _run(CALLEES, tmp_path)  # the parallel kernels cached, their callers not
    assert first.returncode == 0, first.stderr[-2000:]
    for _ in range(2):  # the second start loads the callers the first one compiled
        start = _run(START, tmp_path)
        assert start.returncode == 0, f"rc {start.returncode}: {start.stderr[-2000:]}"
