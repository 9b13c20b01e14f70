"""Torch references for the GPU kernels, written with the KV formats' own read / write so they
hold for every KV_DTYPE. Slow and simple on purpose; CPU or GPU tensors."""

from __future__ import annotations

import math

import torch


def paged_decode_reference(q: torch.Tensor, fmt, store: dict[str, torch.Tensor], layer: int,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           sm_scale: float | None = None) -> torch.Tensor:
    """Decode attention through the block table, float32 [B, H, head_dim].

    Row b: gather its first ceil(len / block_size) blocks with fmt.read, keep len =
    context_lens[b] tokens, out = softmax(q k^T * sm_scale) v with query head h reading kv head
    h // (H // kv_heads). len <= 0 gives zeros."""
    b_n, h_n, hd = q.shape
    kvh = fmt.num_kv_heads
    group = h_n // kvh
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    out = torch.zeros((b_n, h_n, hd), dtype=torch.float32, device=q.device)
    lens = context_lens.tolist()
    for b in range(b_n):
        n = int(lens[b])
        if n <= 0:
            continue
        n_blocks = -(-n // fmt.block_size)
        ids = block_tables[b, :n_blocks].long()
        k, v = fmt.read(store, layer, ids)  # [n_blocks, BS, KVH, HD]
        k = k.float().reshape(-1, kvh, hd)[:n].repeat_interleave(group, dim=1)  # [n, H, HD]
        v = v.float().reshape(-1, kvh, hd)[:n].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def kv_append_reference(fmt, store: dict[str, torch.Tensor], layer: int, k: torch.Tensor, v: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """What ops.kv_append does, through fmt.write: row b's k[b], v[b] go to position
    seq_lens[b]; padding rows (seq_lens < 0, past the table, or a -1 entry) write nothing."""
    bs = fmt.block_size
    tables = block_tables.tolist()
    dev = k.device
    for b, pos in enumerate(seq_lens.tolist()):
        if pos < 0 or pos // bs >= len(tables[b]) or tables[b][pos // bs] < 0:
            continue
        # One row per write: rows never share a block, but this keeps the reference plainly
        # sequential (fp8's requantisation would make any order visible).
        fmt.write(store, layer, torch.tensor([tables[b][pos // bs]], device=dev),
                  torch.tensor([pos % bs], device=dev), k[b:b + 1], v[b:b + 1])
