"""Attention over the paged KV cache: the PyTorch reference that the CPU path runs.

On CUDA, decode steps without a window / chunk over a format the kernels support go to
kvgen.gpu.ops.flash_decode (`attend` dispatches); everything else runs the torch code below on
whatever device q is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvgen.engine.kv.formats import KVFormat
from kvgen.gpu import ops as gpu_ops  # imports without CuPy; only called on CUDA tensors


@dataclass(slots=True)
class Step:
    """What one forward pass computes: several sequences, each a run of new tokens."""

    positions: torch.Tensor  # [T] position of each new token
    write_blocks: torch.Tensor  # [T] block each new token's K/V goes to
    write_offsets: torch.Tensor  # [T] offset inside that block
    query_lens: list[int]  # new tokens per sequence (1 for decode)
    context_lens: list[int]  # K/V length per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    logits_rows: torch.Tensor  # [B] row of each sequence's last new token
    is_decode: bool  # every sequence has exactly one new token
    kv_starts: list[int] | None = None  # position of each table's first key (blocks before it freed)
    window: int = 0  # sliding window: a query sees the last `window` positions (0 = all)
    chunk: int = 0  # chunked attention: a query sees its own chunk of `chunk` positions (0 = off)
    # (block tables, context lens) as int32 on q's device for flash_decode: made by the first
    # layer that needs them, reused by the others
    kernel_args: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_plan: tuple | None = None  # made by the first layer's decode attention (_decode_plan)


def attend(q: torch.Tensor, fmt: KVFormat, store: dict, layer: int, step: Step) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], reading K/V (already written) through the block tables."""
    if step.is_decode:
        if q.is_cuda and _flash_ok(fmt, step):
            return _flash_decode(q, fmt, store, layer, step)
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
        if n == ctx and not (step.window or step.chunk):
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
        else:
            dev = q.device
            mask = visible(torch.arange(ctx - n, ctx, device=dev), torch.arange(k0, ctx, device=dev), step)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
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


def _flash_ok(fmt, step: Step) -> bool:
    return (fmt.name in gpu_ops.FORMATS and not fmt.recent_slots  # the kernels do not read the stage
            and not (step.window or step.chunk or step.kv_starts))


def _flash_decode(q, fmt, store, layer, step):
    if step.kernel_args is None:
        step.kernel_args = (step.block_tables.to(device=q.device, dtype=torch.int32),
                            torch.tensor(step.context_lens, dtype=torch.int32).to(q.device))
    tables, lens = step.kernel_args
    # K/V of the new token is already written (Model.forward writes before attending), so the
    # lengths include it: len_offset 0.
    return gpu_ops.flash_decode(q, fmt, store, layer, tables, lens)


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
    o = F.scaled_dot_product_attention(q.view(B, H, 1, D), k, v, attn_mask=keep, enable_gqa=True)
    return o.view(B, H, D)


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
