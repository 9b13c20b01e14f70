"""Where Numba caches kvgen's compiled kernels: a folder named by a hash of kvgen/cpu's sources.

Numba's disk cache checks only the source file of the function it caches, and a cached caller
holds its callees' code (decode_step's step holds vector_matmul's matmuls and kv_io's loops):
after a change in a callee's file the caller's cache would still run the old code, over arrays
laid out the new way. A folder per hash of every file in kvgen/cpu (and of the CPU's features,
the AMX grant, Numba's thread count and version) makes any change to a kernel start a new cache,
and a change anywhere else in kvgen (the engine, the service) none. The package's __init__
points Numba here before any kernel module is imported; NUMBA_CACHE_DIR, where set, wins (Numba
reads it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numba


def cache_dir(salt: str) -> str:
    """~/.cache/kvgen/numba-<hash of kvgen/cpu's sources, salt, Numba's version>."""
    h = hashlib.sha256(f"{numba.__version__} {salt}".encode())
    for f in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return str(Path.home() / ".cache" / "kvgen" / f"numba-{h.hexdigest()[:16]}")


def use_cache_dir(salt: str = "") -> None:
    """Point Numba's cache at cache_dir(salt), unless NUMBA_CACHE_DIR says otherwise. Call before
    any cached function is defined (the locator is chosen when the function is decorated)."""
    if not numba.config.CACHE_DIR:
        numba.config.CACHE_DIR = cache_dir(salt)
