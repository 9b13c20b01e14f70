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
# The single table of which GGUF types run on which kind of blocks: type: (kind, bytes per block,
# inputs per block). Every weight's value is its integer code times float32 scales, exactly what
# gguf-py's dequantize gives (a K-quant's 6-bit or int8 sub-block scale times its fp16 d is exact
# in float32):
#   q4    nibbles, d and m per 32: Q4_0 (m = -8 d), Q4_1, Q4_K (d sc, -dmin mn)
#   q8    int8 codes, d per 32: Q8_0, Q5_0 (q - 16), IQ4_NL (its table's value), IQ4_XS (d (ls - 32))
#   q8m   int8 codes, d and m per 32: Q5_1, Q5_K
#   q8h   int8 codes, d per 16: Q6_K (q - 32), Q3_K (q - 4 where the high bit is clear)
#   q8hm  int8 codes, d and m per 16: Q2_K
BLOCK_TYPES = {
    "Q4_0": ("q4", 18, 32), "Q4_1": ("q4", 20, 32), "Q4_K": ("q4", 144, 256),
    "Q8_0": ("q8", 34, 32), "Q5_0": ("q8", 22, 32), "IQ4_NL": ("q8", 18, 32), "IQ4_XS": ("q8", 136, 256),
    "Q5_1": ("q8m", 24, 32), "Q5_K": ("q8m", 176, 256),
    "Q6_K": ("q8h", 210, 256), "Q3_K": ("q8h", 110, 256),
    "Q2_K": ("q8hm", 84, 256),
}
# IQ4_NL's and IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones (a 32-block's order)."""
    return np.concatenate((qs & 15, qs >> 4), -1)


def _bits(qh: np.ndarray, shifts, width: int) -> np.ndarray:
    """[..., n] bytes -> [..., len(shifts), n]: each byte's `width` bits from each shift."""
    return (qh[..., None, :] >> np.array(shifts, np.uint8)[:, None]) & ((1 << width) - 1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (sc, mn) [..., 8] (get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((d & 63, (md & 15) | ((d >> 2) & 48)), -1)
    mn = np.concatenate((m & 63, (md >> 4) | ((m >> 2) & 48)), -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _parse(type_name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """b [N, S, block bytes] -> (d, m or None, codes [N, S * inputs per block] in input order):
    d, m [N, G] float32 per 32 inputs, or [N, G, 2] per 16 (their first and second halves)."""
    n = b.shape[0]
    if type_name == "Q8_0":
        return _f16(b, 0), None, b[..., 2:].copy().view(np.int8)
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        high = _bits(b[..., at:at + 4], range(8), 1).swapaxes(-1, -2).reshape(*b.shape[:2], 32)  # bit i: input i
        q = (_nibbles(b[..., at + 4:]) | (high << 4)).astype(np.int8)
        return (_f16(b, 0), None, q - 16) if type_name == "Q5_0" else (_f16(b, 0), _f16(b, 2), q)
    if type_name == "IQ4_NL":
        return _f16(b, 0), None, IQ4_VALUES[_nibbles(b[..., 2:])]
    if type_name == "IQ4_XS":
        low = _bits(b[..., 4:8], (0, 4), 4).swapaxes(-1, -2).reshape(n, -1, 8)  # sub-block 2j, 2j+1: byte j
        h = b[..., 2:4].copy().view(np.uint16)  # [N, S, 1]: sub-block i's bits 2i, 2i + 1
        high = ((h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)
        ls = (low | (high << 4)).astype(np.int8) - np.int8(32)
        d = _f16(b, 0)[..., None] * ls.astype(np.float32)
        return d.reshape(n, -1), None, IQ4_VALUES[_nibbles(b[..., 8:].reshape(n, -1, 8, 16))]
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        d, m = _f16(b, 0)[..., None] * sc, -(_f16(b, 2)[..., None] * mn)
        qs = b[..., 16:144] if type_name == "Q4_K" else b[..., 48:176]
        q = np.stack((qs.reshape(n, -1, 4, 32) & 15, qs.reshape(n, -1, 4, 32) >> 4), -2)  # sub-blocks 2j, 2j+1
        if type_name == "Q5_K":
            q = q | (_bits(b[..., 16:48], range(8), 1).reshape(q.shape) << 4)  # bit k: sub-block k
            q = q.astype(np.int8)
        return d.reshape(n, -1), m.reshape(n, -1), q
    if type_name == "Q6_K":
        ql = b[..., :128].reshape(n, -1, 2, 64)
        ql = np.stack((ql & 15, ql >> 4), -2)  # [N, S, 2, 2, 64]: inputs 128 h + 64 e + i
        qh = _bits(b[..., 128:192].reshape(n, -1, 2, 32), (0, 2, 4, 6), 2)  # inputs 128 h + 32 s + i
        q = (ql.reshape(n, -1, 256) | (qh.reshape(n, -1, 256) << 4)).astype(np.int8) - np.int8(32)
        d = _f16(b, 208)[..., None] * b[..., 192:208].copy().view(np.int8).astype(np.float32)
        return d.reshape(n, -1, 2), None, q
    if type_name == "Q3_K":
        s = b[..., 96:108]
        low = _bits(s[..., :8], (0, 4), 4).reshape(n, -1, 16)  # scale 8 s + i: byte i's nibble s
        high = _bits(s[..., 8:], (0, 2, 4, 6), 2).reshape(n, -1, 16)  # scale 4 s + i: byte 8 + i's bits 2s
        sc = (low | (high << 4)).astype(np.int8) - np.int8(32)
        ql = _bits(b[..., 32:96].reshape(n, -1, 2, 32), (0, 2, 4, 6), 2).reshape(n, -1, 256)
        hm = _bits(b[..., :32], range(8), 1).reshape(n, -1, 256)  # bit k of byte i: input 32 k + i
        q = ql.astype(np.int8) - ((hm ^ 1) << 2).astype(np.int8)
        d = _f16(b, 108)[..., None] * sc.astype(np.float32)
        return d.reshape(n, -1, 2), None, q
    if type_name == "Q2_K":
        sc = b[..., :16]
        d = _f16(b, 80)[..., None] * (sc & 15).astype(np.float32)
        m = -(_f16(b, 82)[..., None] * (sc >> 4).astype(np.float32))
        q = _bits(b[..., 16:80].reshape(n, -1, 2, 32), (0, 2, 4, 6), 2).astype(np.int8)
        return d.reshape(n, -1, 2), m.reshape(n, -1, 2), q
    raise ValueError(f"no blocks for GGUF type {type_name}")


@dataclass
class WeightBlocks:
    """One weight [N, K] in blocks of 32 inputs (weight_blocks.BLOCK_TYPES lists the kinds):
    d, m [N, K/32] float32, or [N, K/32, 2] (q8h, q8hm: a scale per 16 inputs; m None where the
    kind has none); qs [N, K/32, 16] uint8 (q4: byte j holds inputs j and j + 16) or [N, K/32, 32]
    int8 (q8, q8m, q8h, q8hm)."""

    kind: str  # "q4", "q8", "q8m", "q8h" or "q8hm"
    d: torch.Tensor
    m: torch.Tensor | None
    qs: torch.Tensor

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray) -> WeightBlocks:
        """raw: the tensor's bytes, [N, K/block inputs * block bytes] (gguf.GGUFReader's tensor.data)."""
        kind, size, _ = BLOCK_TYPES[type_name]
        b = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)
        if type_name in ("Q4_0", "Q4_1"):  # the file's bytes are the q4 layout already
            d = torch.from_numpy(_f16(b, 0))
            if type_name == "Q4_1":
                return cls("q4", d, torch.from_numpy(_f16(b, 2)), torch.from_numpy(b[..., 4:].copy()))
            return cls("q4", d, -8 * d, torch.from_numpy(b[..., 2:].copy()))
        d, m, q = _parse(type_name, b)
        n, groups = d.shape[0], d.shape[1]
        q = q.reshape(n, groups, GROUP)
        if kind == "q4":  # byte j: input j in the low nibble, j + 16 in the high
            q = q[..., :16] | (q[..., 16:] << 4)
        m = None if m is None else torch.from_numpy(np.ascontiguousarray(m))
        return cls(kind, torch.from_numpy(np.ascontiguousarray(d)), m, torch.from_numpy(np.ascontiguousarray(q)))

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
        if self.kind == "q4":
            q = torch.cat((self.qs & 15, self.qs >> 4), -1).float()  # [N, G, 32] in input order
            return (q * self.d[..., None] + self.m[..., None]).reshape(self.shape)
        q = self.qs.float()
        if self.d.dim() == 3:  # a scale (and minimum) per 16 inputs
            q = q.reshape(*q.shape[:2], 2, 16)
        w = q * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(self.shape)


def compile_kernels() -> None:
    """Compile (or load from Numba's on-disk cache) every block kernel once, on tiny arrays, so
    that model loading pays for it and not the first request (tens of seconds on a fresh machine).

    The parallel kernels come first, q4's and q8's each for both code types (decode_step's step compiles its
    head's call to either kernel with the head's codes): a cached function that calls a parallel
    one segfaults when a process loads it from the cache before the callee (numba/numba#8578,
    reproduced here with q4_linear over q4_matmul), so every process loads the callees first."""
    x = np.zeros((1, GROUP), np.float32)
    y, d, room = np.zeros((1, TILE), np.float32), np.zeros((1, 1, TILE), np.float32), vector_matmul.scratch(1, GROUP)
    halves, sums = np.zeros((1, 1, 2, TILE), np.float32), np.zeros((1, 2), np.float32)
    scales = np.zeros((1, 1), np.float32)
    vector_matmul.round_rows_parallel(x, np.zeros((1, GROUP), np.int16), scales, scales)  # quantize's callee
    xq, dx, xs = vector_matmul.quantize(x)
    for dtype in (np.uint8, np.int8):
        vector_matmul.q4_matmul(xq, dx, xs, np.zeros((1, 1, 8, TILE, 2), dtype), d, d, y)
        vector_matmul.q8_matmul(xq, dx, np.zeros((1, 1, 16, TILE, 2), dtype), d, y)
    codes = np.zeros((1, 1, 16, TILE, 2), np.int8)  # the kinds below: int8 codes only, vectors only
    vector_matmul.q8m_matmul(xq, dx, xs, codes, d, d, y)
    vector_matmul.q8h_matmul(xq, dx, codes, halves, y)
    vector_matmul.q8hm_matmul(xq, dx, sums, codes, halves, halves, y)
    vector_matmul.half_sums(x, sums.reshape(-1))
    if features.AMX:  # the tiles' kernels too, callees first: split, tile_matmul, then its wrappers
        amx_matmul.split(xq)
        for dtype in (np.uint8, np.int8):
            amx_matmul.tile_matmul(True, xq, dx, xs, np.zeros((1, 1, 8, TILE, 2), dtype), d, d, y)
            amx_matmul.q4_matmul(xq, dx, xs, np.zeros((1, 1, 8, TILE, 2), dtype), d, d, y)
            amx_matmul.q8_matmul(xq, dx, np.zeros((1, 1, 16, TILE, 2), dtype), d, y)
    block_matmul.q4_linear(x, np.zeros((1, 1, 8, TILE, 2), np.uint8), d, d, y, room)
    block_matmul.q8_linear(x, np.zeros((1, 1, 16, TILE, 2), np.int8), d, y, room)
    block_matmul.q8m_linear(x, codes, d, d, y, room)
    block_matmul.q8h_linear(x, codes, halves, y, room)
    block_matmul.q8hm_linear(x, codes, halves, halves, y, room, sums.reshape(-1))


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
        elif self.kind == "q8":
            block_matmul.q8_linear(x, self.qs, self.d, y, room)
        elif self.kind == "q8m":
            block_matmul.q8m_linear(x, self.qs, self.d, self.m, y, room)
        elif self.kind == "q8h":
            block_matmul.q8h_linear(x, self.qs, self.d, y, room)
        else:
            sums = np.empty(x.shape[0] * (x.shape[1] // 16), np.float32)
            block_matmul.q8hm_linear(x, self.qs, self.d, self.m, y, room, sums)
        out = torch.from_numpy(y)
        if y.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out if self.b is None else out + self.b
