"""The seed's CompressedKVCache: chunk-wise mean pooling of K/V, for one sequence.

Every full chunk of `chunk_size` tokens is replaced by the mean of its keys and the mean of its
values; the tokens of the chunk still filling stay exact. `get(layer)` returns
[pooled chunks..., exact recent tokens], so memory and attention cost grow with
seq_len / chunk_size instead of seq_len. It is lossy by design: attention sees one averaged
key per chunk, and a pooled chunk cannot be cut apart again (hence the lossy truncate).

It speaks the CacheProvider verbs (update / get / seq_len / reset / truncate) over plain torch
tensors with the sequence on dim 0 (the engine's [tokens, kv_heads, head_dim]); it is not a
paged cache and has no block table.

Causality: update() pools a chunk as soon as it is full, even if the chunk was completed by
tokens of the same update. For one new token per step that is harmless (the token only sees
its own chunk's past). For a multi-token prefill, attend over get(layer) plus the new exact
K/V with a causal mask first and update() afterwards, or mask with `positions(layer)`.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 64  # the seed's default when chunkSize <= 0


class CompressedKVCache:
    def __init__(self, num_layers: int, chunk_size: int = DEFAULT_CHUNK):
        self.num_layers = num_layers
        self.chunk_size = chunk_size if chunk_size > 0 else DEFAULT_CHUNK
        self.reset()

    def reset(self) -> None:
        self._pooled: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self._recent: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self._len = [0] * self.num_layers  # original tokens per layer

    @property
    def seq_len(self) -> int:
        """Original tokens covered (pooled chunks count chunk_size each). Like PagedKVCache,
        a step's tokens count once the last layer has them."""
        return self._len[-1]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [n, ...] for one layer; chunks that become full are pooled."""
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        self._len[layer] += k.shape[0]
        recent = self._recent[layer]
        if recent is not None:
            k, v = torch.cat((recent[0], k)), torch.cat((recent[1], v))
        c = self.chunk_size
        full = k.shape[0] // c
        if full:
            # Average in float32 whatever the storage dtype: 64 bf16 adds would lose bits.
            pk, pv = (x[: full * c].reshape(full, c, *x.shape[1:]).float().mean(1).to(x.dtype) for x in (k, v))
            old = self._pooled[layer]
            self._pooled[layer] = (pk, pv) if old is None else (torch.cat((old[0], pk)), torch.cat((old[1], pv)))
        # clone: a view of the caller's tensor would keep all of it alive
        self._recent[layer] = (k[full * c:].clone(), v[full * c:].clone())

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V [num_chunks + recent, ...]: pooled chunks first, then the exact recent tokens;
        None before the layer's first update."""
        parts = [p for p in (self._pooled[layer], self._recent[layer]) if p is not None]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return torch.cat((parts[0][0], parts[1][0])), torch.cat((parts[0][1], parts[1][1]))

    def positions(self, layer: int) -> torch.Tensor:
        """For each row of get(layer): the last original position it covers (for causal masks)."""
        c = self.chunk_size
        chunks = 0 if self._pooled[layer] is None else self._pooled[layer][0].shape[0]
        recent = 0 if self._recent[layer] is None else self._recent[layer][0].shape[0]
        return torch.cat((torch.arange(1, chunks + 1) * c - 1, torch.arange(chunks * c, chunks * c + recent)))

    def truncate(self, new_len: int) -> int:
        """Keep the first new_len original tokens, as far as pooling allows; returns the new seq_len.

        Chunks wholly inside new_len stay and the recent tokens are trimmed to the rest. If
        new_len falls inside a pooled chunk, that chunk and everything after it go (a mean
        cannot be split), so seq_len drops to the chunk's start and the caller recomputes
        from there.
        """
        c = self.chunk_size
        for layer in range(self.num_layers):
            n = max(0, min(new_len, self._len[layer]))
            pooled, recent = self._pooled[layer], self._recent[layer]
            chunks = 0 if pooled is None else pooled[0].shape[0]
            if n >= chunks * c:
                if recent is not None:
                    keep = n - chunks * c
                    self._recent[layer] = (recent[0][:keep], recent[1][:keep])
                self._len[layer] = n
            else:
                keep = n // c
                self._pooled[layer] = (pooled[0][:keep], pooled[1][:keep]) if keep else None
                if recent is not None:
                    self._recent[layer] = (recent[0][:0], recent[1][:0])
                self._len[layer] = keep * c
            if self._len[layer] == 0:  # as before the first update
                self._pooled[layer] = self._recent[layer] = None
        return self.seq_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for part in (*self._pooled, *self._recent) if part is not None for t in part)
