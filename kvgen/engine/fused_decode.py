"""A one-sequence decode step as one Numba call, for gguf weights over a plain fp32 KV cache.

At batch 1 on a small model, torch's per-op dispatch is a third of the step: Model.forward issues
~30 ops per layer (norms, RoPE, the cache write and read, attention, the activation, residuals)
around its four matmuls, each a few microseconds of bookkeeping for a few hundred floats of work.
This is the same layer loop (model.py is the reference it is tested against) with every op a
loop in one compiled function, the matmuls being cpu_kernels' one-row kernels: the step costs the
weights' bytes and little else. It runs the steps it can (model_runner decides): one sequence,
one new token, fp32 keys and values, no window or chunk, no bias; every other step takes
Model.forward.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from kvgen.engine import cpu_kernels
from kvgen.engine.blocks import GROUP, BlockLinear


@njit(fastmath=True, cache=True)
def _rms_norm(h, w, eps, out):  # pragma: no cover - compiled
    ss = np.float32(0)
    for i in range(h.shape[0]):
        ss += h[i] * h[i]
    inv = np.float32(1) / math.sqrt(ss / h.shape[0] + eps)
    for i in range(h.shape[0]):
        out[i] = h[i] * inv * w[i]


@njit(fastmath=True, cache=True)
def _block_sums(x, out):  # pragma: no cover - compiled
    for g in range(out.shape[1]):
        s = np.float32(0)
        for j in range(32):
            s += x[0, g * 32 + j]
        out[0, g] = s


@njit(fastmath=True, cache=True)
def _rope(x, head, cos, sin):  # pragma: no cover - compiled
    """Rotate the interleaved pairs of x[head * D : (head + 1) * D] (model.py's layout)."""
    half = cos.shape[0]
    base = head * 2 * half
    for i in range(half):
        a, b = x[base + 2 * i], x[base + 2 * i + 1]
        x[base + 2 * i] = a * cos[i] - b * sin[i]
        x[base + 2 * i + 1] = a * sin[i] + b * cos[i]


@njit(parallel=True, fastmath=True, cache=True)
def _attend(q, kv, layer, table, n_keys, block, heads, kv_heads, head_dim, out):  # pragma: no cover
    """out[h] = softmax(q_h K^T / sqrt(D)) V over the sequence's n_keys cached positions."""
    group = heads // kv_heads
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for h in prange(heads):
        kh = h // group
        scores = np.empty(n_keys, np.float32)
        top = np.float32(-np.inf)
        for p in range(n_keys):
            b, o = table[p // block], p % block
            s = np.float32(0)
            for i in range(head_dim):
                s += q[h * head_dim + i] * kv[b, layer, 0, o, kh, i]
            s *= scale
            scores[p] = s
            top = max(top, s)
        total = np.float32(0)
        for p in range(n_keys):
            scores[p] = math.exp(scores[p] - top)
            total += scores[p]
        acc = np.zeros(head_dim, np.float32)
        for p in range(n_keys):
            b, o = table[p // block], p % block
            wgt = scores[p] / total
            for i in range(head_dim):
                acc[i] += wgt * kv[b, layer, 1, o, kh, i]
        for i in range(head_dim):
            out[h * head_dim + i] = acc[i]


@njit(fastmath=True, cache=True)
def _q4(x, xsum, w, layer, y):  # pragma: no cover - compiled
    _block_sums(x, xsum)
    cpu_kernels.q4_matmul(x, xsum, w[0][layer], w[1][layer], w[2][layer], y)


@njit(cache=True)
def _step(token, pos, table, kv, embed, ln1, ln2, norm, qkv, o, gate_up, down, head, head_q4, cos, sin,
          eps, heads, kv_heads, head_dim, inter, logits):  # pragma: no cover - compiled
    hidden = embed.shape[1]
    h = embed[token].copy()
    x = np.empty((1, hidden), np.float32)
    xs = np.empty((1, hidden // 32), np.float32)
    qkv_out = np.empty((1, qkv[0].shape[1] * qkv[0].shape[-1]), np.float32)
    att = np.empty((1, heads * head_dim), np.float32)
    o_out = np.empty((1, o[0].shape[1] * o[0].shape[-1]), np.float32)
    gu = np.empty((1, gate_up[0].shape[1] * gate_up[0].shape[-1]), np.float32)
    act = np.empty((1, inter), np.float32)
    act_s = np.empty((1, inter // 32), np.float32)
    d_out = np.empty((1, down[0].shape[1] * down[0].shape[-1]), np.float32)
    block = kv.shape[3]
    b, off = table[pos // block], pos % block
    nq, nk = heads * head_dim, kv_heads * head_dim
    for layer in range(ln1.shape[0]):
        _rms_norm(h, ln1[layer], eps, x[0])
        _q4(x, xs, qkv, layer, qkv_out)
        r = qkv_out[0]
        for hd in range(heads + kv_heads):  # q heads then k heads: adjacent in the fused output
            _rope(r, hd, cos[pos], sin[pos])
        for kh in range(kv_heads):
            for i in range(head_dim):
                kv[b, layer, 0, off, kh, i] = r[nq + kh * head_dim + i]
                kv[b, layer, 1, off, kh, i] = r[nq + nk + kh * head_dim + i]
        _attend(r, kv, layer, table, pos + 1, block, heads, kv_heads, head_dim, att[0])
        _q4(att, np.empty((1, att.shape[1] // 32), np.float32), o, layer, o_out)
        for i in range(hidden):
            h[i] += o_out[0, i]
        _rms_norm(h, ln2[layer], eps, x[0])
        _q4(x, xs, gate_up, layer, gu)
        for i in range(inter):
            g = gu[0, i]
            act[0, i] = g / (np.float32(1) + math.exp(-g)) * gu[0, inter + i]
        _q4(act, act_s, down, layer, d_out)
        for i in range(hidden):
            h[i] += d_out[0, i]
    _rms_norm(h, norm, eps, x[0])
    if head_q4:
        _block_sums(x, xs)
        cpu_kernels.q4_matmul(x, xs, head[0], head[1], head[2], logits)
    else:
        cpu_kernels.q8_matmul(x, head[0], head[1], logits)


def _stack(linears: list[BlockLinear]) -> tuple:
    """(qs, d, m) of every layer's linear, stacked along a new first axis."""
    return tuple(np.stack([getattr(lin, a) for lin in linears]) for a in ("qs", "d", "m"))


class FusedDecode:
    """Model.forward for one decode row, as one compiled call. `supports(model, fmt)` says whether
    a model and KV format can run it."""

    @staticmethod
    def supports(model, fmt) -> bool:
        lins = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return (model.device.type == "cpu" and model.weight_dtype == "gguf"
                and all(isinstance(lin, BlockLinear) and lin.kind == "q4" and lin.b is None for lin in lins)
                and isinstance(model.lm_head, BlockLinear) and model.lm_head.b is None
                and getattr(fmt, "name", "") == "fp32" and not fmt.recent_slots and fmt.qk_scale is None
                and model.cfg.hidden_size % GROUP == 0 and model.cfg.intermediate_size % GROUP == 0)

    def __init__(self, model):
        cfg = model.cfg
        layers = model.layers
        self.cfg = cfg
        self.embed = model.embed.contiguous().numpy()
        self.ln1 = np.stack([layer.ln1.w.numpy() for layer in layers])
        self.ln2 = np.stack([layer.ln2.w.numpy() for layer in layers])
        self.norm = model.norm.w.numpy()
        self.qkv = _stack([layer.qkv for layer in layers])
        self.o = _stack([layer.o for layer in layers])
        self.gate_up = _stack([layer.gate_up for layer in layers])
        self.down = _stack([layer.down for layer in layers])
        head = model.lm_head
        # (qs, d, m); Q8 has no m (the kernel call that reads it is not taken)
        self.head = (head.qs, head.d, head.m if head.kind == "q4" else head.d)
        self.head_q4 = head.kind == "q4"
        self.vocab = head.out_features
        self.padded_vocab = head.d.shape[0] * head.d.shape[-1]
        self.cos = np.ascontiguousarray(model.rot.real.numpy())
        self.sin = np.ascontiguousarray(model.rot.imag.numpy())

    def __call__(self, token: int, pos: int, blocks: list[int], store: dict) -> torch.Tensor:
        """Logits [1, vocab] of the token at pos; writes its K/V into the store's fp32 pool."""
        cfg = self.cfg
        logits = np.empty((1, self.padded_vocab), np.float32)
        _step(token, pos, np.asarray(blocks, dtype=np.int64), store["kv"].numpy(), self.embed, self.ln1, self.ln2,
              self.norm, self.qkv, self.o, self.gate_up, self.down, self.head, self.head_q4, self.cos, self.sin,
              np.float32(cfg.rms_norm_eps), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
              logits)
        return torch.from_numpy(logits[:, :self.vocab])
