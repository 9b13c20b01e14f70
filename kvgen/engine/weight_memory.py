"""How much memory the weights take, as the kernel sees it: which of this process's mappings are the model's
files (the parts of a GGUF read in place, the tiles mapped back from WEIGHT_CACHE_DIR), how many of those bytes
are in RAM now, and the process's resident total.

Mapped pages are the page cache's: the kernel may drop clean ones under pressure and read them again, and
another process serving the same file shares them. weight_bytes (Model.weight_bytes) counts what the
engine holds either way; this says how much of it is the file's pages and not copies. Read from
/proc/self/smaps (Linux); elsewhere every figure is 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SMAPS = "/proc/self/smaps"
STATUS = "/proc/self/status"


@dataclass(frozen=True)
class WeightMemory:
    mapped_bytes: int = 0  # this process's mappings of the model's files
    mapped_resident_bytes: int = 0  # of which in RAM now
    resident_bytes: int = 0  # the process's VmRSS: copies made at load, the KV pool, the interpreter, and the above


def measure(paths: list[str]) -> WeightMemory:
    """The memory of this process's mappings of the files at paths (a file, or every file under a folder).
    Reads /proc (a few ms with torch's libraries mapped): call it from a thread, not the event loop."""
    roots = tuple(os.path.realpath(os.path.expanduser(p)) for p in paths if p)
    try:
        with open(SMAPS) as f:
            mapped, resident = _sum_mappings(f, roots)
        with open(STATUS) as f:
            rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:  # not Linux, or /proc not mounted
        return WeightMemory()
    return WeightMemory(mapped, resident, rss)


def _sum_mappings(lines, roots: tuple[str, ...]) -> tuple[int, int]:
    """Size and Rss summed over the smaps entries whose path is one of roots or under one."""
    mapped = resident = 0
    ours = False
    for line in lines:
        head, _, rest = line.partition(" ")
        if head.endswith(":"):  # a field of the entry above ("Size:   4 kB")
            if ours and head in ("Size:", "Rss:"):
                kib = int(rest.split()[0]) * 1024
                if head == "Size:":
                    mapped += kib
                else:
                    resident += kib
            continue
        # an entry's header: address range, perms, offset, device, inode, then the path (may hold spaces)
        fields = line.split(None, 5)
        path = fields[5].rstrip("\n") if len(fields) == 6 else ""
        ours = bool(path) and any(path == r or path.startswith(r + os.sep) for r in roots)
    return mapped, resident
