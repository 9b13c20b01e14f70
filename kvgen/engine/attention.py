"""Attention over the paged KV cache: the two backends Model.forward's layer loop calls.

Each layer hands its new q, k, v to `backend.write_and_attend(fmt, store, layer, q, k, v, step)`,
which stores k, v in the cache and returns the attention output. Two backends:

TorchAttention   fmt.write, then the PyTorch code below (prefill, mixed and decode steps, any
                 format, windows, chunks and Gemma 2's score soft-capping; the CPU path, and every
                 step the kernels do not take).
KernelAttention  kv_append + flash_decode (kvgen.gpu.ops) for decode steps: positions and lengths
                 come from device tensors (KernelStep), so a forward over them can be captured in
                 a CUDA graph. It gets the kernels handed in; model_runner picks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.engine.kv.formats import KVFormat


@dataclass(slots=True)
class Step:
    """What one forward pass computes: several sequences, each a run of new tokens."""

    positions: torch.Tensor  # [T] position of each new token
    write_blocks: torch.Tensor  # [T] block each new token's K/V goes to
    write_offsets: torch.Tensor  # [T] offset inside that block
    query_lens: list[int]  # new tokens per sequence (1 for decode)
    context_lens: list[int]  # K/V length per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    logits_rows: torch.Tensor | None  # [B] row of each sequence's last new token (None: every row)
    is_decode: bool  # every sequence has exactly one new token
    kv_starts: list[int] | None = None  # position of each table's first key (blocks before it freed)
    window: int = 0  # sliding window: a query sees the last `window` positions (0 = all)
    chunk: int = 0  # chunked attention: a query sees its own chunk of `chunk` positions (0 = off)
    decode_plan: tuple | None = None  # made by the first layer's decode attention (_decode_plan)
    softcap: float = 0.0  # attention logit soft-capping (Gemma 2): scores = cap * tanh(scores / cap) (0 = off)


class TorchAttention:
    """The reference backend: the format's own write, then `attend`."""

    @staticmethod
    def write_and_attend(fmt: KVFormat, store: dict, layer: int, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, step: Step) -> torch.Tensor:
        fmt.write(store, layer, step.write_blocks, step.write_offsets, k, v, step.positions)
        return attend(q, fmt, store, layer, step)


TORCH_ATTENTION = TorchAttention()


@dataclass(slots=True)
class KernelStep:
    """A decode step as the kernels read it, one new token per row and device tensors only (the
    same shapes on every call), so the forward over it can be captured once and replayed."""

    block_tables: torch.Tensor  # [B, width] int32, padded with -1
    seq_lens: torch.Tensor  # [B] int32 tokens already cached = the new token's position; -1: padding row
    positions: torch.Tensor  # [B] int64 for the RoPE lookup (padding rows: 0, to stay in range)
    logits_rows: None = None  # logits of every row

    @classmethod
    def of(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> KernelStep:
        return cls(block_tables, seq_lens, seq_lens.clamp_min(0).long())


class KernelAttention:
    """Decode attention through the GPU kernels. kernels: kvgen.gpu.ops, or anything with its
    kv_append / flash_decode / increment (tests run torch references and host-emulated kernels)."""

    def __init__(self, kernels):
        self.kernels = kernels

    def write_and_attend(self, fmt: KVFormat, store: dict, layer: int, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, step: KernelStep) -> torch.Tensor:
        self.kernels.kv_append(fmt, store, layer, k, v, step.block_tables, step.seq_lens)  # at seq_lens[row]
        # the lengths count the tokens before this one, which is written already: len_offset 1
        return self.kernels.flash_decode(q, fmt, store, layer, step.block_tables, step.seq_lens, len_offset=1)

    def advance(self, step: KernelStep) -> None:
        """Count the step's token in the device-side lengths (once, after the last layer)."""
        self.kernels.increment(step.seq_lens)


def attend(q: torch.Tensor, fmt: KVFormat, store: dict, layer: int, step: Step) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], reading K/V (already written) through the block tables."""
    if step.is_decode:
        return _decode(q, fmt, store, layer, step)
    out = []
    start = 0
    for i, (n, ctx) in enumerate(zip(step.query_lens, step.context_lens, strict=True)):
        k0 = step.kv_starts[i] if step.kv_starts else 0
        n_keys = ctx - k0
        k, v = fmt.read(store, layer, step.block_tables[i, : -(-n_keys // fmt.block_size)])
        # 4-D inputs: only they reach torch's CPU flash kernel (3-D falls back to the math path).
        k = k.reshape(1, -1, fmt.num_kv_heads, fmt.head_dim)[:, :n_keys].transpose(1, 2)  # [1, KVH, L, D]
        v = v.reshape(1, -1, fmt.num_kv_heads, fmt.head_dim)[:, :n_keys].transpose(1, 2)
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if n == ctx and not (step.window or step.chunk or step.softcap):
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
        else:
            dev = q.device
            mask = visible(torch.arange(ctx - n, ctx, device=dev), torch.arange(k0, ctx, device=dev), step)
            o = _sdpa(qi, k, v, mask, step.softcap)
        out.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(out) if len(out) > 1 else out[0]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, step: Step) -> torch.Tensor:
    """[..., nq, nk] bool: which keys each query may attend to (causal, window, chunk)."""
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    mask = kp <= qp
    if step.window:
        mask &= kp > qp - step.window
    if step.chunk:
        mask &= kp >= qp - qp % step.chunk
    return mask


def _decode(q, fmt, store, layer, step):
    # One query per sequence: gather every sequence's blocks at once, pad to the longest,
    # and let each KV head serve its whole group of query heads (GQA without copies).
    B, H, D = q.shape
    kvh = fmt.num_kv_heads
    if step.decode_plan is None:
        step.decode_plan = _decode_plan(step, fmt.block_size, q.device)
    table, max_keys, keep = step.decode_plan
    k, v = fmt.read(store, layer, table)
    k = k.reshape(B, -1, kvh, D)[:, :max_keys].transpose(1, 2)  # [B, KVH, L, D]
    v = v.reshape(B, -1, kvh, D)[:, :max_keys].transpose(1, 2)
    o = _sdpa(q.view(B, H, 1, D), k, v, keep, step.softcap)
    return o.view(B, H, D)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, softcap: float) -> torch.Tensor:
    """SDPA (q [B, H, n, D], k / v [B, KVH, L, D], keep: bool, broadcast to [B, H, n, L] or None), with the
    scores soft-capped before the mask and softmax where softcap: SDPA has no hook between the two, so that
    runs as matmul, tanh, softmax, matmul (transformers' eager Gemma 2 attention, in the same order)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # each KV head serves its group of query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _decode_plan(step: Step, block_size: int, device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """What every layer's decode attention shares: the flat block table, the longest key run,
    and which keys each sequence sees ([B, 1, 1, L] bool; None when all see every key)."""
    B = len(step.context_lens)
    starts = step.kv_starts or [0] * B
    n_keys = [c - s for c, s in zip(step.context_lens, starts, strict=True)]
    max_keys = max(n_keys)
    table = step.block_tables[:, : -(-max_keys // block_size)].reshape(-1)
    if not (step.window or step.chunk) and min(n_keys) == max_keys:
        return table, max_keys, None
    ctx = torch.tensor(step.context_lens, device=device)[:, None]
    k_pos = torch.tensor(starts, device=device)[:, None] + torch.arange(max_keys, device=device)[None, :]
    keep = k_pos < ctx  # padding past a shorter sequence's end
    if step.window or step.chunk:
        keep &= visible(ctx - 1, k_pos, step)[:, 0]
    return table, max_keys, keep[:, None, None, :]
