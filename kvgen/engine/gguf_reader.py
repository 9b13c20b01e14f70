"""gguf-py's GGUFReader, its metadata read fast; and a file's architecture read from its header alone.

GGUFReader parses every metadata value as numpy views of its memory map, one or two per array element:
the tokenizer's ~50,000 tokens and ~50,000 merges are ~200,000 `np.memmap` slices, each paying
memmap's Python-level `__getitem__` / `__array_finalize__`, 3.5 s of a 13.9 s start-up on the embedded
model (and the same again when `mamba2_files.holds` opened the file a second time to read its
architecture). `GGUFFile` builds the same fields (the same `ReaderField` parts, data indices and types,
so `contents()` and every reader of `parts` see what gguf-py gives) from plain-ndarray slices of the
same map, arrays of strings and numbers in one loop each: about 20x faster. The tensors are
GGUFReader's own (`np.memmap` views: model_files._drop_pages finds the map through them).
"""

from __future__ import annotations

import mmap
import struct

import gguf
import numpy as np
from gguf.constants import GGUF_MAGIC, GGUFValueType

_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)
# bytes of each scalar value type
_SIZES = {int(t): np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}


class GGUFFile(gguf.GGUFReader):
    """gguf.GGUFReader (same fields, tensors and errors), its metadata parsed without numpy.memmap's
    per-slice overhead."""

    def _build_fields(self, offs: int, count: int) -> int:
        mapped = self.data
        self.data = mapped.view(np.ndarray)  # the same bytes; its slices cost a fifth of a memmap's
        try:
            return super()._build_fields(offs, count)
        finally:
            self.data = mapped  # the tensors' views come from the memmap itself

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if int(raw_type) != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = int(raw_itype[0]), int(alen[0])
        if itype != _STRING and itype not in _SIZES:  # arrays of arrays: gguf-py's own way
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if n else [])  # as gguf-py: none for []
        data, offs = self.data, orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == _STRING:  # per string its length (uint64 [1]) and its bytes, as _get_str gives them
            length = struct.Struct("<Q").unpack_from
            for _ in range(n):
                size = length(data, offs)[0]
                parts.append(data[offs:offs + 8].view(np.uint64))
                parts.append(data[offs + 8:offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, 2 * n + 3, 2)), types
        size = _SIZES[itype]
        values = data[offs:offs + n * size].view(self.gguf_scalar_to_np[GGUFValueType(itype)])
        parts += [values[i:i + 1] for i in range(n)]  # one part an element, as gguf-py's
        return 12 + n * size, parts, list(range(2, n + 2)), types


def architecture(path: str) -> str | None:
    """general.architecture of a GGUF file, read from its header without parsing the rest (None: not a
    GGUF, or none said)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return _architecture(m)
    except (OSError, ValueError, struct.error, IndexError):
        return None


def _architecture(m) -> str | None:
    magic, version, _, kv_count = struct.unpack_from("<IIQQ", m, 0)
    if magic != GGUF_MAGIC or version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
        return None
    offs = 24

    def string(at: int) -> tuple[bytes, int]:
        size = struct.unpack_from("<Q", m, at)[0]
        return m[at + 8:at + 8 + size], at + 8 + size

    def skip(at: int, vtype: int) -> int:
        if vtype == _STRING:
            return string(at)[1]
        if vtype in _SIZES:
            return at + _SIZES[vtype]
        if vtype == _ARRAY:
            itype, n = struct.unpack_from("<IQ", m, at)
            at += 12
            if itype in _SIZES:
                return at + n * _SIZES[itype]
            for _ in range(n):
                at = skip(at, itype)
            return at
        raise ValueError(f"unknown GGUF value type {vtype}")

    for _ in range(kv_count):
        key, offs = string(offs)
        vtype = struct.unpack_from("<I", m, offs)[0]
        offs += 4
        if key == b"general.architecture" and vtype == _STRING:
            return string(offs)[0].decode()
        offs = skip(offs, vtype)
    return None
