"""Attention over the paged KV cache: the PyTorch reference that the CPU path runs.

The GPU path plugs into `attend` with the same arguments (kvgen.gpu.ops.flash_decode).
"""

from __future__ import annotations

import math
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
    logits_rows: torch.Tensor  # [B] row of each sequence's last new token
    is_decode: bool  # every sequence has exactly one new token

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def attend(q: torch.Tensor, fmt: KVFormat, store: dict, layer: int, step: Step) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], reading K/V (already written) through the block tables."""
    if step.is_decode:
        return _decode(q, fmt, store, layer, step)
    out = []
    start = 0
    for i, (n, ctx) in enumerate(zip(step.query_lens, step.context_lens, strict=True)):
        n_blocks = -(-ctx // fmt.block_size)
        k, v = fmt.read(store, layer, step.block_tables[i, :n_blocks])
        k = k.reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:ctx].transpose(0, 1)  # [KVH, L, D]
        v = v.reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:ctx].transpose(0, 1)
        qi = q[start:start + n].transpose(0, 1)  # [H, n, D]
        if n == ctx:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
        else:  # a chunk after cached tokens: query i sees keys up to ctx - n + i
            mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out) if len(out) > 1 else out[0]


def _decode(q, fmt, store, layer, step):
    # One query per sequence: gather every sequence's blocks at once, pad to the longest,
    # and let each KV head serve its whole group of query heads (GQA without copies).
    B, H, D = q.shape
    kvh = fmt.num_kv_heads
    max_ctx = max(step.context_lens)
    n_blocks = -(-max_ctx // fmt.block_size)
    table = step.block_tables[:, :n_blocks]
    k, v = fmt.read(store, layer, table.reshape(-1))
    k = k.reshape(B, -1, kvh, D)[:, :max_ctx].permute(0, 2, 3, 1)  # [B, KVH, D, L]
    v = v.reshape(B, -1, kvh, D)[:, :max_ctx].transpose(1, 2)  # [B, KVH, L, D]
    qg = q.view(B, kvh, H // kvh, D)
    scores = torch.matmul(qg, k.to(q.dtype)) * (1.0 / math.sqrt(D))  # [B, KVH, G, L]
    if B > 1 and min(step.context_lens) < max_ctx:
        lens = torch.tensor(step.context_lens)
        pad = torch.arange(max_ctx)[None, :] >= lens[:, None]
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v.to(q.dtype)).view(B, H, D)
