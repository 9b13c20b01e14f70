"""A GGUF file's tiles kept between starts (engine/tile_cache.py over cpu/weight_arena.py): the first load
saves them, the next maps them back and converts nothing, with the same tiles, logits and tokens; an entry
is used only for the same file and code, and a bad, stale or unwritable entry never changes what is served."""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu.weight_arena import WeightArena
from kvgen.cpu.weight_blocks import FileBlocks
from kvgen.engine import tile_cache
from kvgen.engine.fused_decode import _parts
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.sampling import SamplingParams
from tests import tiny
from tests.engine.test_fused_decode import MIXTURES
from tests.engine.test_model_files import all_logits, bpe, gguf_base, token_sequences  # noqa: F401  (fixtures)
from tests.engine.test_model_files_quants import _write
from tests.tiny import write_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_file(gguf_base, bpe, tmp_path_factory):  # noqa: F811
    """A 2-layer file of twelve types (test_fused_decode's 256-wide mixture): every conversion loop writes."""
    _, cfg, weights, _, _ = gguf_base
    *layers, head = MIXTURES[256]
    types = {"lm_head.weight": getattr(gguf.GGMLQuantizationType, head),
             "model.embed_tokens.weight": getattr(gguf.GGMLQuantizationType, head)}
    for i, layer in enumerate(layers):
        for name, t in layer.items():
            types[f"model.layers.{i}.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}.weight"] = \
                getattr(gguf.GGMLQuantizationType, t)
    path = tmp_path_factory.mktemp("tiles") / "mixed.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "gguf_quantize", _write)
        write_gguf(path, cfg, weights, bpe, types=types)
    return path


def _load(path, folder):
    model = load_model(str(path), "gguf", tile_cache_dir=str(folder))[0]
    tile_cache.flush()
    return model


def _tiles(model) -> list[np.ndarray]:
    linears = [getattr(layer, f) for layer in model.layers for f in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
    return [a for lin in linears for p in _parts(lin) for a in (p.qs, p.scales)]


def _entries(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(tile_cache.SUFFIX))


def test_the_second_load_maps_the_first_loads_tiles_and_converts_nothing(mixed_file, tmp_path, monkeypatch,
                                                                         bpe):  # noqa: F811
    folder = tmp_path / "tiles"
    first = _load(mixed_file, folder)
    assert len(_entries(folder)) == 1 and not first.layers[0].o.arena.saved  # converted, then saved
    with monkeypatch.context() as mp:
        mp.setattr(FileBlocks, "_convert", lambda *_: pytest.fail("converted where the tiles were saved"))
        second = _load(mixed_file, folder)
    arena = second.layers[0].o.arena
    assert arena.saved and isinstance(arena.buf.base.obj, mmap.mmap)  # mapped back, replayed
    want, got = _tiles(first), _tiles(second)
    assert len(got) == len(want) and all(arena.offset(a) is not None for a in got)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    for ids in token_sequences(first.cfg.vocab_size, bpe)[1:3]:
        assert torch.equal(all_logits(second, ids), all_logits(first, ids))


def test_a_served_model_from_saved_tiles_decodes_the_same_tokens(mixed_file, tmp_path):
    """Through the engine (its fused step reads the mapped arena itself): the same greedy tokens as the start
    that converted the file, and as a start with the cache off."""
    outs = []
    for folder in ("", tmp_path / "tiles", tmp_path / "tiles"):
        gen = Generator.load(str(mixed_file), EngineOptions(weight_cache_dir=str(folder), kv_dtype="fp32"))
        try:
            tile_cache.flush()
            arena = gen.model.layers[0].o.arena
            assert np.may_share_memory(gen.engine.runner.fused.weights[0], arena.buf)  # the step reads it, uncopied
            outs.append([gen.generate(p, GREEDY).token_ids for p in ("hello world", "the quick brown fox")])
            mapped = bool(arena.saved)
            # GetModelInfo's mapped bytes: the embedding's rows, read from the file in place; with the tiles' entry
            # (the third start) the tiles too, most pages of them read by the step by now
            memory, size = gen.weight_memory(), mixed_file.stat().st_size
            tiles = sum(e.stat().st_size for e in (tmp_path / "tiles").glob("*")) if mapped else 0
            assert tiles <= memory.mapped_bytes < tiles + size
            assert arena.buf.nbytes * mapped // 2 < memory.mapped_resident_bytes <= memory.mapped_bytes
            assert memory.mapped_resident_bytes < memory.resident_bytes
        finally:
            gen.close()
    assert mapped and outs[1] == outs[0] and outs[2] == outs[0] and all(len(t) == 12 for t in outs[0])


def test_a_changed_file_or_code_converts_again_and_replaces_the_entry(mixed_file, tmp_path, monkeypatch):
    folder = tmp_path / "tiles"
    _load(mixed_file, folder)
    entry = os.path.join(folder, _entries(folder)[0])
    st = os.stat(mixed_file)
    os.utime(mixed_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the file rewritten, as far as it shows
    try:
        assert not _load(mixed_file, folder).layers[0].o.arena.saved
        assert _entries(folder) == [os.path.basename(entry)]  # one entry a file: replaced
        assert WeightArena.meta_of(entry)["mtime_ns"] == st.st_mtime_ns + 1_000_000
        monkeypatch.setattr(tile_cache, "_code_hash", lambda: "another kvgen")
        assert not _load(mixed_file, folder).layers[0].o.arena.saved
        assert _load(mixed_file, folder).layers[0].o.arena.saved  # then its own entry again
    finally:
        os.utime(mixed_file, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_entry_that_does_not_replay_is_dropped_and_the_file_loaded_without_it(mixed_file, bpe,  # noqa: F811
                                                                                 tmp_path, caplog):
    """An entry under the file's key whose arrays come in another order (what a loader change that kept the hash
    would leave): the load stops at the first array that differs, is done again without the entry, and gives
    the cache-off load's logits; the entry is gone."""
    folder = tmp_path / "tiles"
    size = _load(mixed_file, folder).layers[0].o.arena.buf.size
    entry = tile_cache.entry_path(str(folder), str(mixed_file))
    arena = WeightArena.mapped(entry, size, WeightArena.meta_of(entry))
    for shape, dtype in arena.saved:
        arena.empty(shape, dtype)
    arena.carves[0], arena.carves[1] = arena.carves[1], arena.carves[0]  # the first codes and scales swapped
    arena.save(entry, WeightArena.meta_of(entry), len(arena.carves))
    with caplog.at_level(logging.WARNING, "kvgen.engine"):
        model = _load(mixed_file, folder)
    assert "did not replay" in caplog.text and not model.layers[0].o.arena.saved
    assert not os.path.exists(entry)
    want = load_model(str(mixed_file), "gguf", tile_cache_dir="")[0]
    ids = token_sequences(model.cfg.vocab_size, bpe)[1]
    assert torch.equal(all_logits(model, ids), all_logits(want, ids))


def test_a_broken_entry_or_folder_serves_as_without_one(mixed_file, tmp_path, caplog):
    folder = tmp_path / "tiles"
    want = _tiles(_load(mixed_file, folder))
    entry = os.path.join(folder, _entries(folder)[0])
    with open(entry, "r+b") as f:
        f.truncate(os.path.getsize(entry) // 2)  # cut short
    got = _load(mixed_file, folder)
    assert not got.layers[0].o.arena.saved and all(np.array_equal(a, b) for a, b in zip(_tiles(got), want, strict=True))
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, "kvgen.engine"):
        got = _load(mixed_file, blocked / "tiles")
    assert "not saved" in caplog.text and all(np.array_equal(a, b) for a, b in zip(_tiles(got), want, strict=True))
    _load(mixed_file, "")
    assert _entries(folder) != []  # (the empty folder setting writes nowhere)


def test_a_save_removes_the_entries_of_files_that_are_gone(gguf_base, mixed_file, bpe, tmp_path):  # noqa: F811
    _, cfg, weights, _, _ = gguf_base
    gone = tmp_path / "gone.gguf"
    write_gguf(gone, cfg, weights, bpe, qtype=gguf.GGMLQuantizationType.Q4_0)
    folder = tmp_path / "tiles"
    _load(gone, folder)
    assert len(_entries(folder)) == 1
    os.unlink(gone)
    _load(mixed_file, folder)
    assert _entries(folder) == [os.path.basename(tile_cache.entry_path(str(folder), str(mixed_file)))]


def test_a_process_that_ends_right_after_its_load_finishes_its_save(mixed_file, tmp_path):
    """The save runs in a thread beside the server; a process that exits at once (a server stopped soon after
    its start, a script) waits for it rather than leaving a .part and a conversion for the next start."""
    folder = tmp_path / "tiles"
    code = ("import sys, time; from kvgen.engine.generator import load_model; from kvgen.cpu import weight_arena; "
            "save = weight_arena.WeightArena.save; "  # a save slower than the exit (a 1.7B file's takes ~2 s)
            "weight_arena.WeightArena.save = lambda *a: (time.sleep(1), save(*a)); "
            "load_model(sys.argv[1], 'gguf', tile_cache_dir=sys.argv[2])")  # no flush(): exit at once
    subprocess.run([sys.executable, "-c", code, str(mixed_file), str(folder)], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": ROOT})
    assert len(_entries(folder)) == 1 and not [n for n in os.listdir(folder) if n.endswith(".part")]
    assert _load(mixed_file, folder).layers[0].o.arena.saved  # and it maps
