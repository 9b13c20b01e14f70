"""Numba's disk cache across processes: a later start loads what an earlier one compiled.

A cached function that calls a parallel one segfaults when a process loads it from the cache
before the parallel callee, if it was compiled in a process that had loaded that callee from the
cache (numba/numba#8578). A server start after a test run, or a second replica after the first,
is exactly that sequence; weight_blocks.compile_kernels loads the callees first (and
decode_step.warm_up, which FusedDecode.compile calls, does the same for the fused step's).
"""

from __future__ import annotations

import os
import subprocess
import sys

CALLEES = """
import numpy as np
from kvgen.cpu import int16_rounding, vector_matmul as ck
x = np.zeros((2, 64), np.float32)
y = np.zeros((2, ck.TILE), np.float32)
s16, s16m = (np.zeros((1, *ck.scale_shape.py_func(layout, 1, 2)), np.uint8) for layout in (ck.F16, ck.F16_MIN))
xq, dx, xs = int16_rounding.quantize(x)
ck.q4_matmul(xq, dx, xs, np.zeros((1, 2, 8, ck.TILE, 2), np.uint8), s16m, ck.F16_MIN, y)
ck.q8_matmul(xq, dx, np.zeros((1, 2, 16, ck.TILE, 2), np.int8), s16, ck.F16, y)
from kvgen.cpu import features
if features.AMX:  # and the tiles' kernels (amx_matmul.py), where this CPU runs them
    from kvgen.cpu import amx_matmul as ak
    ak.q4_matmul(xq, dx, xs, np.zeros((1, 2, 8, ck.TILE, 2), np.uint8), s16m, ck.F16_MIN, y)
    ak.q8_matmul(xq, dx, np.zeros((1, 2, 16, ck.TILE, 2), np.int8), s16, ck.F16, y)
"""
START = "from kvgen.cpu.weight_blocks import compile_kernels; compile_kernels()"


def _run(code: str, cache) -> subprocess.CompletedProcess:
    env = {"NUMBA_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def _callees_of(cache) -> None:
    """Copy this process's kernel cache to `cache` less the kernels' callers (block_matmul's, the int8
    kernels' wrappers, the fused step): the state a start finds after the callees alone were cached,
    without compiling them again (a minute of a fresh compile; CALLEES compiles any not cached here)."""
    import shutil

    import numba

    def callers(_, names):
        return [n for n in names if n.startswith(("block_matmul.", "decode_step.")) or "_linear_int8" in n]

    if os.path.isdir(numba.config.CACHE_DIR):
        shutil.copytree(numba.config.CACHE_DIR, cache, ignore=callers, dirs_exist_ok=True)


def test_starts_after_the_kernels_were_cached_alone_load_the_cache_safely(tmp_path):
    _callees_of(tmp_path)
    first = _run(CALLEES, tmp_path)  # the parallel kernels cached, their callers not
    assert first.returncode == 0, first.stderr[-2000:]
    for _ in range(2):  # the second start loads the callers the first one compiled
        start = _run(START, tmp_path)
        assert start.returncode == 0, f"rc {start.returncode}: {start.stderr[-2000:]}"


# A cached kernel's run in a copy of kvgen: where its cache went, and whether it was compiled.
PROBE = """
import json, numba, numpy as np
from kvgen.cpu import int16_rounding
int16_rounding.quantize(np.zeros((1, 64), np.float32))
stats = int16_rounding.quantize.stats
print(json.dumps({"dir": numba.config.CACHE_DIR, "hits": sum(stats.cache_hits.values()),
                  "misses": sum(stats.cache_misses.values())}))
"""


def test_the_cache_is_keyed_on_kvgen_cpu_alone(tmp_path):
    """An edit in the engine (or anywhere outside kvgen/cpu) reuses the compiled kernels; an edit
    in kvgen/cpu starts a new cache folder (kernel_cache.py says why)."""
    import json
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "kvgen"
    shutil.copytree(src, tmp_path / "kvgen", ignore=shutil.ignore_patterns("__pycache__"))
    home = tmp_path / "home"

    def probe() -> dict:
        env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
        r = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = probe()
    assert first["dir"].startswith(str(home)) and first["misses"] == 1 and first["hits"] == 0, first
    with open(tmp_path / "kvgen" / "engine" / "scheduler.py", "a") as f:
        f.write("\n# an edit outside the kernels\n")
    again = probe()
    assert again == {**first, "hits": 1, "misses": 0}, (first, again)
    with open(tmp_path / "kvgen" / "cpu" / "paged_attention.py", "a") as f:
        f.write("\n# an edit in a kernel module\n")
    edited = probe()
    assert edited["dir"] != first["dir"] and edited["misses"] == 1, (first, edited)
