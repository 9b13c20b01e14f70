"""A GGUF file's tiles kept on disk between starts, so that a later start maps them instead of converting.

Converting a file's blocks into the kernels' tiles (weight_blocks.FileBlocks) writes the whole model into
fresh memory once a start: on a 1.7B Q4_K_M file 1-3 s of the start, most of it the VM faulting in 1 GB
of new pages, where llama-server maps the file and finds its pages in the page cache (#41). So the
first start saves the model's WeightArena to a file in the cache folder (after SERVING, from a thread of
its own), and a later start of the same file maps that arena back (weight_arena.WeightArena.mapped):
its pages come from the page cache as the first steps read them, and nothing is converted or written.

An entry is used only when everything its tiles were made from is the same: the model file (its real
path, size, modification time and inode), kvgen's loading and kernel code (a hash of every source file
of kvgen/cpu and kvgen/engine, as kernel_cache.py does for Numba's cache) and the CPU build the kernels
were made for (features.py). Anything else and the file is converted as before and the entry rewritten;
a load that replays an entry differently from how it was saved fails (StaleArena) and the engine loads
again without it. An entry is named by its model file's path, so a folder holds one a file, and a save
removes the entries whose model file is gone. WEIGHT_CACHE_DIR (EngineOptions) names the folder; empty
turns it off. The disk it takes is about the model file's size, again.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import threading
import time
import weakref
from pathlib import Path

from kvgen.cpu import features
from kvgen.cpu.weight_arena import WeightArena

log = logging.getLogger("kvgen.engine")

SUFFIX = ".tiles"
FINGERPRINT = 1 << 20
PART_AGE_S = 3600  # a half-written entry older than this was left by a process that ended mid-write
SAVE_AT_EXIT_S = 120  # how long an exiting process waits for a save under way (1 GB of tiles: ~2 s)
_saving: set[threading.Thread] = set()
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a new arena's file key, taken at its load


@functools.cache
def _code_hash() -> str:
    """A hash of what the tiles are made by: kvgen/cpu's and kvgen/engine's sources, the kernels' build."""
    h = hashlib.sha256(f"{features.FEATURES} {features.path()}".encode())
    root = Path(__file__).parent.parent
    for f in sorted([*(root / "cpu").rglob("*.py"), *(root / "engine").rglob("*.py")]):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _key(model: str) -> dict:
    """What an entry must have been made from: the file as its metadata and its first and last MiB say (an
    in-place rewrite within the clock's tick keeps the size and time), and the code."""
    st = os.stat(model)
    h = hashlib.sha256()
    with open(model, "rb") as f:
        h.update(f.read(FINGERPRINT))
        f.seek(max(st.st_size - FINGERPRINT, 0))
        h.update(f.read(FINGERPRINT))
    return {"model": os.path.realpath(model), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
            "bytes": h.hexdigest()[:16], "code": _code_hash()}


def entry_path(folder: str, model: str) -> str:
    """The path of model's entry in folder (whether or not one is there)."""
    name = hashlib.sha256(os.path.realpath(model).encode()).hexdigest()[:24]
    return os.path.join(os.path.expanduser(folder), name + SUFFIX)


def arena(model: str, nbytes: int, folder: str) -> WeightArena:
    """The arena for model's tiles: its saved entry in folder mapped back, where one matches; else a new one
    (`replaying` False), which save() then keeps under the key the file had now, at its load."""
    if not folder:
        return WeightArena(nbytes)
    key, entry = _key(model), entry_path(folder, model)
    if mapped := WeightArena.mapped(entry, nbytes, key):
        log.info("%s: its tiles mapped from %s", os.path.basename(model), entry)
        return mapped
    fresh = WeightArena(nbytes)
    _keys[fresh] = key
    return fresh


def forget(model: str, folder: str) -> None:
    """Remove model's entry (it did not replay: StaleArena)."""
    if folder:
        try:
            os.unlink(entry_path(folder, model))
        except OSError:
            pass


def save(arena: WeightArena, model: str, folder: str) -> None:
    """Write arena (new: its tiles converted this start) as model's entry in folder, from a thread of its own
    (the write is memory-bound and gives up the GIL; flush() waits for it); nothing where folder is empty or
    the arena was mapped. A failure (a read-only or full disk) is logged, not raised: the server runs as it
    would without the folder."""
    key = _keys.pop(arena, None)  # (none: a mapped arena, or the folder was off at load)
    if not folder or key is None or not arena.carves:
        return
    entry, carves = entry_path(folder, model), len(arena.carves)  # the carves written by now

    def write():
        try:
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            _evict(os.path.dirname(entry))
            arena.save(entry, key, carves)
            log.info("%s: its tiles saved to %s for later starts", os.path.basename(model), entry)
        except OSError as e:
            log.warning("%s: its tiles not saved to %s (%s): later starts convert them again",
                        os.path.basename(model), entry, e)
        finally:
            _saving.discard(threading.current_thread())

    t = threading.Thread(target=write, name="kvgen-tile-cache", daemon=True)
    _saving.add(t)
    t.start()


def flush(timeout: float | None = None) -> None:
    """Wait for the saves under way."""
    for t in list(_saving):
        t.join(timeout)


# a process that ends soon after its start (a server stopped at once, a script) finishes its save first: a daemon
# thread would be cut off at exit, leaving a .part and the next start converting again
atexit.register(flush, SAVE_AT_EXIT_S)


def _evict(folder: str) -> None:
    """Remove the entries whose model file is gone (a test's temporary file, a deleted download), and what a
    process that ended mid-write left."""
    now = time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if name.endswith(SUFFIX) and not os.path.exists((WeightArena.meta_of(path) or {}).get("model", "")) or \
                    name.endswith(".part") and now - os.path.getmtime(path) > PART_AGE_S:
                os.unlink(path)
        except OSError:
            pass
