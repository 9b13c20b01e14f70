"""bf16 / fp16 models on the CPU (issue #41's HF folders): an HF folder's bf16 / fp16 matrices and a GGUF's
F16 / BF16 ones run as Q8_0 blocks made at load (kvgen/engine/float_weights.py), tensor by tensor, with no
float32 copy of a matrix; the token embedding stays in the file's rows.

The oracle is transformers in fp32 on the same folder: fed the weights kvgen holds (each matrix's Q8_0
blocks dequantized, the embedding and norms the folder's own), 4 prompts' 32 greedy tokens equal in one
engine batch and the logits agree to the kernels' int16 activation rounding (1e-3 of the largest, as
test_families_quantized.py states it); on the folder's own weights, the logits are within Q8_0's weight
rounding (test_model_files_quants.py's bound for a Q8_0 file of the same kind of tiny model).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks
from kvgen.engine import float_weights, model_files
from kvgen.engine.generator import Generator, load_model, type_kernels
from kvgen.engine.model import Model
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_families_quantized import ROUNDING
from tests.engine.test_model_files import (  # noqa: F401  (fixtures)
    all_logits,
    bpe,
    gguf_config,
    one_thread,
    token_sequences,
)
from tests.engine.test_model_files_quants import QUANT_BOUNDS
from tests.engine.test_oracle import CHATS, RAW, hf_greedy
from tests.tiny import smollm2_hf_tokenizer, tiny_config, tiny_weights, write_family_folder, write_gguf, write_hf_folder

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}
PROMPTS = [*RAW[:2], *CHATS[:2]]
STEPS = 32
# test_families_quantized.py's shape: head_dim 64, so that the fused decode step takes the model
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _linears(model) -> list:
    return [*(lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)), model.lm_head]


def test_blocks_made_a_chunk_at_a_time_are_the_whole_matrixs(monkeypatch):
    """float_weights.q8_blocks (a few rows at a time) gives WeightBlocks.q8_from_float's blocks of the whole
    matrix, and those are llama.cpp's Q8_0 (gguf-py's quantize): the same fp16 scales, codes within one step."""
    w = (torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    w[3, :32] = 0  # an all-zero block
    monkeypatch.setattr(float_weights, "CHUNK", 5 * 96)  # 5 rows a chunk, the last one short
    got = float_weights.q8_blocks(lambda a, b: w[a:b], *w.shape)
    whole = WeightBlocks.q8_from_float(w)
    assert got.kind == "q8" and torch.equal(got.qs, whole.qs) and torch.equal(got.d, whole.d)
    ref = gguf.quants.quantize(w.float().numpy(), Q.Q8_0).reshape(37, 3, 34)
    assert np.array_equal(got.d.numpy(), ref[..., :2].copy().view(np.float16)[..., 0])
    assert np.abs(got.qs.numpy().astype(int) - ref[..., 2:].view(np.int8).astype(int)).max() <= 1


def test_safetensors_rows_are_what_safe_open_reads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(7, 64, generator=g).to(torch.bfloat16), "b": torch.randn(5, 32, generator=g).half(),
               "c": torch.randn(9, generator=g)}
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    st = float_weights.SafetensorsFile(tmp_path / "m.safetensors")
    assert sorted(st.names()) == ["a", "b", "c"] and (st.dtype("a"), st.dtype("b"), st.dtype("c")) == (
        "BF16", "F16", "F32")
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        for name in ("a", "b"):
            assert st.shape(name) == tuple(tensors[name].shape)
            assert torch.equal(st.rows(name, 2, 5), f.get_tensor(name)[2:5])
            assert torch.equal(st.rows(name, 0, st.shape(name)[0]), tensors[name])
            rows = np.asarray(st.mapped(name))
            assert np.array_equal(rows, tensors[name].view(torch.int16).numpy().view(np.uint8))
    assert float_weights.converts("BF16", (7, 64)) and not float_weights.converts("F32", (7, 64))
    assert not float_weights.converts("BF16", (64,)) and not float_weights.converts("F16", (5, 48))


@pytest.fixture(scope="module")
def hf_tokenizer():
    return smollm2_hf_tokenizer()


@pytest.fixture(scope="module", params=list(DTYPES))
def half_folder(request, hf_tokenizer, tmp_path_factory):
    """(type name, folder, transformers fp32 model of the folder) of a tiny random llama saved in bf16 / fp16."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    write_family_folder(folder, "llama", hf_tokenizer, seed=5, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[request.param])
    model.save_pretrained(folder)  # the folder's tensors in that dtype, as a bf16 / fp16 checkpoint ships
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, hf


def held_weights_model(hf):
    """A copy of the transformers model whose matrices are what kvgen holds: each one's Q8_0 blocks
    dequantized (the embedding stays the folder's rows, as kvgen looks it up)."""
    import copy

    held = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in held.named_parameters():
            if p.ndim == 2 and "embed_tokens" not in name:
                p.copy_(WeightBlocks.q8_from_float(p).dequantize())
    return held


def test_a_half_folder_runs_q8_blocks_and_gives_transformers_tokens(half_folder, caplog):
    type_name, folder, hf = half_folder
    with caplog.at_level(logging.INFO, logger="kvgen.engine"):
        model, tok = load_model(str(folder))  # auto
    n_tensors = len(float_weights.SafetensorsFile(next(folder.glob("*.safetensors"))).names())
    assert model.weight_dtype == "gguf" and model.cfg.tensor_types == {type_name: n_tensors}
    assert all(isinstance(lin, BlockLinear) and lin.kind == "q8" for lin in _linears(model))
    assert model.embed.table is None and model.embed.qtype == float_weights.ggml_type(type_name)
    assert type_kernels(model) == {type_name: "q8"}
    assert f"{type_name} matrices run as Q8_0 blocks made at load, on the q8 kernels" in caplog.text

    held = held_weights_model(hf)
    prompts = [tok.encode(p) if isinstance(p, str) else tok.encode_chat(p) for p in PROMPTS]
    gen = Generator(model, tok, EngineOptions())
    try:
        runner = gen.engine.runner
        assert runner.decode_path == "fused", runner.decode_path_reason
        results = gen.batch_generate(prompts, SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
    finally:
        gen.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(held, ids, STEPS), tok.decode(ids)

    ids = prompts[-1] + results[-1].token_ids  # a chat and its continuation
    ours = all_logits(model, ids)
    with torch.no_grad():
        on_held, on_folder = held(torch.tensor([ids])).logits[0], hf(torch.tensor([ids])).logits[0]
    err = (ours - on_held).abs().max().item()
    assert err < ROUNDING * on_held.abs().max().item(), f"{type_name}: max |logit diff| {err} on the held weights"
    rel = ((ours - on_folder).norm() / on_folder.norm()).item()
    agree = (ours.argmax(-1) == on_folder.argmax(-1)).float().mean().item()
    _, logit_bound, argmax_bound = QUANT_BOUNDS[Q.Q8_0]
    assert rel < logit_bound and agree >= argmax_bound, f"{type_name}: against the folder's own weights: " \
        f"logits rel err {rel:.3g}, argmax agreement {agree:.3f}"


def test_no_matrix_of_a_half_folder_is_read_as_floats(half_folder, monkeypatch):
    """Under auto only the 1-D tensors (norms) are read as float32; under fp32 every tensor is, as before."""
    _, folder, _ = half_folder
    reads = []
    hf_tensor = model_files._hf_tensor

    def counted(handle, name):
        reads.append(name)
        return hf_tensor(handle, name)

    monkeypatch.setattr(model_files, "_hf_tensor", counted)
    cfg, weights, src = model_files.load(str(folder))
    Model(cfg, weights, "auto", blocks=src["blocks"], embedding_rows=src["embedding_rows"])
    st = float_weights.SafetensorsFile(next(folder.glob("*.safetensors")))
    assert sorted(reads) == sorted(n for n in st.names() if len(st.shape(n)) == 1)
    reads.clear()
    fp32 = Model(cfg, weights, "fp32", blocks=src["blocks"], embedding_rows=src["embedding_rows"])
    assert fp32.weight_dtype == "fp32" and sorted(reads) == sorted(st.names())


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_a_ggufs_half_matrices_run_as_the_folders(bpe, tmp_path, qtype):  # noqa: F811
    """A GGUF's F16 / BF16 matrices (q/k rows permuted, as llama.cpp's converter writes them) run on the
    same Q8_0 blocks as a folder of the same values: the same logits, bit for bit."""
    cfg = gguf_config("llama", bpe.get_vocab_size())
    cfg.tie_word_embeddings = False
    dtype = DTYPES[qtype.name]
    weights = {k: v.to(dtype) for k, v in tiny_weights(cfg, seed=8).items()}
    write_hf_folder(tmp_path / "hf", cfg, weights, bpe)
    write_gguf(tmp_path / "m.gguf", cfg, {k: v.float() for k, v in weights.items()}, bpe, qtype=qtype)
    folder_model, _ = load_model(str(tmp_path / "hf"))
    gguf_model, _ = load_model(str(tmp_path / "m.gguf"))
    for model in (folder_model, gguf_model):
        assert model.weight_dtype == "gguf" and model.embed.table is None
        assert all(isinstance(lin, BlockLinear) and lin.kind == "q8" for lin in _linears(model))
    assert type_kernels(gguf_model) == {qtype.name: "q8", "F32": "fp32"}
    for ids in token_sequences(cfg.vocab_size, bpe):
        assert torch.equal(all_logits(gguf_model, ids), all_logits(folder_model, ids))


# Peak RSS of loading a bf16 folder, in a fresh process: VmHWM reset after the imports and the kernels'
# load, against the folder's size.
RSS_SCRIPT = r"""
import sys
import torch
from kvgen.cpu.weight_blocks import compile_kernels
from kvgen.engine.generator import load_model
compile_kernels()  # Numba's cache, loaded before the measurement

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to VmRSS
before = status("VmRSS")
model, tok = load_model(sys.argv[1], sys.argv[2])
print(status("VmHWM") - before, status("VmRSS") - before, model.weight_bytes(), model.weight_dtype)
"""


def load_rss(folder: Path, weight_dtype: str) -> tuple[int, int, int, str]:
    """(peak growth, growth after the load, weight bytes held, weight dtype) of load_model in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(folder), weight_dtype], cwd=ROOT, env=env,
                         check=True, capture_output=True, text=True, timeout=600).stdout.split()
    return int(out[0]), int(out[1]), int(out[2]), out[3]


def write_big_bf16_folder(folder: Path, bpe) -> int:  # noqa: F811
    """A ~0.8 GB bf16 llama folder (400M weights, random), each tensor made in bf16; its safetensors' bytes."""
    from safetensors.torch import save_file

    cfg = tiny_config(vocab=49152, layers=10, hidden=1536, heads=12, kv_heads=4, ffn=4096)
    cfg.tie_word_embeddings = False
    write_hf_folder(folder, cfg, {}, bpe)  # config and tokenizer; the weights below
    g = torch.Generator().manual_seed(0)
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
              "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                       p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                       p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                       p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                       p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, cfg.intermediate_size)})
    tensors = {n: (torch.randn(s, generator=g, dtype=torch.bfloat16) * 0.02 + (len(s) == 1)) for n, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return (folder / "model.safetensors").stat().st_size


@pytest.mark.heavy
def test_a_bf16_folder_loads_within_its_own_size(bpe, tmp_path):  # noqa: F811
    """Loading a bf16 folder under auto peaks well below the folder's size: the Q8_0 blocks are 0.53 of it,
    the embedding stays in the file, and what is more at the peak is one tensor's blocks being laid out
    for the kernels. Measured on a 2-core Zen 4, folder 768 MiB: auto peaks 509-534 MiB above the process
    before the load and keeps 424-462 MiB; fp32 (every tensor a float32 copy) peaks 2603 MiB and keeps 1835."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    size = write_big_bf16_folder(tmp_path / "big", bpe)
    peak, after, _, dtype = load_rss(tmp_path / "big", "auto")
    assert dtype == "gguf"
    # the blocks are 0.53 of the matrices' bytes; the rest of `after` is the process's own (allocator, scratch):
    # a float32 embedding table alone would put it past 0.9, a bf16 copy of the matrices past 1.4
    assert peak < 0.8 * size and after < 0.7 * size, \
        f"peak {peak / 2**20:.0f} MiB, after {after / 2**20:.0f} MiB; folder {size / 2**20:.0f} MiB"
