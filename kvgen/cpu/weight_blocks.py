"""Weights kept in the GGUF file's own quantization blocks (WEIGHT_DTYPE=gguf, auto's CPU choice).

A Q4_1 file holds every weight as 4-bit codes with an fp16 scale and minimum per 32 inputs;
dequantized, that is exactly the fp32 matrix transformers (the oracle) runs. `WeightBlocks` keeps the
codes as they are (rows can still be permuted and concatenated, which the model does to fuse
q|k|v and gate|up), and `BlockLinear` multiplies fp32 activations by them with the Numba kernels
in vector_matmul.py: a decode step reads 5 bits a weight instead of 32. The kernels round the
activations to int16 per block of 32 (2^-16 of the block's largest), so the output is the fp32
matmul's to about 1e-4, where llama.cpp's 8-bit activations lose 2^-8.

Every call runs the kernels, however many rows: a prompt chunk of 512 rows too. On an AVX-512 CPU
they outrun torch's fp32 matmul at every row count (512-token prefill 616 -> 877 tok/s on a Zen 4
when chunks past 32 rows stopped taking an fp32 copy). On an AVX2 Zen 3 the kernels before the
current ones were 20% slower than the fp32 matmul at 64 rows (179 against 150 ms, every layer);
the current ones have not been timed there. One kernel for every row count makes a row's output
independent of how many rows share the call (a prompt chunk's matmuls do not depend on how the
prompt is cut), and no fp32 copy of the weights is kept (the embedded SmolLM2 loads in 1,132 MB
of RSS instead of 1,586).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgen.cpu import amx_matmul, block_matmul, features, vector_matmul
from kvgen.cpu.vector_matmul import TILE

GROUP = 32
# Types kept as blocks: (bytes per block, layout). Q4_0 is Q4_1 with m = -8 d.
BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass
class WeightBlocks:
    """One weight [N, K] in blocks of 32 inputs: d, m [N, K/32] float32 (m None for Q8_0);
    qs [N, K/32, 16] uint8 (Q4: byte j holds inputs j and j + 16) or [N, K/32, 32] int8 (Q8)."""

    kind: str  # "q4" or "q8"
    d: torch.Tensor
    m: torch.Tensor | None
    qs: torch.Tensor

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray) -> WeightBlocks:
        """raw: the tensor's bytes, [N, K/32 * block bytes] (gguf.GGUFReader's tensor.data)."""
        size = BLOCK_TYPES[type_name]
        b = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
        d = torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
        if type_name == "Q8_0":
            return cls("q8", d, None, torch.from_numpy(b[..., 2:].copy().view(np.int8)))
        if type_name == "Q4_1":
            m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
            return cls("q4", d, m, torch.from_numpy(b[..., 4:].copy()))
        return cls("q4", d, -8 * d, torch.from_numpy(b[..., 2:].copy()))

    @classmethod
    def q8_from_float(cls, w: torch.Tensor) -> WeightBlocks:
        """Q8_0 blocks of a float weight [N, K] (K a multiple of 32), as llama.cpp's
        quantize_row_q8_0 makes them: per block the scale amax / 127 (kept in float32 here) and
        each input rounded to the nearest code."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        d = g.abs().amax(-1) / 127
        qs = torch.round(g / torch.where(d > 0, d, 1)[..., None]).clamp(-127, 127).to(torch.int8)
        return cls("q8", d, None, qs)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * GROUP

    def map_rows(self, fn) -> WeightBlocks:
        """The same weight with its rows rearranged by fn (a function of a tensor's first dim)."""
        return WeightBlocks(self.kind, fn(self.d), None if self.m is None else fn(self.m), fn(self.qs))

    @staticmethod
    def cat(parts: list[WeightBlocks]) -> WeightBlocks:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse blocks of kinds {sorted(kinds)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return WeightBlocks(parts[0].kind, torch.cat([p.d for p in parts]), m, torch.cat([p.qs for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: what gguf.quants.dequantize gives for the same bytes."""
        if self.kind == "q8":
            w = self.qs.float() * self.d[..., None]
        else:
            q = torch.cat((self.qs & 15, self.qs >> 4), -1).float()  # [N, G, 32] in input order
            w = q * self.d[..., None] + self.m[..., None]
        return w.reshape(self.shape)


def compile_kernels() -> None:
    """Compile (or load from Numba's on-disk cache) every block kernel once, on tiny arrays, so
    that model loading pays for it and not the first request (tens of seconds on a fresh machine).

    The parallel kernels come first, each for both code types (decode_step's step compiles its
    head's call to either kernel with the head's codes): a cached function that calls a parallel
    one segfaults when a process loads it from the cache before the callee (numba/numba#8578,
    reproduced here with q4_linear over q4_matmul), so every process loads the callees first."""
    x = np.zeros((1, GROUP), np.float32)
    y, d, room = np.zeros((1, TILE), np.float32), np.zeros((1, 1, TILE), np.float32), vector_matmul.scratch(1, GROUP)
    scales = np.zeros((1, 1), np.float32)
    vector_matmul.round_rows_parallel(x, np.zeros((1, GROUP), np.int16), scales, scales)  # quantize's callee
    xq, dx, xs = vector_matmul.quantize(x)
    for dtype in (np.uint8, np.int8):
        vector_matmul.q4_matmul(xq, dx, xs, np.zeros((1, 1, 8, TILE, 2), dtype), d, d, y)
        vector_matmul.q8_matmul(xq, dx, np.zeros((1, 1, 16, TILE, 2), dtype), d, y)
    if features.AMX:  # the tiles' kernels too, callees first: split, tile_matmul, then its wrappers
        amx_matmul.split(xq)
        for dtype in (np.uint8, np.int8):
            amx_matmul.tile_matmul(True, xq, dx, xs, np.zeros((1, 1, 8, TILE, 2), dtype), d, d, y)
            amx_matmul.q4_matmul(xq, dx, xs, np.zeros((1, 1, 8, TILE, 2), dtype), d, d, y)
            amx_matmul.q8_matmul(xq, dx, np.zeros((1, 1, 16, TILE, 2), dtype), d, y)
    block_matmul.q4_linear(x, np.zeros((1, 1, 8, TILE, 2), np.uint8), d, d, y, room)
    block_matmul.q8_linear(x, np.zeros((1, 1, 16, TILE, 2), np.int8), d, y, room)


class BlockLinear:
    """y = x W^T (+ b) for W in blocks, fp32 activations."""

    dtype = "gguf"

    def __init__(self, blocks: WeightBlocks, b: torch.Tensor | None):
        self.kind, self.b = blocks.kind, b
        self.out_features, self.in_features = blocks.shape
        pad = -self.out_features % TILE  # the kernels work in whole tiles of output rows
        n = self.out_features + pad

        def tiled(t: torch.Tensor) -> np.ndarray:  # [N, G, ...] -> [N/TILE, G, ..., TILE]
            t = torch.cat((t, t.new_zeros((pad, *t.shape[1:])))) if pad else t
            t = t.reshape(n // TILE, TILE, *t.shape[1:])
            return np.ascontiguousarray(t.movedim(1, -1).numpy())

        # codes [N, G, B] -> [N, G, B/2, 2] (pairs of neighbouring bytes) -> [N/TILE, G, B/2, TILE, 2]
        pairs = tiled(blocks.qs.reshape(*blocks.qs.shape[:2], -1, 2))
        self.qs = np.ascontiguousarray(np.swapaxes(pairs, -1, -2))
        self.d = tiled(blocks.d)
        self.m = tiled(blocks.m) if blocks.m is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous().numpy()
        y = np.empty((x.shape[0], self.d.shape[0] * TILE), np.float32)
        room = vector_matmul.scratch(*x.shape)
        if self.kind == "q4":
            block_matmul.q4_linear(x, self.qs, self.d, self.m, y, room)
        else:
            block_matmul.q8_linear(x, self.qs, self.d, y, room)
        out = torch.from_numpy(y)
        if y.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out if self.b is None else out + self.b
