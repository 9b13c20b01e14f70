"""A Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) over the paged KV cache.

Weights are fused where the math allows (q|k|v, gate|up) so one decode step is a few
hundred torch calls: at 135M parameters, dispatch cost, not arithmetic, sets the pace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks, compile_kernels
from kvgen.engine.attention import TORCH_ATTENTION, KernelAttention, KernelStep, Step, TorchAttention
from kvgen.engine.embedding import TokenEmbedding
from kvgen.engine.model_config import GEMMAS, ModelConfig, UnsupportedModel

WEIGHT_DTYPES = ("auto", "fp32", "bf16", "int8", "int4", "gguf")
CUDA_WEIGHT_DTYPES = ("auto", "fp32", "bf16")  # int8 / int4 / gguf run CPU-only kernels
INT4_GROUP = 32  # GGUF Q4_0/Q4_1 group size: a Q4_1 file's weights fit this format nearly exactly
SMALL_M = 4  # rows up to which the packed int8/int4 kernels (one GEMV per row) beat a bf16 matmul


class Linear:
    """y = x W^T (+ b), W stored as fp32, bf16, int8 (scale per output row) or int4 (asymmetric
    groups of 32 along the input, torch's CPU int4pack layout)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, dtype: str):
        self.dtype = dtype
        self.b = b
        self._deq: torch.Tensor | None = None  # int8 / int4: bf16 copy for calls with many rows
        self.out_features = w.shape[0]
        if dtype == "int8":
            scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
            self.w = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(torch.bfloat16)  # the packed kernels are fast with bf16 activations only
        elif dtype == "int4":
            n, k = w.shape
            g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-10)
            q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
            self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # the kernel computes (q - 8) * scale + zero
            self.scale = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            self._q, self._lo, self._step = q.to(torch.uint8), lo, scale  # for large-M dequantize
        else:
            self.w = w.to(torch.bfloat16 if dtype == "bf16" else torch.float32).contiguous()
            self.wt = self.w.t()  # mm on the transposed view: one dispatch instead of linear's six

    def dequantized(self) -> torch.Tensor:
        """The weight as bf16, for calls with many rows (prefill, large decode batches): made on
        the first such call and kept. Dequantizing on every call made int4 slower at 16 streams
        than at 4; the copy costs bf16 memory on top of the packed weight."""
        if self._deq is None:
            if self.dtype == "int8":
                self._deq = self.w.to(torch.bfloat16) * self.scale[:, None]
            else:
                n, k = self._q.shape
                g = self._q.reshape(n, k // INT4_GROUP, INT4_GROUP).float()
                self._deq = (g * self._step[..., None] + self._lo[..., None]).reshape(n, k).to(torch.bfloat16)
                del self._q, self._lo, self._step
        return self._deq

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype in ("fp32", "bf16"):
            return torch.mm(x, self.wt) if self.b is None else torch.addmm(self.b, x, self.wt)
        if x.shape[0] > SMALL_M:
            return F.linear(x, self.dequantized(), self.b)
        x = x.contiguous()  # the packed kernels take dense rows only (RMSNorm's rows are strided)
        if self.dtype == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, INT4_GROUP, self.scale)
        return y if self.b is None else y + self.b

    def to(self, move) -> None:
        """Place the weights with move(tensor) (Model.to; fp32 / bf16 only)."""
        self.w = move(self.w)
        self.wt = self.w.t()
        self.b = move(self.b) if self.b is not None else None


class RMSNorm:
    """x / sqrt(mean(x^2) + eps) * w.

    On the CPU, torch 2.13's rms_norm is a composite of ~10 small ops (casts, pow, mean, rsqrt,
    two muls), and a decode step runs 61 of them. layer_norm is one fused kernel, and the
    layer norm of [x, -x] is exactly the RMS norm of x (its mean is 0 and its variance is
    mean(x^2)), so the CPU path runs that (3 ops, ~40% less time per call) with weights
    [w, 0]. CUDA has a fused rms_norm.
    """

    def __init__(self, w: torch.Tensor, eps: float):
        self.w, self.eps = w, eps
        self._w2 = torch.cat((w, torch.zeros_like(w)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return F.rms_norm(x, self.w.shape, self.w, self.eps)
        n = x.shape[-1]
        return F.layer_norm(torch.cat((x, -x), -1), self._w2.shape, self._w2, None, self.eps)[..., :n]

    def to(self, move) -> None:
        self.w = move(self.w)


def rope_tables(cfg: ModelConfig, max_pos: int, theta: float | None = None) -> torch.Tensor:
    """Complex rotations [max_pos, head_dim / 2] for the interleaved RoPE layout. theta: another base,
    unscaled (Gemma 3's windowed layers)."""
    half = cfg.head_dim // 2
    base = cfg.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float32) * 2 / cfg.head_dim))
    scaling = (cfg.rope_scaling or {}) if theta is None else {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":  # Gemma 3 4B+: positions / factor
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif kind == "factors":  # a GGUF's rope_freqs tensor: the same llama3 divisors, precomputed
        inv_freq = inv_freq / scaling["factors"].float()
    elif kind in ("longrope", "su"):
        return _longrope_tables(cfg, inv_freq, max_pos, scaling)
    elif kind not in (None, "default"):
        raise UnsupportedModel(f"RoPE scaling {kind!r}, which kvgen does not run (it runs llama3, linear, "
                               "longrope and none)")
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def _longrope_tables(cfg: ModelConfig, inv_freq: torch.Tensor, max_pos: int, s: dict) -> torch.Tensor:
    """Phi-3's LongRoPE (Phi-3.5-mini, Phi-3-mini-128k): per-frequency divisors, the short ones below the
    original context and the long ones from it on, every rotation scaled by the attention factor.
    Chosen per position, this is what transformers computes while decoding: keys cached below the original
    context keep their short rotations, and each position from it on is rotated with the long factors.
    (transformers' one forward over a prompt already past the original context rotates all its positions
    with the long factors; llama.cpp takes the long ones for every position of a context set past it.)"""
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or cfg.context_length / orig
    attention = s.get("attention_factor") or (math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0)
    pos = torch.arange(max_pos, dtype=torch.float32)
    short = torch.outer(pos, inv_freq / torch.as_tensor(s["short_factor"], dtype=torch.float32))
    long = torch.outer(pos, inv_freq / torch.as_tensor(s["long_factor"], dtype=torch.float32))
    angles = torch.where((pos < orig)[:, None], short, long)
    return torch.polar(torch.full_like(angles, attention), angles)


def _llama3_scaling(inv_freq, s):
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((old / wavelen) - lo) / (hi - lo)
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def interleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half rows -> interleaved pairs (llama.cpp's layout), per head.

    q and k get the same permutation, so attention scores do not change, and RoPE becomes
    one complex multiply instead of a slice-negate-concat dance.
    """
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D] interleaved pairs; rot: [T, 1, D/2] complex
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.view_as_real(torch.view_as_complex(xf.reshape(*x.shape[:-1], -1, 2)) * rot).flatten(-2)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class PartsLinear:
    """One fused weight (q|k|v, gate|up) whose parts the file keeps in blocks of different kinds (or
    scales held differently, a Q4_0 part beside a Q4_K one):
    llama-quantize's Q*_K_M mixtures keep attn_v in Q6_K where attn_q and attn_k are Q4_K. Each
    part multiplies on its own blocks and the outputs sit side by side, so no part is dequantized
    (the fused decode step takes one kind a linear: these models run Model.forward)."""

    dtype = "gguf"

    def __init__(self, parts: list[BlockLinear], b: torch.Tensor | None):
        self.parts, self.b = parts, b
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.b is None else y + self.b


def make_linear(w: Mapping, names: list[str], dtype: str, blocks: Mapping | None, bias=None, rows=None):
    """One Linear over the named weights fused along the output rows (rows: per-name row
    rearrangement). With dtype gguf, weights the file keeps in blocks stay in them (BlockLinear,
    or PartsLinear where the parts' kinds differ), and w[name] is not looked up (model_files'
    weights are lazy: no float copy is made); a weight the file holds as floats runs fp32."""
    fix = [(lambda t: t) if r is None else r for r in (rows or [None] * len(names))]
    if dtype == "gguf" and blocks and all(n in blocks for n in names):
        parts = [blocks[n].map_rows(f) for n, f in zip(names, fix, strict=True)]
        if len({(p.kind, p.layout) for p in parts}) == 1:  # one kind, scales held alike: one matrix
            return BlockLinear(parts[0] if len(parts) == 1 else WeightBlocks.cat(parts), bias)
        return PartsLinear([BlockLinear(p, None) for p in parts], bias)
    parts = [f(w[n]) for n, f in zip(names, fix, strict=True)]
    weight = parts[0] if len(parts) == 1 else torch.cat(parts)  # one part: the tensor itself (tied
    # embeddings stay one tensor for Model.to)
    return Linear(weight, bias, "fp32" if dtype == "gguf" else dtype)


class Layer:
    def __init__(self, cfg: ModelConfig, w: Mapping, i: int, dtype: str, act: torch.dtype,
                 blocks: Mapping | None = None):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([interleave(w[p + "self_attn.q_proj.bias"], nq),
                              interleave(w[p + "self_attn.k_proj.bias"], nkv),
                              w[p + "self_attn.v_proj.bias"]]).to(act)
        if attn + "qkv_proj.weight" in w:  # Phi-3 keeps q|k|v as one matrix: its q and k rows interleave in place
            def qkv_rows(t):
                q, k, v = t.split([nq * d, nkv * d, nkv * d])
                return torch.cat((interleave(q, nq), interleave(k, nkv), v))
            self.qkv = make_linear(w, [attn + "qkv_proj.weight"], dtype, blocks, bias, [qkv_rows])
        else:
            rows = [lambda t: interleave(t, nq), lambda t: interleave(t, nkv), None]
            self.qkv = make_linear(w, [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
                                   dtype, blocks, bias, rows)
        self.o = make_linear(w, [attn + "o_proj.weight"], dtype, blocks)
        self.window = cfg.layer_windows[i] if cfg.layer_windows else 0
        gate_up = [mlp + "gate_up_proj.weight"] if mlp + "gate_up_proj.weight" in w else [
            mlp + "gate_proj.weight", mlp + "up_proj.weight"]  # Phi-3: gate|up as one matrix already
        self.gate_up = make_linear(w, gate_up, dtype, blocks)
        self.down = make_linear(w, [mlp + "down_proj.weight"], dtype, blocks)
        # Gemma's norms multiply by (1 + w) (HF's weights are w; model_files gives a GGUF's the same way)
        shift = 1.0 if cfg.architecture in GEMMAS else 0.0

        def norm(name: str, t=lambda x: x) -> RMSNorm | None:
            return RMSNorm(t(w[name] + shift).to(act), cfg.rms_norm_eps) if name in w else None

        self.ln1 = norm(p + "input_layernorm.weight")
        self.post_attn = self.post_ffn = None
        if p + "pre_feedforward_layernorm.weight" in w:  # Gemma's sandwich: a norm before and after each block
            self.post_attn = norm(p + "post_attention_layernorm.weight")
            self.ln2 = norm(p + "pre_feedforward_layernorm.weight")
            self.post_ffn = norm(p + "post_feedforward_layernorm.weight")
        else:
            self.ln2 = norm(p + "post_attention_layernorm.weight")
        # Qwen3, Gemma 3: an RMS norm over each q and k head before RoPE; its weight is one head's channels,
        # which take the head's interleave (the norm's mean of squares does not depend on the order)
        self.q_norm = norm(attn + "q_norm.weight", lambda x: interleave(x, 1))
        self.k_norm = norm(attn + "k_norm.weight", lambda x: interleave(x, 1))

    def norms(self) -> list[RMSNorm]:
        return [n for n in (self.ln1, self.ln2, self.q_norm, self.k_norm, self.post_attn, self.post_ffn)
                if n is not None]

    def to(self, move) -> None:
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            lin.to(move)
        for n in self.norms():
            n.to(move)


def _check_device_dtype(weight_dtype: str, device: torch.device) -> None:
    if weight_dtype not in CUDA_WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r} runs on the CPU only (its kernels are CPU kernels); "
                         f"on {device.type} use one of {', '.join(CUDA_WEIGHT_DTYPES)}")


def held_bytes(arrays, linears) -> int:
    """Bytes of a model's weights as held: float arrays and each linear's blocks' codes and scales or
    float matrix; a buffer shared by two (tied embeddings, a stack's views) counted once."""
    arrays = list(arrays)
    for lin in linears:
        for part in getattr(lin, "parts", [lin]):
            arrays += [getattr(part, name, None) for name in ("qs", "scales", "w", "scale")]
    seen: set[int] = set()
    total = 0
    for a in arrays:
        if a is None:
            continue
        ptr = a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data
        if ptr not in seen:
            seen.add(ptr)
            total += a.nbytes
    return total


def resolve_weight_dtype(weight_dtype: str, device: torch.device, blocks: Mapping | None,
                         file_types: Mapping[str, int] | None = None) -> str:
    """auto: on the CPU, blocks where the file gives them: a GGUF's own (the bytes of a Q4 file, the
    fidelity of fp32), and the Q8_0 blocks made at load of a bf16 / fp16 model's matrices (an HF folder's, a
    GGUF's F16 / BF16: float_weights.py says why those and not bf16); else (an fp32 file) fp32. On a GPU,
    bf16 where the file holds anything narrower than fp32 (file_types: its tensor types, ModelConfig's): half
    the bytes a decode step reads, as GPU servers run them; an fp32 file (or none named) stays fp32."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    if weight_dtype == "auto" and device.type != "cpu":
        return "bf16" if set(file_types or ()) - {"F32", "F64"} else "fp32"
    if weight_dtype == "auto":
        return "gguf" if blocks else "fp32"
    if weight_dtype == "gguf" and not blocks:
        raise ValueError("weight dtype 'gguf' keeps a GGUF file's quantized blocks (Q4_0 ... Q6_K: "
                         "kvgen/cpu/weight_blocks.py's BLOCK_TYPES) or makes Q8_0 blocks of bf16 / fp16 matrices, "
                         "and this model has neither (an fp32 file); use auto, fp32, "
                         "bf16, int8 or int4")
    return weight_dtype


class Model:
    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], weight_dtype: str = "fp32",
                 device: str | torch.device = "cpu", blocks: Mapping | None = None, embedding_rows=None):
        """blocks: a GGUF's quantized tensors, and a bf16 / fp16 model's matrices as Q8_0 blocks
        (model_files.load's source["blocks"]), for weight dtype gguf (or auto on the CPU); embedding_rows: its
        quantized (or bf16 / fp16) token embedding, read a row at a time
        (source["embedding_rows"], a TokenEmbedding). Each tensor is looked up in weights (and blocks)
        once at most: model_files' mappings make it anew on every lookup."""
        device = torch.device(device)
        weight_dtype = resolve_weight_dtype(weight_dtype, device, blocks, cfg.tensor_types)
        if device.type != "cpu":
            _check_device_dtype(weight_dtype, device)
        self.device = torch.device("cpu")
        self.cfg = cfg
        self.weight_dtype = weight_dtype
        # fp32 and gguf weights run fp32 activations; the others bf16: bf16 matmuls hit AMX, and
        # torch's packed int8/int4 CPU kernels are several times faster with bf16 inputs than fp32.
        self.act_dtype = torch.float32 if weight_dtype in ("fp32", "gguf") else torch.bfloat16
        act = self.act_dtype
        if weight_dtype == "gguf" and embedding_rows is not None:  # the file's rows, no float table
            self.embed, embed = embedding_rows, None
        else:
            embed = weights["model.embed_tokens.weight"].to(act)  # floats, indexed
            self.embed = TokenEmbedding.floats(embed)
        self.layers = [Layer(cfg, weights, i, weight_dtype, act, blocks) for i in range(cfg.num_layers)]
        self.norm = RMSNorm((weights["model.norm.weight"] + (1.0 if cfg.architecture in GEMMAS else 0.0)).to(act),
                            cfg.rms_norm_eps)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        # tied: the embedding tensor already made, not a second copy
        self.lm_head = make_linear({head: embed} if cfg.tie_word_embeddings else weights, [head], weight_dtype,
                                   blocks)
        del embed
        if weight_dtype == "gguf":
            compile_kernels()
        self.rot = rope_tables(cfg, cfg.context_length)
        if (cfg.rope_scaling or {}).get("rope_type") in ("longrope", "su"):
            # short rotations below the original context, long ones past it: they do not compose across
            # it, so a context shift computes the moved keys again instead of re-rotating them
            self.shift_keys = None
        # Gemma: windowed layers rotate with their own base; embeddings scaled by sqrt(hidden); queries by
        # query_pre_attn_scalar^-1/2 (SDPA divides by sqrt(head_dim): the ratio is folded into q); GELU-tanh
        self.rot_local = (rope_tables(cfg, cfg.context_length, cfg.local_rope_theta) if cfg.local_rope_theta
                          else self.rot)
        self.gemma = cfg.architecture in GEMMAS
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=act) if self.gemma else None
        self.q_scale = ((cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5
                        if cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar != cfg.head_dim else None)
        self.windows = sorted({layer.window for layer in self.layers} - {0})
        # what the GPU kernels (KernelAttention) do not compute: such a model attends through torch on every
        # step, and model_runner takes that path for it (None: the kernels may serve it)
        why = ([f"per-layer sliding windows {self.windows}"] if self.windows else []) + (
            [f"attention logit soft-capping at {cfg.attn_logit_softcap}"] if cfg.attn_logit_softcap else [])
        self.torch_attention_why = " and ".join(why) or None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        if device.type != "cpu":
            self.to(device)

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (held_bytes)."""
        embed = self.embed.table if self.embed.table is not None else self.embed.raw  # (raw: the file's mapping)
        arrays = [embed, self.norm.w, *(n.w for layer in self.layers for n in layer.norms())]
        linears = [*(x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                   self.lm_head]
        return held_bytes(arrays, linears)

    def to(self, device: str | torch.device) -> Model:
        """Move every weight and the RoPE table to `device` (built on the CPU first, so the
        CPU path never changes). Tensors shared on the CPU stay shared: fp32 tied embeddings
        are one tensor for embed and lm_head, and stay one copy on the device."""
        device = torch.device(device)
        if device.type != "cpu":
            _check_device_dtype(self.weight_dtype, device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (source kept alive, copy)

        def move(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in moved:
                moved[id(t)] = (t, t.to(device))
            return moved[id(t)][1]

        self.embed = TokenEmbedding.floats(move(self.embed.table))  # (a quantized one stays on the CPU: gguf)
        self.rot, self.rot_local = move(self.rot), move(self.rot_local)
        self.norm.to(move)
        for layer in self.layers:
            layer.to(move)
        self.lm_head.to(move)
        self.device = device
        return self

    @torch.inference_mode()
    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Cached keys [..., KVH, D] (rotated at their positions p) as if computed at p - delta:
        RoPE rotations compose, so one more rotation by -delta (a context shift's re-rotation)."""
        rot = self.rot[delta]
        back = (rot / rot.abs()).conj().to(k.device)[None, None]  # unit: a rotation may carry LongRoPE's scale
        return apply_rope(k.reshape(-1, *k.shape[-2:]), back).reshape(k.shape)

    def forward(self, input_ids: torch.Tensor, step: Step | KernelStep, fmt, store,
                attention: TorchAttention | KernelAttention = TORCH_ATTENTION, features: list | None = None,
                lora=None) -> torch.Tensor:
        """Logits [B, vocab] (fp32) of each sequence's last new token; writes K/V to the store.
        features: a list that gets the final-norm hidden state of every new token [T, hidden]
        appended (what an EAGLE head drafts from). lora: a lora.LoraBatch, whose rows' linears get their
        adapters' low-rank deltas (None: the base model for every row).

        The one forward pass: prefill, decode and the CUDA-graph decode step are all this loop,
        with `attention` (attention.py) storing K/V and attending. It reads the host only
        through `step`'s fields, so with KernelAttention and a KernelStep it is capturable."""
        cfg = self.cfg
        T = input_ids.shape[0]
        rot = self.rot[step.positions].unsqueeze(1)
        rot_local = rot if self.rot_local is self.rot else self.rot_local[step.positions].unsqueeze(1)
        if self.torch_attention_why is not None and isinstance(step, KernelStep):
            raise ValueError(f"{self.torch_attention_why}: the torch attention path only")
        cap = cfg.attn_logit_softcap or 0.0
        steps = {0: replace(step, softcap=cap) if cap else step}  # per window, the step its layers attend with
        # (each makes its own decode plan)
        steps.update({w: replace(step, window=w, decode_plan=None, softcap=cap) for w in self.windows})
        nq, nkv = cfg.num_heads, cfg.num_kv_heads
        half = cfg.intermediate_size
        h = self.embed[input_ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        act = (lambda x: F.gelu(x, approximate="tanh")) if self.gemma else F.silu
        for i, layer in enumerate(self.layers):
            lin = layer if lora is None else lora.layer(i, layer)  # LoRA adapters: lora.py
            x = layer.ln1(h)
            qkv = lin.qkv(x).view(T, -1, cfg.head_dim)
            qk = qkv[:, :nq + nkv]
            if layer.q_norm is not None:
                qk = torch.cat((layer.q_norm(qk[:, :nq]), layer.k_norm(qk[:, nq:])), 1)
            qk = apply_rope(qk, rot_local if layer.window else rot)  # q and k heads rotate in one go
            if fmt.qk_scale is not None:  # fp8 keys: channels equalised (formats.KVFormat)
                qk = qk * fmt.qk_scale[i]
            q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]
            if self.q_scale is not None:
                q = q * self.q_scale
            a = attention.write_and_attend(fmt, store, i, q, k, v, steps[layer.window])
            o = lin.o(a.reshape(T, self.q_size))
            h += o if layer.post_attn is None else layer.post_attn(o)
            x = layer.ln2(h)
            gu = lin.gate_up(x)
            f = lin.down(act(gu[:, :half]) * gu[:, half:])
            h += f if layer.post_ffn is None else layer.post_ffn(f)
        if features is not None:
            h = self.norm(h)
            features.append(h)
            return self._logits(h if step.logits_rows is None else h[step.logits_rows])
        if step.logits_rows is not None:
            h = h[step.logits_rows]
        return self._logits(self.norm(h))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h).float()
        cap = self.cfg.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
