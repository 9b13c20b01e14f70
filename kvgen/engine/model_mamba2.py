"""Mamba-2, a state-space family: no attention and no K/V, a fixed-size recurrent state per sequence instead.

Each layer: RMS norm -> in_proj (z | x B C | dt) -> causal depthwise conv1d over x B C (SiLU), whose state is the
last conv_kernel - 1 inputs -> the selective state-space scan (SSD) over x with dt, A, B, C, whose state is
h [heads, head_dim, state_size] -> + D x -> RMS norm gated by SiLU(z), per group -> out_proj, added to the
residual. transformers' modeling_mamba2.py (torch_forward: chunk scan for prompts, selective_state_update for
one token) is the oracle; llama.cpp's ggml ssm_conv / ssm_scan are the same recurrence.

A step's rows are a few sequences' new tokens, each continuing from its own state (kv/states.py keeps the
states beside the paged KV): one-token rows of many sequences run together through the recurrence, a prompt
chunk through the chunked scan, which is the recurrence regrouped (SSD: within a chunk, a masked
attention-like product; across chunks, the state carried).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.cpu.weight_blocks import compile_kernels
from kvgen.engine.embedding import TokenEmbedding
from kvgen.engine.model import RMSNorm, held_bytes, make_linear, resolve_weight_dtype
from kvgen.engine.model_config import ModelConfig, UnsupportedModel

# Within a prompt chunk the scan is quadratic in its length (the L x L decay matrix); 64 rows keep that
# matrix small next to the matmuls while the state is carried across sub-chunks
SCAN_CHUNK = 64


@dataclass(slots=True)
class Mamba2Config(ModelConfig):
    """A ModelConfig whose num_heads / head_dim are the scan's heads, and the state-space shape besides
    (num_kv_heads is 0: there is no K/V)."""

    ssm_inner: int = 0  # heads * head_dim: the width of x and z
    ssm_state: int = 0  # N: the state's size per head channel (B and C's width per group)
    ssm_groups: int = 1  # B and C are shared by heads / groups heads each
    conv_kernel: int = 4
    dt_limit: tuple[float, float] = (0.0, math.inf)  # transformers' time_step_limit: dt clamped to it

    @property
    def conv_dim(self) -> int:
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state


class Mamba2Layer:
    window = 0  # GetModelInfo's layer_windows: no attention, no window

    def __init__(self, cfg: Mamba2Config, w: Mapping, i: int, dtype: str, blocks: Mapping | None):
        p = f"backbone.layers.{i}."
        m = p + "mixer."
        self.norm = RMSNorm(w[p + "norm.weight"].float(), cfg.rms_norm_eps)
        self.in_proj = make_linear(w, [m + "in_proj.weight"], dtype, blocks)
        self.out_proj = make_linear(w, [m + "out_proj.weight"], dtype, blocks)
        k = cfg.conv_kernel
        self.conv_w = w[m + "conv1d.weight"].float().reshape(cfg.conv_dim, 1, k)  # HF [C, 1, K], GGUF [C, K]
        self.conv_b = w[m + "conv1d.bias"].float() if m + "conv1d.bias" in w else None
        self.dt_bias = w[m + "dt_bias"].float()
        # HF keeps log(-A); llama.cpp's converter writes A itself (model_files: mixer.A)
        self.A = -torch.exp(w[m + "A_log"].float()) if m + "A_log" in w else w[m + "A"].float().reshape(-1)
        self.D = w[m + "D"].float().reshape(-1)
        self.gate_norm = w[m + "norm.weight"].float().reshape(-1)  # GGUF: [groups, inner / groups]
        for name in ("in_proj.bias", "out_proj.bias"):
            if m + name in w:
                raise UnsupportedModel(f"a mamba2 model with {name} (use_bias): kvgen runs Mamba-2 without biases")


class Mamba2:
    """The Mamba-2 forward over per-sequence states. A state is a list of 2 tensors per layer: the conv
    state [conv_dim, conv_kernel - 1] (the last inputs, oldest first) and the scan state h [heads, head_dim,
    state_size]; zeros before a sequence's first token."""

    recurrent = True  # the engine keeps a state per sequence (kv/states.py) and runs state_runner.py
    windows: tuple[int, ...] = ()  # no sliding windows (ModelRunner and GetModelInfo ask)
    shift_keys = None  # no keys to re-rotate: a context shift recomputes
    # why a LoRA adapter is refused on this model (lora.check_takes_adapters: at start and at run time)
    adapters_why_not = ("a state-space model has no attention nor MLP projections (q/k/v/o, gate/up/down), the "
                        "modules kvgen's LoRA adapters adapt, and kvgen runs no adapter on Mamba-2's in_proj")

    def __init__(self, cfg: Mamba2Config, weights: Mapping[str, torch.Tensor], weight_dtype: str = "fp32",
                 device: str | torch.device = "cpu", blocks: Mapping | None = None, embedding_rows=None):
        """As Model's: weights under transformers' names (model_files maps a GGUF's to them), blocks for weight
        dtype gguf (in_proj, out_proj and the head then run on kvgen/cpu's block kernels), embedding_rows a
        quantized token embedding read a row at a time."""
        device = torch.device(device)
        if device.type != "cpu":
            raise UnsupportedModel("mamba2 runs on the CPU only (its scan is torch code on the host)")
        weight_dtype = resolve_weight_dtype(weight_dtype, device, blocks)
        if weight_dtype not in ("fp32", "gguf"):
            raise UnsupportedModel(f"mamba2 runs fp32 or gguf weights, not {weight_dtype!r}")
        self.cfg, self.device, self.weight_dtype = cfg, device, weight_dtype
        self.act_dtype = torch.float32
        if weight_dtype == "gguf" and embedding_rows is not None:
            self.embed, embed = embedding_rows, None
        else:
            embed = weights["backbone.embeddings.weight"].float()
            self.embed = TokenEmbedding.floats(embed)
        self.layers = [Mamba2Layer(cfg, weights, i, weight_dtype, blocks) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(weights["backbone.norm_f.weight"].float(), cfg.rms_norm_eps)
        # tied: the embedding's blocks (gguf) or the float table already made, not a second copy
        head = "backbone.embeddings.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = make_linear({head: embed} if cfg.tie_word_embeddings and embed is not None else weights,
                                   [head], weight_dtype, blocks)
        if weight_dtype == "gguf":
            compile_kernels()
        # what model_runner's ModelRunner asks a Model: no attention at all, so neither the fused step nor the
        # kernels run it; said at start and in GetModelInfo (state_runner.py)
        self.torch_attention_why = ("a state-space model (mamba2): a recurrent state per sequence, no attention, "
                                    "so no fused step or attention kernels; Model.forward-style torch steps")

    # the state

    def state_shapes(self) -> list[tuple[int, ...]]:
        cfg = self.cfg
        conv = (cfg.conv_dim, cfg.conv_kernel - 1)
        ssm = (cfg.num_heads, cfg.head_dim, cfg.ssm_state)
        return [conv, ssm] * cfg.num_layers

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (model.held_bytes)."""
        embed = self.embed.table if self.embed.table is not None else self.embed.raw
        arrays = [embed, self.norm.w]
        for layer in self.layers:
            arrays += [layer.norm.w, layer.conv_w, layer.conv_b, layer.dt_bias, layer.A, layer.D, layer.gate_norm]
        linears = [*(x for layer in self.layers for x in (layer.in_proj, layer.out_proj)), self.lm_head]
        return held_bytes(arrays, linears)

    # the forward

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, states: list[torch.Tensor], logits_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids [B, T]: B sequences' next T tokens each, continuing from states (each [B, ...] as state_shapes);
        T == 1 runs the recurrence (decode), T > 1 the chunked scan (a prompt chunk). Returns the logits
        [B, rows, vocab] of the positions logits_rows (default: the last) and the states after the T tokens."""
        B, T = ids.shape
        h = self.embed[ids.reshape(-1)].reshape(B, T, -1).float()
        out_states = []
        for i, layer in enumerate(self.layers):
            y, conv, ssm = self._mixer(layer, layer.norm(h), states[2 * i], states[2 * i + 1])
            h = h + y
            out_states += [conv, ssm]
        rows = torch.tensor([T - 1]) if logits_rows is None else logits_rows
        h = self.norm(h[:, rows])
        return self.lm_head(h.reshape(-1, h.shape[-1])).float().reshape(B, len(rows), -1), out_states

    def _mixer(self, layer: Mamba2Layer, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        cfg = self.cfg
        B, T, _ = x.shape
        H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.ssm_state, cfg.ssm_groups
        zxbcdt = layer.in_proj(x.reshape(B * T, -1)).reshape(B, T, -1)
        z, xbc, dt = zxbcdt.split([cfg.ssm_inner, cfg.conv_dim, H], dim=-1)
        # causal depthwise conv over the kept inputs and the new ones (transformers' causal_conv1d_update)
        seq = torch.cat((conv_state, xbc.transpose(1, 2)), dim=-1)  # [B, conv_dim, K - 1 + T]
        new_conv = seq[:, :, -(cfg.conv_kernel - 1):].contiguous()
        xbc = F.silu(F.conv1d(seq, layer.conv_w, layer.conv_b, groups=cfg.conv_dim)).transpose(1, 2)  # [B, T, C]
        xs, Bm, Cm = xbc.split([cfg.ssm_inner, G * N, G * N], dim=-1)
        dt = F.softplus(dt + layer.dt_bias).clamp(*cfg.dt_limit)  # [B, T, H]
        xs = xs.reshape(B, T, H, P)
        Bm = Bm.reshape(B, T, G, N).repeat_interleave(H // G, dim=2)  # [B, T, H, N]
        Cm = Cm.reshape(B, T, G, N).repeat_interleave(H // G, dim=2)
        if T == 1:
            y, new_ssm = _step(xs[:, 0], dt[:, 0], layer.A, Bm[:, 0], Cm[:, 0], ssm_state)
            y = y[:, None]
        else:
            y, new_ssm = _scan(xs, dt, layer.A, Bm, Cm, ssm_state)
        y = y + layer.D[:, None] * xs
        y = _gated_norm(y.reshape(B, T, -1), z, layer.gate_norm, G, cfg.rms_norm_eps)
        return layer.out_proj(y.reshape(B * T, -1)).reshape(B, T, -1), new_conv, new_ssm

    def new_state(self) -> list[torch.Tensor]:
        return [torch.zeros(s) for s in self.state_shapes()]


def _step(x, dt, A, Bm, Cm, h):
    """One token of the recurrence (transformers' selective_state_update): x [B, H, P], dt [B, H], Bm / Cm
    [B, H, N], h [B, H, P, N] -> y [B, H, P], h'."""
    dA = torch.exp(dt * A)  # [B, H]
    h = h * dA[..., None, None] + (dt[..., None] * x)[..., None] * Bm[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", h, Cm), h


def _scan(x, dt, A, Bm, Cm, h):
    """T tokens at once, in sub-chunks of SCAN_CHUNK (SSD): within a sub-chunk y_t = sum_{s<=t} (C_t . B_s)
    exp(sum_{s<r<=t} a_r) dt_s x_s + exp(sum_{r<=t} a_r) C_t h0, with a = dt A; h carried to the next.
    x [B, T, H, P], dt [B, T, H], Bm / Cm [B, T, H, N], h [B, H, P, N]."""
    T = x.shape[1]
    ys = []
    for s in range(0, T, SCAN_CHUNK):
        e = min(T, s + SCAN_CHUNK)
        xc, dtc, bc, cc = x[:, s:e], dt[:, s:e], Bm[:, s:e], Cm[:, s:e]
        a = (dtc * A).transpose(1, 2)  # [B, H, L]
        cum = torch.cumsum(a, -1)
        decay = torch.exp(_segment_sum(a))  # [B, H, L(t), L(s)]: exp(sum_{s<r<=t} a_r), 0 above the diagonal
        xdt = xc * dtc[..., None]  # [B, L, H, P]
        scores = torch.einsum("bthn,bshn->bhts", cc, bc) * decay
        y = torch.einsum("bhts,bshp->bthp", scores, xdt)
        y = y + torch.einsum("bthn,bhpn->bthp", cc, h) * torch.exp(cum).transpose(1, 2)[..., None]
        to_end = torch.exp(cum[..., -1:] - cum)  # [B, H, L]: decay from each row to the chunk's end
        h = h * torch.exp(cum[..., -1])[..., None, None] + torch.einsum("blhn,bhl,blhp->bhpn", bc, to_end, xdt)
        ys.append(y)
    return torch.cat(ys, 1), h


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[t, s] = a[s+1] + ... + a[t] for s <= t, -inf above the diagonal; summed
    directly (as transformers' segment_sum), not as a difference of cumulative sums, which loses the small
    sums' precision."""
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)  # x[..., r, s] = a[r]
    x = x.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool)), -torch.inf)


def _gated_norm(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """transformers' MambaRMSNormGated: y * SiLU(z), RMS-normalised within each of `groups` groups, times w."""
    y = y * F.silu(z)
    g = y.reshape(*y.shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return w * g.reshape(y.shape)
