"""gguf_reader.GGUFFile against gguf-py's GGUFReader (every field's parts, data indices, types and contents,
every tensor), and gguf_reader.architecture against the reader's general.architecture."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from kvgen.engine import model_files
from kvgen.engine.gguf_reader import GGUFFile, architecture

T = gguf.GGUFValueType


def same_as_gguf_py(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, a in theirs.fields.items():
        b = ours.fields[name]
        assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), name
        assert len(b.parts) == len(a.parts), name
        for x, y in zip(a.parts, b.parts, strict=True):
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and np.array_equal(x, y), name
        assert b.contents() == a.contents(), name
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert len(ours.tensors) == len(theirs.tensors)
    for x, y in zip(theirs.tensors, ours.tensors, strict=True):
        assert (x.name, x.tensor_type, x.n_bytes, x.data_offset) == (y.name, y.tensor_type, y.n_bytes, y.data_offset)
        assert type(y.data) is type(x.data) and np.array_equal(x.data, y.data)  # memmap views, as gguf-py's
    assert architecture(str(path)) == theirs.fields["general.architecture"].contents()
    return ours


def test_the_embedded_model_reads_as_gguf_py_reads_it():
    reader = same_as_gguf_py(model_files.embedded_model_path())
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _string(key.encode()) + struct.pack("<I", vtype) + payload


def _array(itype: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", itype, len(items)) + b"".join(items)


def test_every_value_kind_and_an_architecture_not_first(tmp_path):
    """Arrays of strings, numbers, bools and arrays, empty ones, scalars; general.architecture after
    them (the header read skips every kind of value to find it)."""
    kvs = [
        _kv("a.strings", T.ARRAY, _array(T.STRING, [_string(b"x"), _string("é".encode()), _string(b"")])),
        _kv("a.empty", T.ARRAY, _array(T.STRING, [])),
        _kv("a.empty_ints", T.ARRAY, _array(T.INT32, [])),
        _kv("a.ints", T.ARRAY, _array(T.INT32, [struct.pack("<i", v) for v in (1, -2, 3)])),
        _kv("a.floats", T.ARRAY, _array(T.FLOAT32, [struct.pack("<f", v) for v in (0.5, -1.25)])),
        _kv("a.bools", T.ARRAY, _array(T.BOOL, [b"\x01", b"\x00"])),
        _kv("a.nested", T.ARRAY, _array(T.ARRAY, [_array(T.UINT8, [b"\x07"]), _array(T.STRING, [_string(b"y")])])),
        _kv("a.u64", T.UINT64, struct.pack("<Q", 2**40)),
        _kv("a.text", T.STRING, _string(b"hello")),
        _kv("general.architecture", T.STRING, _string(b"qwen2")),
    ]
    path = tmp_path / "kinds.gguf"
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, len(kvs)) + b"".join(kvs) + b"\0" * 32)
    reader = same_as_gguf_py(path)
    assert reader.fields["a.strings"].contents() == ["x", "é", ""]
    assert reader.fields["a.ints"].contents() == [1, -2, 3]
    assert architecture(str(path)) == "qwen2"


@pytest.mark.parametrize("text", [b"", b"not a gguf file at all, just text", b"GGUF"])
def test_architecture_of_other_files_is_none(tmp_path, text):
    path = tmp_path / "other.bin"
    path.write_bytes(text)
    assert architecture(str(path)) is None
    assert architecture(str(tmp_path / "missing.gguf")) is None
    assert architecture(str(tmp_path)) is None  # a folder
