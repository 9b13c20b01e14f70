"""The token embedding table, looked up a few rows at a time.

A GGUF keeps it quantized like any other matrix (Q8_0, Q6_K, Q4_K ...). A step reads one row per
token, so the table stays in the file's own encoding, memory-mapped (only the rows ever read are
resident), and the rows a step needs are dequantized then, by gguf-py's own dequantize: the same
floats a dequantized table would hold, without the table (SmolLM2's is 113 MiB as fp32, a 1.7B
model's 400 MiB, an 8B's 0.5-2 GiB). A float table (an HF folder's, a GGUF's F16 / F32 one) is
kept as a tensor and indexed.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize


class TokenEmbedding:
    """embedding[ids] -> [len(ids), hidden] in `dtype`; rows(ids) -> float32 numpy rows."""

    def __init__(self, table: torch.Tensor | None = None, raw: np.ndarray | None = None, qtype=None,
                 hidden: int = 0, dtype: torch.dtype = torch.float32):
        self.table, self.raw, self.qtype, self.dtype = table, raw, qtype, dtype
        self.hidden = table.shape[1] if table is not None else hidden

    @classmethod
    def floats(cls, table: torch.Tensor) -> TokenEmbedding:
        return cls(table=table, dtype=table.dtype)

    @classmethod
    def quantized(cls, raw: np.ndarray, qtype, hidden: int, dtype: torch.dtype = torch.float32) -> TokenEmbedding:
        """raw: the GGUF tensor's bytes, [vocab, bytes a row] (GGUFReader's memory-mapped view)."""
        return cls(raw=raw, qtype=qtype, hidden=hidden, dtype=dtype)

    @property
    def num_rows(self) -> int:
        return (self.table if self.table is not None else self.raw).shape[0]

    @property
    def nbytes(self) -> int:
        return (self.table if self.table is not None else self.raw).nbytes

    def rows(self, ids) -> np.ndarray:
        """float32 [len(ids), hidden], a fresh array (the fused step writes its residual stream into it)."""
        ids = np.asarray(ids, np.int64)
        if self.table is not None:
            return self.table[torch.from_numpy(ids)].float().numpy()
        if ids.size and not (0 <= ids.min() and ids.max() < self.num_rows):
            raise IndexError(f"token ids {ids.min()}..{ids.max()} outside the embedding's {self.num_rows} rows")
        return np.ascontiguousarray(dequantize(self.raw[ids], self.qtype).reshape(len(ids), self.hidden),
                                    dtype=np.float32)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[ids]
        flat = ids.reshape(-1).cpu().numpy()
        out = torch.from_numpy(self.rows(flat)).reshape(*ids.shape, self.hidden)
        return out.to(device=ids.device, dtype=self.dtype)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> TokenEmbedding:
        """On another device a table of floats (the GPU path's weights are floats anyway)."""
        dtype = dtype or self.dtype
        if self.table is None:
            table = torch.from_numpy(self.rows(np.arange(self.num_rows)))
            return TokenEmbedding.floats(table.to(device=device, dtype=dtype))
        return TokenEmbedding.floats(self.table.to(device=device, dtype=dtype))
