"""How KV blocks are stored: one class per KV_DTYPE, all behind the same four calls.

A format owns a dict of tensors ("the store") whose leading dims are
[num_blocks, num_layers, 2 (k, v), block_size, ...], so a block is one contiguous slice of
every tensor: tiers move it with `store[name][block]` and GPU kernels index it with a
block table and a block stride.
"""

from __future__ import annotations

import torch


class KVFormat:
    name: str = ""

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 compute_dtype: torch.dtype = torch.float32):
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def write(self, store: dict[str, torch.Tensor], layer: int, blocks: torch.Tensor,
              offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at (blocks[i], offsets[i]) for one layer."""
        raise NotImplementedError

    def read(self, store: dict[str, torch.Tensor], layer: int,
             block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks for one layer: [M, block_size, kv_heads, head_dim] each."""
        raise NotImplementedError

    def bytes_per_block(self) -> int:
        store = self.allocate(1, "meta")
        return sum(t.numel() * t.element_size() for t in store.values())

    def bytes_per_token_per_layer(self) -> float:
        return self.bytes_per_block() / (self.block_size * self.num_layers)


class PlainFormat(KVFormat):
    """fp32 / fp16 / bf16: values stored as they are (cast)."""

    def __init__(self, *args, dtype: torch.dtype, **kwargs):
        super().__init__(*args, **kwargs)
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def allocate(self, num_blocks, device="cpu"):
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return {"kv": torch.zeros(shape, dtype=self.dtype, device=device)}

    def write(self, store, layer, blocks, offsets, k, v):
        kv = store["kv"]
        kv[blocks, layer, 0, offsets] = k.to(self.dtype)
        kv[blocks, layer, 1, offsets] = v.to(self.dtype)

    def read(self, store, layer, block_ids):
        kv = store["kv"][block_ids, layer]  # [M, 2, block, kvh, hd]
        return kv[:, 0].to(self.compute_dtype), kv[:, 1].to(self.compute_dtype)


KV_DTYPES = ("fp32", "fp16", "bf16")


def make_format(name: str, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                compute_dtype: torch.dtype = torch.float32) -> KVFormat:
    args = (num_layers, block_size, num_kv_heads, head_dim)
    plain = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name in plain:
        return PlainFormat(*args, dtype=plain[name], compute_dtype=compute_dtype)
    raise ValueError(f"unknown KV dtype {name!r}; expected one of {', '.join(KV_DTYPES)}")
