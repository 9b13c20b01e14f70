"""weight_memory: this process's mappings of given files, from /proc/self/smaps."""

import mmap
import os

import numpy as np

from kvgen.engine import weight_memory

PAGE = mmap.PAGESIZE


def test_counts_the_mappings_of_the_files_given_and_the_pages_read(tmp_path):
    folder = tmp_path / "a model"  # a space in the path: smaps' last field
    folder.mkdir()
    (folder / "w.bin").write_bytes(os.urandom(64 * PAGE))
    other = tmp_path / "other.bin"
    other.write_bytes(os.urandom(16 * PAGE))
    with open(folder / "w.bin", "rb") as f, open(other, "rb") as g:
        weights = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        unrelated = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            before = weight_memory.measure([str(folder)])
            assert before.mapped_bytes == 64 * PAGE and before.mapped_resident_bytes == 0  # mapped, none read
            view = np.frombuffer(weights, np.uint8)
            assert view[: 20 * PAGE : PAGE].sum() >= 0  # reads 20 pages, one byte each
            unrelated_sum = sum(unrelated[i] for i in range(0, 16 * PAGE, PAGE))  # not ours: not counted
            after = weight_memory.measure([str(folder / "w.bin"), ""])
            assert after.mapped_bytes == 64 * PAGE and 20 * PAGE <= after.mapped_resident_bytes <= 64 * PAGE
            assert after.resident_bytes > after.mapped_resident_bytes + (1 << 20)  # the interpreter's own
            both = weight_memory.measure([str(folder), str(other)])
            assert both.mapped_bytes == 80 * PAGE and unrelated_sum >= 0
            assert weight_memory.measure([str(tmp_path / "a")]).mapped_bytes == 0  # a prefix of a name is not a folder
            del view
        finally:
            weights.close()
            unrelated.close()
