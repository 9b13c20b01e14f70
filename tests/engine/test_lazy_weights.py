"""Weights stay in the file's encoding until the model needs floats (issue #41's memory goal).

model_files.load gives Lazy mappings: a tensor is dequantized (a GGUF's) or read (a safetensors
file's) when looked up, and its blocks made when looked up. With WEIGHT_DTYPE=gguf a matrix that
runs on blocks is never dequantized: only the 1-D norms and the token embedding table (the
lookup and the fused step index it as floats) are. With fp32 every tensor is, once, and no
blocks are made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks
from kvgen.engine import model_files
from kvgen.engine.model import Model
from tests.engine.test_model_files import (  # noqa: F401  (fixtures)
    Q,
    all_logits,
    bpe,
    gguf_base,
    gguf_config,
    one_thread,
    token_sequences,
)
from tests.tiny import tiny_weights, write_gguf

ROOT = Path(__file__).resolve().parents[2]
EMBED = "token_embd.weight"


@pytest.fixture(params=[(Q.Q4_0, True), (Q.Q4_K, False)], ids=["Q4_0-tied", "Q4_K-untied"])
def quant_file(request, bpe, tmp_path):  # noqa: F811
    """(path, cfg, the HF weights written) of a tiny GGUF whose matrices are all of one block type."""
    qtype, tied = request.param
    cfg = gguf_config("llama", bpe.get_vocab_size())
    cfg.tie_word_embeddings = tied
    weights = tiny_weights(cfg, seed=21)
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=qtype)
    return path, cfg, weights


class Calls:
    """gguf.quants.dequantize and WeightBlocks.from_gguf, counted per GGUF tensor (by its bytes' address)."""

    def __init__(self, monkeypatch):
        self.dequantized, self.blocked = [], []
        dequantize, from_gguf = gguf.quants.dequantize, WeightBlocks.from_gguf.__func__

        def counted_dequantize(data, qtype):
            self.dequantized.append(data.ctypes.data)
            return dequantize(data, qtype)

        def counted_from_gguf(cls, type_name, raw, arena=None):
            self.blocked.append(raw.ctypes.data)
            return from_gguf(cls, type_name, raw, arena)

        monkeypatch.setattr(gguf.quants, "dequantize", counted_dequantize)
        monkeypatch.setattr(WeightBlocks, "from_gguf", classmethod(counted_from_gguf))

    def names(self, reader, calls: list[int]) -> list[str]:
        at = {t.data.ctypes.data: t.name for t in reader.tensors}
        return sorted(at[a] for a in calls)

    def clear(self):
        self.dequantized.clear()
        self.blocked.clear()


def test_gguf_weights_dequantize_only_what_runs_as_floats(quant_file, bpe, monkeypatch):  # noqa: F811
    path, cfg, weights = quant_file
    calls = Calls(monkeypatch)
    got_cfg, w, src = model_files.load(str(path))
    reader = src["gguf"]
    assert isinstance(w, Mapping) and isinstance(src["blocks"], Mapping)
    assert sorted(w) == sorted(weights)
    assert got_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert calls.dequantized == [] and calls.blocked == [], "load itself reads no tensor"
    matrices = sorted(t.name for t in reader.tensors if len(t.shape) == 2)
    vectors = sorted(t.name for t in reader.tensors if len(t.shape) == 1)
    assert sorted(src["blocks"]) == sorted(n for n, t in weights.items() if t.ndim == 2)

    model = Model(got_cfg, w, "gguf", blocks=src["blocks"], embedding_rows=src["embedding_rows"])
    assert all(isinstance(lin, BlockLinear) for layer in model.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(model.lm_head, BlockLinear)
    # floats for the norms only, each made once (the embedding stays in the file's rows, a mapping
    # of its bytes: embedding.py); the blocks of every matrix a linear runs on once (the
    # embedding's where it is the LM head too)
    assert calls.names(reader, calls.dequantized) == vectors
    embed_tensor = next(t for t in reader.tensors if t.name == EMBED)
    assert model.embed.table is None and np.array_equal(model.embed.raw, embed_tensor.data)
    assert calls.names(reader, calls.blocked) == [n for n in matrices if n != EMBED or cfg.tie_word_embeddings]

    calls.clear()
    fp32 = Model(got_cfg, w, "fp32", blocks=src["blocks"])
    assert calls.names(reader, calls.dequantized) == sorted(t.name for t in reader.tensors)  # each once
    assert calls.blocked == []
    if cfg.tie_word_embeddings:  # one tensor for both, as before
        assert fp32.lm_head.w.data_ptr() == fp32.embed.table.data_ptr()

    # the same model as from eager dicts of the same tensors, bit for bit
    eager = Model(got_cfg, dict(w), "gguf", blocks=dict(src["blocks"]))
    ids = token_sequences(cfg.vocab_size, bpe)[1]
    assert torch.equal(all_logits(model, ids), all_logits(eager, ids))


def test_lazy_mappings_make_each_value_per_lookup(quant_file):
    path, _, weights = quant_file
    _, w, src = model_files.load(str(path))
    name = "model.layers.0.self_attn.q_proj.weight"
    a, b = w[name], w[name]
    assert a is not b and torch.equal(a, b)  # not kept: the caller keeps what it needs
    assert name in w and "no.such.weight" not in w and len(w) == len(weights)
    with pytest.raises(KeyError):
        w["no.such.weight"]
    assert w.get("no.such.weight") is None
    assert src["blocks"][name].kind == "q4"


def test_hf_folder_weights_are_read_lazily(gguf_base, monkeypatch):  # noqa: F811
    d, cfg, weights, _, _ = gguf_base
    from safetensors import safe_open

    reads = []
    get_tensor = safe_open.get_tensor

    class Counting:
        def __init__(self, *a, **k):
            self._h = safe_open(*a, **k)

        def keys(self):
            return self._h.keys()

        def get_slice(self, name):  # a tensor's dtype and shape, from the header: no read
            return self._h.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return get_tensor(self._h, name)

    monkeypatch.setattr("safetensors.safe_open", Counting)
    got_cfg, w, _ = model_files.load(str(d / "hf"))
    assert reads == [] and sorted(w) == sorted(weights)
    assert got_cfg.tie_word_embeddings and not got_cfg.qkv_bias
    for name, t in weights.items():
        got = w[name]
        assert got.dtype == torch.float32 and torch.equal(got, t), name
    assert sorted(reads) == sorted(weights)  # each read when looked up, once


# The embedded model's load, in fresh processes: peak RSS growth of load_model (VmHWM, reset
# before), less what the GGUF reader and the tokenizer alone cost (gguf-py's fields: ~200 MiB of
# Python objects for SmolLM2's 49k tokens and merges, not this change's business).
RSS_SCRIPT = r"""
import sys
import torch
from kvgen.cpu.weight_blocks import compile_kernels
torch.set_num_threads(1)
compile_kernels()  # Numba's cache, loaded before the measurement

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to VmRSS
except OSError:
    pass
before = status("VmRSS")
what, path = sys.argv[1], sys.argv[2]
if what == "reader":
    import gguf
    from kvgen.engine.tokenizer import TextTokenizer
    reader = gguf.GGUFReader(path)
    tok = TextTokenizer.from_gguf(reader)
    extra = sum(int(t.n_elements) for t in reader.tensors)
else:
    from kvgen.engine.generator import load_model
    model, tok = load_model(path, what)
    extra = model.weight_dtype
print(status("VmHWM") - before, status("VmRSS") - before, extra)
"""


def _rss(what: str, path: str) -> tuple[int, int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, what, path], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    return int(out[0]), int(out[1]), out[2]


@pytest.mark.heavy
def test_embedded_model_loads_without_a_float_copy_of_its_matrices():
    """Measured on a 2-core x86 box, MiB of peak growth / growth after the load (over the process
    after its imports), with every tensor dequantized up front: auto (gguf blocks) 1103 / 824, fp32
    1237 / 1012; lazily: auto 574 / 295, fp32 826 / 599; the reader and tokenizer alone 200 / 190.
    The bound: load_model(auto) beyond the reader and tokenizer stays under the model's fp32 size
    (4 bytes a weight, 514 MiB for SmolLM2-135M), which the old load passed by ~390 MiB (it held
    all of that and the blocks too) and the lazy one stays ~140 MiB under (the embedding table's
    floats, the blocks, the file's pages)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    path = model_files.embedded_model_path()
    reader_peak, _, n_weights = _rss("reader", path)
    peak, _, dtype = _rss("auto", path)
    assert dtype == "gguf"
    floats = 4 * int(n_weights)
    assert peak - reader_peak < floats, \
        f"load_model(auto) peaked {(peak - reader_peak) / 2**20:.0f} MiB above the reader and tokenizer; " \
        f"the model as fp32 is {floats / 2**20:.0f} MiB"
