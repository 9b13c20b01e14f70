"""Where Numba caches kvgen's compiled kernels: a folder named by a hash of the engine's sources.

Numba's disk cache checks only the source file of the function it caches, and a cached caller
holds its callees' code (fused_decode's step holds cpu_kernels' matmuls and fused_kv's
loops): after a change in a callee's file the caller's cache would still run the old code, over
arrays laid out the new way. A folder per hash of every file in kvgen/engine (and of the kernels'
code path and Numba's version) makes any change start a new cache. Every module that defines a
cached kernel imports this one first; NUMBA_CACHE_DIR, where set, wins (Numba reads it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numba


def cache_dir(salt: str) -> str:
    """~/.cache/kvgen/numba-<hash of kvgen/engine's sources, salt, Numba's version>."""
    h = hashlib.sha256(f"{numba.__version__} {salt}".encode())
    for f in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return str(Path.home() / ".cache" / "kvgen" / f"numba-{h.hexdigest()[:16]}")


def use_cache_dir(salt: str = "") -> None:
    """Point Numba's cache at cache_dir(salt), unless NUMBA_CACHE_DIR says otherwise. Call before
    any cached function is defined (the locator is chosen when the function is decorated)."""
    if not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = cache_dir(salt)
