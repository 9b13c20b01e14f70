"""Load a Mamba-2 model (model_mamba2.py) from an HF safetensors folder (Mamba2ForCausalLM) or a GGUF
(`mamba2`, as llama.cpp's convert_hf_to_gguf.py writes it), into model_files' shape: (config, Lazy weights
under transformers' names, source), on model_files' readers; generator.load_model sends such a file here
(`holds`), every other to model_files.load.

The GGUF's names and layouts, from llama.cpp's converter (conversion/mamba.py): blk.N.ssm_in / ssm_out (the
projections), ssm_conv1d [C, K] (transformers' [C, 1, K] squeezed), ssm_dt.bias (dt_bias), ssm_a (A itself,
-exp(A_log), as [H, 1]), ssm_d ([H, 1]), ssm_norm ([groups, inner / groups]); metadata mamba2.ssm.* (the
heads are time_step_rank, head_dim inner / heads).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np

from kvgen.cpu.weight_blocks import BLOCK_TYPES
from kvgen.engine import float_weights, gguf_reader
from kvgen.engine import model_files as mf
from kvgen.engine.embedding import TokenEmbedding
from kvgen.engine.model_config import UnsupportedModel
from kvgen.engine.model_mamba2 import Mamba2Config

HF_ARCH = "Mamba2ForCausalLM"
# llama.cpp reads no context length from a Mamba-2 file (its converter writes 2**20, "arbitrary"): a state
# model has no positional limit; this caps a request's prompt + tokens as the context does for the others
CONTEXT = 2**20

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.A",
    "ssm_d": "mixer.D",
    "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}


def holds(path: str | None) -> bool:
    """Whether path is a Mamba-2 GGUF or HF folder (None, the embedded model, is not)."""
    if path is None:
        return False
    if os.path.isdir(path):
        config = Path(path) / "config.json"
        return config.exists() and _is_hf_mamba2(json.loads(config.read_text()))
    # the header's general.architecture alone (parsing the whole file's metadata took seconds); not a GGUF
    # (or not there): None, and model_files.load says what it is
    return gguf_reader.architecture(path) == "mamba2"


def load(path: str):
    """model_files.load's (config, weights, source) of a Mamba-2 file."""
    if os.path.isdir(path):
        return _load_hf(Path(path), json.loads((Path(path) / "config.json").read_text()))
    return _load_gguf(path, gguf_reader.GGUFFile(path))


def _is_hf_mamba2(hf: dict) -> bool:
    return HF_ARCH in (hf.get("architectures") or []) or hf.get("model_type") == "mamba2"


def _load_hf(folder: Path, hf: dict):
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    loaders, types = {}, Counter()
    for f in files:
        handle = safe_open(str(f), framework="pt")
        loaders.update({k: partial(mf._hf_tensor, handle, k) for k in handle.keys()})
        types.update(handle.get_slice(k).get_dtype() for k in handle.keys())
    # transformers' load hook renames an old checkpoint's backbone.embedding. (what the converter reads too)
    for old in [k for k in loaders if k.startswith("backbone.embedding.")]:
        loaders[old.replace("backbone.embedding.", "backbone.embeddings.")] = loaders.pop(old)
    weights = mf.Lazy(loaders)
    blocks, _ = mf._hf_float_blocks(files)
    hidden, heads = hf["hidden_size"], hf["num_heads"]
    inner = int(hf.get("expand", 2) * hidden)
    head_dim = hf.get("head_dim") or inner // heads
    if heads * head_dim != inner:
        raise UnsupportedModel(f"{folder}: mamba2 with {heads} heads of {head_dim} but an inner size of {inner}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{folder}: mamba2 with activation {hf.get('hidden_act')}: kvgen runs silu")
    limit = [_json_float(x) for x in hf.get("time_step_limit") or (0.0, math.inf)]
    cfg = _config(
        name=hf.get("_name_or_path") or folder.name, vocab_size=hf["vocab_size"], hidden_size=hidden,
        num_layers=hf["num_hidden_layers"], heads=heads, head_dim=head_dim, inner=inner,
        state=hf.get("state_size", 128), groups=hf.get("n_groups", 1), conv_kernel=hf.get("conv_kernel", 4),
        eps=hf.get("layer_norm_epsilon", 1e-5),
        tie=bool(hf.get("tie_word_embeddings", "lm_head.weight" not in weights)),
        bos=hf.get("bos_token_id"), eos=mf._hf_eos_ids(folder, hf), dt_limit=(float(limit[0]), float(limit[1])),
        tensor_types=dict(types), file_bytes=sum(f.stat().st_size for f in files))
    return cfg, weights, {"folder": folder, "blocks": blocks, "embedding_rows": None}


def _load_gguf(path: str, reader):
    field = partial(mf._field, reader)
    p = "mamba2."
    weights, blocks, embedding_rows = {}, {}, None
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in mf.FLOAT_TYPES and kind not in BLOCK_TYPES:
            raise UnsupportedModel(f"{path}: tensor {t.name} is {kind}, a type kvgen does not run (it runs "
                                   f"{', '.join([*mf.FLOAT_TYPES, *BLOCK_TYPES])})")
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected tensor {t.name} in {path}")
            name = f"backbone.layers.{i}.{_GGUF_LAYER_NAMES[rest]}"
        elif t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        else:
            raise ValueError(f"unexpected tensor {t.name} in {path}")
        weights[name] = partial(mf._gguf_tensor, t, 0)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if kind in BLOCK_TYPES or float_weights.converts(kind, shape):
            blocks[name] = partial(mf._gguf_blocks if kind in BLOCK_TYPES else mf._gguf_float_blocks, t, 0)
            if name == "backbone.embeddings.weight":  # looked up a row at a time, in the file's encoding
                rows = np.memmap(path, np.uint8, "r", offset=t.data_offset, shape=(shape[0], t.n_bytes // shape[0]))
                embedding_rows = TokenEmbedding.quantized(rows, t.tensor_type, int(t.shape[0]))
    inner = int(field(p + "ssm.inner_size"))
    heads = int(field(p + "ssm.time_step_rank"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    eos = [int(x) for x in (field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id"))
           if x is not None]
    cfg = _config(
        name=str(field("general.name", os.path.basename(path))),
        vocab_size=int(field(p + "vocab_size", len(tokens.data))), hidden_size=int(field(p + "embedding_length")),
        num_layers=int(field(p + "block_count")), heads=heads, head_dim=inner // heads, inner=inner,
        state=int(field(p + "ssm.state_size")), groups=int(field(p + "ssm.group_count", 1)),
        conv_kernel=int(field(p + "ssm.conv_kernel", 4)),
        eps=float(field(p + "attention.layer_norm_rms_epsilon", 1e-5)), tie="lm_head.weight" not in weights,
        bos=field("tokenizer.ggml.bos_token_id"), eos=sorted(set(eos)), dt_limit=(0.0, math.inf),
        tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)), file_bytes=os.path.getsize(path))
    return cfg, mf.Lazy(weights), {"gguf": reader, "blocks": mf.Lazy(blocks), "embedding_rows": embedding_rows}


def _json_float(x) -> float:
    """transformers 5 writes an infinite float as {"__float__": "Infinity"} (JSON has no inf)."""
    return float(x["__float__"]) if isinstance(x, dict) else float(x)


def _config(*, name, vocab_size, hidden_size, num_layers, heads, head_dim, inner, state, groups, conv_kernel, eps,
            tie, bos, eos, dt_limit, tensor_types, file_bytes) -> Mamba2Config:
    if heads % groups:
        raise UnsupportedModel(f"{name}: mamba2 with {heads} heads in {groups} groups")
    return Mamba2Config(
        architecture="mamba2", name=name, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inner,
        num_layers=num_layers, num_heads=heads, num_kv_heads=0, head_dim=head_dim, context_length=CONTEXT,
        rms_norm_eps=eps, rope_theta=0.0, tie_word_embeddings=tie, bos_token_id=bos, eos_token_ids=eos,
        tensor_types=tensor_types, file_bytes=file_bytes, ssm_inner=inner, ssm_state=state, ssm_groups=groups,
        conv_kernel=conv_kernel, dt_limit=dt_limit)
