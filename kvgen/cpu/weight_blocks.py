"""Weights kept in the GGUF file's own quantization blocks (WEIGHT_DTYPE=gguf, auto's CPU choice).

A Q4_1 file holds every weight as 4-bit codes with an fp16 scale and minimum per 32 inputs;
dequantized, that is exactly the fp32 matrix transformers (the oracle) runs. `WeightBlocks` keeps the
codes and the scales as they are (fp16, and a K-quant's sub-block scales as int8; rows can still be
permuted and concatenated, which the model does to fuse q|k|v and gate|up), and `BlockLinear`
multiplies fp32 activations by them with the Numba kernels in vector_matmul.py: a decode step
reads 5 bits a weight instead of 32 (a Q4_K one 4.625, its file 4.5). The kernels round the
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

from kvgen.cpu import amx_matmul, block_conversion, block_matmul, features, int8_matmul, int16_rounding, vector_matmul
from kvgen.cpu.block_conversion import AS_FILED, COMPILED_TYPES
from kvgen.cpu.vector_matmul import TILE
from kvgen.cpu.weight_arena import ALIGN, WeightArena

GROUP = 32
# The single table of which GGUF types run on which kind of blocks: type: (kind, bytes per block,
# inputs per block). Every weight's value is its integer code times its block's scale (plus its
# minimum), exactly what gguf-py's dequantize gives, and every scale is held as the file holds it:
# an fp16 per block of 32 (the types of 32-input blocks), or a K-quant's (and IQ4_XS's) fp16 per
# super-block of 256 and its int8 sub-block scales (the file's 6-bit, 4-bit or int8 ones); the
# kernels multiply the two, fp16 x int8 being exact in float32 (vector_matmul.block_scales):
#   q4    nibbles, d and m per 32: Q4_0 (m = -8 d, not held), Q4_1, Q4_K (d sc, -dmin mn)
#   q4i   nibbles indexing IQ4_VALUES, d per 32: IQ4_NL, IQ4_XS (d (ls - 32))
#   q8    int8 codes, d per 32: Q8_0
#   q3h   3-bit codes packed (a plane of 2 low bits and one of high bits), d per 16: Q3_K (q - 4 where the
#         high bit is clear)
#   q2hm  2-bit codes packed (a plane of 2 bits), d and m per 16: Q2_K
#   (q8h, q8hm: the same as int8 codes, the kernels' references in the tests; no file type runs on them)
#   q5    5-bit codes packed (nibbles and a plane of high bits), d per 32: Q5_0 (q - 16)
#   q5m   5-bit codes packed, d and m per 32: Q5_1, Q5_K
#   q6h   6-bit codes packed (nibbles and a plane of 2 high bits), d per 16: Q6_K (q - 32)
BLOCK_TYPES = {
    "Q4_0": ("q4", 18, 32), "Q4_1": ("q4", 20, 32), "Q4_K": ("q4", 144, 256),
    "Q8_0": ("q8", 34, 32), "IQ4_NL": ("q4i", 18, 32), "IQ4_XS": ("q4i", 136, 256),
    "Q3_K": ("q3h", 110, 256), "Q2_K": ("q2hm", 84, 256),
    "Q5_0": ("q5", 22, 32), "Q5_1": ("q5m", 24, 32), "Q5_K": ("q5m", 176, 256), "Q6_K": ("q6h", 210, 256),
}
PACKED = vector_matmul.PACKED  # the packed kinds: (high bits an input, the offset their codes take off)
LOW_BITS = vector_matmul.LOW_BITS  # a packed kind's low bits an input, where not 4
IQ4_VALUES = np.array(vector_matmul.IQ4_VALUES, np.int8)  # the values q4i's nibbles index
SUPER = vector_matmul.SUPER  # blocks of 32 a super-block of 256 inputs holds


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones (a 32-block's order)."""
    return np.concatenate((qs & 15, qs >> 4), -1)


def _bits(qh: np.ndarray, shifts, width: int) -> np.ndarray:
    """[..., n] bytes -> [..., len(shifts), n]: each byte's `width` bits from each shift."""
    return (qh[..., None, :] >> np.array(shifts, np.uint8)[:, None]) & ((1 << width) - 1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (sc, mn) [..., 8] int8 (get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((d & 63, (md & 15) | ((d >> 2) & 48)), -1)
    mn = np.concatenate((m & 63, (md >> 4) | ((m >> 2) & 48)), -1)
    return sc.astype(np.int8), mn.astype(np.int8)


def _parse(type_name: str, b: np.ndarray) -> tuple:
    """b [N, S, block bytes] -> (d, m, ds, ms, codes [N, S * inputs per block] in input order):
    d, m [N, S] fp16 per block (m None where the type has none); for the types of 256-input
    super-blocks d and m (-dmin) per super-block, and ds, ms their int8 sub-block scales, [N, 8 S]
    per 32 inputs or [N, 8 S, 2] per 16 (their first and second halves); None for the others."""
    n = b.shape[0]
    if type_name == "Q8_0":
        return _f16(b, 0), None, None, None, b[..., 2:].copy().view(np.int8)
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        high = _bits(b[..., at:at + 4], range(8), 1).swapaxes(-1, -2).reshape(*b.shape[:2], 32)  # bit i: input i
        q = (_nibbles(b[..., at + 4:]) | (high << 4)).astype(np.int8)
        return (_f16(b, 0), None, None, None, q - 16) if type_name == "Q5_0" else (_f16(b, 0), _f16(b, 2), None,
                                                                                    None, q)
    if type_name == "IQ4_NL":  # codes: the nibbles, indices into IQ4_VALUES
        return _f16(b, 0), None, None, None, _nibbles(b[..., 2:])
    if type_name == "IQ4_XS":
        low = _bits(b[..., 4:8], (0, 4), 4).swapaxes(-1, -2).reshape(n, -1, 8)  # sub-block 2j, 2j+1: byte j
        h = b[..., 2:4].copy().view(np.uint16)  # [N, S, 1]: sub-block i's bits 2i, 2i + 1
        high = ((h >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)
        ls = (low | (high << 4)).astype(np.int8) - np.int8(32)
        return _f16(b, 0), None, ls.reshape(n, -1), None, _nibbles(b[..., 8:].reshape(n, -1, 8, 16))
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., 16:144] if type_name == "Q4_K" else b[..., 48:176]
        q = np.stack((qs.reshape(n, -1, 4, 32) & 15, qs.reshape(n, -1, 4, 32) >> 4), -2)  # sub-blocks 2j, 2j+1
        if type_name == "Q5_K":
            q = q | (_bits(b[..., 16:48], range(8), 1).reshape(q.shape) << 4)  # bit k: sub-block k
            q = q.astype(np.int8)
        return _f16(b, 0), -_f16(b, 2), sc.reshape(n, -1), mn.reshape(n, -1), q
    if type_name == "Q6_K":
        ql = b[..., :128].reshape(n, -1, 2, 64)
        ql = np.stack((ql & 15, ql >> 4), -2)  # [N, S, 2, 2, 64]: inputs 128 h + 64 e + i
        qh = _bits(b[..., 128:192].reshape(n, -1, 2, 32), (0, 2, 4, 6), 2)  # inputs 128 h + 32 s + i
        q = (ql.reshape(n, -1, 256) | (qh.reshape(n, -1, 256) << 4)).astype(np.int8) - np.int8(32)
        return _f16(b, 208), None, b[..., 192:208].copy().view(np.int8).reshape(n, -1, 2), None, q
    if type_name == "Q3_K":
        s = b[..., 96:108]
        low = _bits(s[..., :8], (0, 4), 4).reshape(n, -1, 16)  # scale 8 s + i: byte i's nibble s
        high = _bits(s[..., 8:], (0, 2, 4, 6), 2).reshape(n, -1, 16)  # scale 4 s + i: byte 8 + i's bits 2s
        sc = (low | (high << 4)).astype(np.int8) - np.int8(32)
        ql = _bits(b[..., 32:96].reshape(n, -1, 2, 32), (0, 2, 4, 6), 2).reshape(n, -1, 256)
        hm = _bits(b[..., :32], range(8), 1).reshape(n, -1, 256)  # bit k of byte i: input 32 k + i
        q = ql.astype(np.int8) - ((hm ^ 1) << 2).astype(np.int8)
        return _f16(b, 108), None, sc.reshape(n, -1, 2), None, q
    if type_name == "Q2_K":
        sc = b[..., :16]
        q = _bits(b[..., 16:80].reshape(n, -1, 2, 32), (0, 2, 4, 6), 2).astype(np.int8)
        d, m = (sc & 15).astype(np.int8).reshape(n, -1, 2), (sc >> 4).astype(np.int8).reshape(n, -1, 2)
        return _f16(b, 80), -_f16(b, 82), d, m, q
    raise ValueError(f"no blocks for GGUF type {type_name}")


# a kind's pairs of code bytes a block of 32, and their dtype (the kernels take q8's as int8)
PAIRS = {kind: pairs for kind, (pairs, _, _) in vector_matmul.KINDS.items()}
INT8_KINDS = ("q8", "q8h", "q8hm")


def _plane(fields: np.ndarray, bits: int) -> np.ndarray:
    """[.., 32] fields of `bits` bits (input order) -> [.., 4 bits] bytes, byte j holding input j + 4 bits i
    at bit bits i (for 4 bits, q4's nibble bytes: input j low, j + 16 high)."""
    f = fields.reshape(*fields.shape[:-1], 8 // bits, 4 * bits)  # [.., i, j]: input j + 4 bits i
    shifts = (bits * np.arange(8 // bits, dtype=np.uint8))[:, None]
    return np.bitwise_or.reduce(f << shifts, axis=-2).astype(np.uint8)


def _unplane(plane: torch.Tensor, bits: int) -> torch.Tensor:
    """_plane's inverse: [.., 4 bits] uint8 -> [.., 32] int16 fields in input order."""
    shifts = bits * torch.arange(8 // bits, dtype=torch.int16)
    fields = (plane.short()[..., None, :] >> shifts[:, None]) & ((1 << bits) - 1)  # [.., i, j]
    return fields.reshape(*plane.shape[:-1], 32)


def _pack(kind: str, q: np.ndarray) -> np.ndarray:
    """[N, G, 32] int8 codes (input order) -> [N, G, 4 (L + b)] uint8, a packed kind's bytes a row and
    block (vector_matmul's layout): v = u ^ offset for u = q + offset (the offset is u's top bit: the
    kernels read v << s as the int8 (u - offset) 2^s), its low L bits in a plane (q4's nibbles for L = 4),
    then its high b bits in another."""
    high, offset = PACKED[kind]
    low = LOW_BITS.get(kind, 4)
    v = ((q.astype(np.int16) + offset) ^ offset).astype(np.uint8)
    planes = [_plane(v & ((1 << low) - 1), low)] + ([_plane(v >> low, high)] if high else [])
    return np.concatenate(planes, -1)


def _unpack(kind: str, qs: torch.Tensor) -> torch.Tensor:
    """_pack's inverse: [N, G, 4 (L + b)] uint8 -> [N, G, 32] int16 codes in input order."""
    high, offset = PACKED[kind]
    low = LOW_BITS.get(kind, 4)
    v = _unplane(qs[..., :4 * low], low)
    if high:
        v = v | (_unplane(qs[..., 4 * low:], high) << low)
    return (v ^ offset) - offset


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


@dataclass
class WeightBlocks:
    """One weight [N, K] in blocks of 32 inputs (weight_blocks.BLOCK_TYPES lists the kinds): codes
    qs [N, K/32, 16] uint8 (q4: byte j holds inputs j and j + 16), [N, K/32, 20 or 24] uint8 (q5,
    q5m, q6h: q4's nibbles, then the high bits' plane: _pack) or [N, K/32, 32] int8 (q8, q8h,
    q8hm), and the scales as the file holds them (vector_matmul's layouts):
    - the types of 32-input blocks: d, m [N, K/32] fp16 (m None where the type has none: Q4_0's
      m = -8 d is not held); ds, ms None;
    - the types of 256-input super-blocks: d, m [N, K/256] fp16 (m, the file's -dmin, None where
      the type has none), and ds, ms [N, K/32] int8 sub-block scales, or [N, K/32, 2] (q8h, q8hm,
      q6h: one per 16 inputs); a block's scale is d ds, its minimum m ms."""

    kind: str  # "q4", "q4i", "q3h", "q2hm", "q8", "q8h", "q8hm", "q5", "q5m" or "q6h"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    ds: torch.Tensor | None = None
    ms: torch.Tensor | None = None

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray, arena: WeightArena | None = None) -> WeightBlocks:
        """raw: the tensor's bytes, [N, K/block inputs * block bytes] (gguf.GGUFReader's tensor.data).
        The blocks are converted when first used (FileBlocks): by a BlockLinear straight into its tiles,
        carved from arena where one is given (the file's: model_files sizes it by tile_bytes_bound)."""
        _, size, _ = BLOCK_TYPES[type_name]
        return FileBlocks.of(type_name, np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size), arena)

    @classmethod
    def _parsed(cls, type_name: str, b: np.ndarray) -> WeightBlocks:
        """Any type's blocks, b [N, S, block bytes], parsed by numpy: the readable reference that the compiled
        conversions (FileBlocks: AS_FILED and COMPILED_TYPES cover every type) are held to, bit for bit, by
        tests/cpu/test_weight_blocks.py. A load never takes it."""
        kind = BLOCK_TYPES[type_name][0]
        d, m, ds, ms, q = _parse(type_name, b)
        q = q.reshape(b.shape[0], -1, GROUP)
        if kind in vector_matmul.NIBBLE_KINDS:  # byte j: input j in the low nibble, j + 16 in the high
            q = q.astype(np.uint8) & 15
            q = q[..., :16] | (q[..., 16:] << 4)
        elif kind in PACKED:
            q = _pack(kind, q)
        return cls(kind, _tensor(q), _tensor(d), _tensor(m), _tensor(ds), _tensor(ms))

    @classmethod
    def q8_from_float(cls, w: torch.Tensor) -> WeightBlocks:
        """Q8_0 blocks of a float weight [N, K] (K a multiple of 32), as llama.cpp's
        quantize_row_q8_0 makes them: per block the scale amax / 127, held in fp16 as the file's
        is, and each input rounded to the nearest code of that fp16 scale (llama.cpp rounds by the
        float32 one: codes off by one at most, within half a step of the held scale here)."""
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        d = (g.abs().amax(-1) / 127).clamp(max=torch.finfo(torch.float16).max).half()
        step = d.float()
        qs = torch.round(g / torch.where(step > 0, step, 1)[..., None]).clamp(-127, 127).to(torch.int8)
        return cls("q8", qs, d, None)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * GROUP

    @property
    def layout(self) -> int:
        """How the scales are held: vector_matmul's F16, F16_MIN, SUB, SUB_MIN or (q2hm's 4-bit ones) SUB_MIN4."""
        if self.ds is None:
            return vector_matmul.F16 if self.m is None else vector_matmul.F16_MIN
        if self.m is None:
            return vector_matmul.SUB
        # a minimum per sub-block: the kind's one such layout (LAYOUTS: q2hm's 4-bit ones SUB_MIN4, else SUB_MIN)
        with_mins = (vector_matmul.SUB_MIN, vector_matmul.SUB_MIN4)
        return next(lay for lay in vector_matmul.LAYOUTS[self.kind] if lay in with_mins)

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d, m) float32 per block [N, K/32], or per 16 inputs [N, K/32, 2] (q8h, q8hm, q6h): what the
        kernels expand the held scales to (m None where the kind has no minimum term)."""
        if self.ds is None:
            d = self.d.float()
            m = self.m.float() if self.m is not None else -8 * d if self.kind == "q4" else None
            return d, m

        def per_block(t: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:  # fp16 x int8: exact in float32
            t = t.float().repeat_interleave(SUPER, 1)
            return (t[..., None] if sub.dim() == 3 else t) * sub.float()

        return per_block(self.d, self.ds), None if self.m is None else per_block(self.m, self.ms)

    def map_rows(self, fn) -> WeightBlocks:
        """The same weight with its rows rearranged by fn (a function of a tensor's first dim)."""
        return WeightBlocks(self.kind, *(None if t is None else fn(t) for t in (self.qs, self.d, self.m, self.ds,
                                                                                   self.ms)))

    @staticmethod
    def cat(parts: list[WeightBlocks]) -> WeightBlocks:
        """The parts' rows one after the other: parts of one kind whose scales are held alike."""
        forms = {(p.kind, p.layout) for p in parts}
        if len(forms) != 1:
            raise ValueError(f"cannot fuse blocks of kinds and scale layouts {sorted(forms)}")
        if all(isinstance(p, FileBlocks) for p in parts):  # still the file's: converted once, fused
            return FileBlocks(parts[0].kind, parts[0].layout, parts[0].shape[1],
                              [seg for p in parts for seg in p._segments], [f for p in parts for f in p._release],
                              parts[0].arena)
        fields = zip(*((p.qs, p.d, p.m, p.ds, p.ms) for p in parts), strict=True)
        return WeightBlocks(parts[0].kind, *(None if ts[0] is None else torch.cat(ts) for ts in fields))

    def codes(self) -> torch.Tensor:
        """[N, K/32, 32] the integer codes in input order (the kernels' integers: q4's nibbles, the
        packed kinds' codes less their offset, the int8 ones)."""
        if self.kind in vector_matmul.NIBBLE_KINDS:
            nibbles = torch.cat((self.qs & 15, self.qs >> 4), -1)
            return torch.from_numpy(IQ4_VALUES)[nibbles.long()] if self.kind == "q4i" else nibbles
        return _unpack(self.kind, self.qs) if self.kind in PACKED else self.qs

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: what gguf.quants.dequantize gives for the same bytes."""
        d, m = self.block_scales()
        q = self.codes().float()
        if d.dim() == 3:  # a scale (and minimum) per 16 inputs
            q = q.reshape(*q.shape[:2], 2, 16)
        w = q * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(self.shape)


class FileBlocks(WeightBlocks):
    """A GGUF tensor's blocks, not yet converted: what WeightBlocks.from_gguf gives. A BlockLinear
    made of them writes its tiles from the file's bytes in one pass (COMPILED_TYPES through their loops,
    block_conversion.k_codes .. q5_codes; AS_FILED's codes as they are through gather_codes), so the codes are written
    once: no [N, G, B] copy first, none for a fused weight's cat or a
    part's rows rearranged (map_rows and cat note them: llama's q and k rows, which model_files
    un-permutes and the model interleaves again, are not moved at all). Every WeightBlocks field and
    method works as on the converted blocks, which the first use of one makes (and keeps)."""

    def __init__(self, kind: str, layout: int, k: int, segments: list, release: list,
                 arena: WeightArena | None = None):
        # no dataclass __init__: the fields are the converted blocks' (the properties below)
        self.kind, self._layout, self._k, self._segments, self._release = kind, layout, k, segments, release
        self.arena = arena  # where tiles() puts the tiles (None: the heap)
        self._converted: WeightBlocks | None = None

    @classmethod
    def of(cls, type_name: str, b: np.ndarray, arena: WeightArena | None = None) -> FileBlocks:
        """b [N, S, block bytes]: the tensor's blocks (a view of the file, read when converted)."""
        kind, _, per = BLOCK_TYPES[type_name]
        return cls(kind, _layout_of(type_name), b.shape[1] * per, [(type_name, b, np.arange(b.shape[0]))], [], arena)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(len(rows) for _, _, rows in self._segments), self._k

    @property
    def layout(self) -> int:
        return self._layout

    def after(self, release) -> FileBlocks:
        """Call release() once the codes are converted (model_files drops the file's pages then)."""
        self._release.append(release)
        return self

    def map_rows(self, fn) -> WeightBlocks:
        n = self.shape[0]
        order = fn(torch.arange(n))  # the rearrangement itself
        if len(self._segments) > 1 or not isinstance(order, torch.Tensor) or tuple(order.shape) != (n,):
            return self._blocks().map_rows(fn)
        type_name, b, rows = self._segments[0]
        return FileBlocks(self.kind, self._layout, self._k, [(type_name, b, rows[order.numpy()])], self._release,
                          self.arena)

    def _convert(self, lanes: int, empty=np.empty) -> tuple[np.ndarray, WeightBlocks]:
        """(codes [ceil(N / lanes), pairs a row, lanes] uint16 as block_conversion.k_codes writes them, in an array from
        empty; the scales as a WeightBlocks without codes)."""
        (n, k), pairs = self.shape, PAIRS[self.kind]
        out = empty((-(-n // lanes), k // GROUP * pairs, lanes), np.uint16)
        if n % lanes:
            out[-1, :, n % lanes:] = 0  # a partial tile's rows past N
        if self._segments[0][0] in COMPILED_TYPES:  # the loops write the scales too, every row in place
            scales = block_conversion.scale_arrays(self._segments[0][0], n, k // GROUP)
            held = tuple(a for a in scales if a is not None)
            first = 0
            for name, b, rows in self._segments:
                if name == "Q6_K":
                    block_conversion.q6k_codes(b, rows, first, out, *held)
                elif name == "IQ4_XS":
                    block_conversion.iq4xs_codes(b, rows, first, out, *held)
                elif name in ("Q3_K", "Q2_K"):  # Q3_K holds no m: its arrays' places get unused stand-ins
                    d, *rest = held
                    extra = (d, rest[0], rest[0]) if name == "Q3_K" else tuple(rest)
                    block_conversion.low_bit_codes(b, name == "Q3_K", rows, first, out, d, *extra)
                elif name in ("Q5_0", "Q5_1"):  # (Q5_0 holds no m: d stands in)
                    block_conversion.q5_codes(b, name == "Q5_1", rows, first, out, held[0], held[-1])
                else:
                    block_conversion.k_codes(b, name == "Q5_K", rows, first, out, *held)
                first += len(rows)
            d, m, ds, ms = scales
            scales = (_tensor(d.view(np.float16)), None if m is None else _tensor(m.view(np.float16)),
                      _tensor(ds), _tensor(ms))
        else:
            parts, first = [], 0
            for name, b, rows in self._segments:  # AS_FILED: the codes where the file has them, fp16s picked out
                at, d_at, m_at = AS_FILED[name]
                src = b.view(np.uint16)[..., at // 2:at // 2 + pairs]
                held = [_f16(b, d_at), None if m_at is None else _f16(b, m_at), None, None]
                block_conversion.gather_codes(src, rows, first, out)
                parts.append([None if t is None else t[rows] for t in held])
                first += len(rows)
            scales = [None if ts[0] is None else torch.from_numpy(np.concatenate(ts))
                      for ts in zip(*parts, strict=True)]
        for release in self._release:
            release()
        return out, WeightBlocks(self.kind, None, *scales)

    def tiles(self) -> tuple[np.ndarray, np.ndarray]:
        """(qs, scales) as BlockLinear holds them, from the file's bytes; where the arena replays a saved one
        (weight_arena.py), its arrays as they are, nothing read or written."""
        if self.arena is not None and self.arena.replaying:
            (n, k), type_name = self.shape, self._segments[0][0]
            out = self.arena.empty((-(-n // TILE), k // GROUP * PAIRS[self.kind], TILE), np.uint16)
            scales = self.arena.empty(_tile_scales_shape(type_name, n, k), np.uint8)
            for release in self._release:
                release()
        else:
            empty = np.empty if self.arena is None else self.arena.empty
            out, blocks = self._convert(TILE, empty)
            scales = _tile_scales(blocks, -self.shape[0] % TILE, empty)
        qs = out.view(np.int8 if self.kind in INT8_KINDS else np.uint8)
        return qs.reshape(len(out), self._k // GROUP, -1, TILE, 2), scales

    def _blocks(self) -> WeightBlocks:
        if self._converted is None:
            out, b = self._convert(1)
            qs = out.view(np.int8 if self.kind in INT8_KINDS else np.uint8)
            b.qs = torch.from_numpy(qs.reshape(self.shape[0], self._k // GROUP, -1))
            self._converted = b
        return self._converted

    qs = property(lambda self: self._blocks().qs)
    d = property(lambda self: self._blocks().d)
    m = property(lambda self: self._blocks().m)
    ds = property(lambda self: self._blocks().ds)
    ms = property(lambda self: self._blocks().ms)


def compile_kernels() -> None:
    """Compile (or load from Numba's on-disk cache) every block kernel once, on tiny arrays, so
    that model loading pays for it and not the first request (tens of seconds on a fresh machine).
    A kernel's scale layouts are branches of one compiled function: one call compiles them all.

    The parallel kernels come first, q4's and q8's each for both code types (decode_step's step compiles its
    head's call to either kernel with the head's codes): a cached function that calls a parallel
    one segfaults when a process loads it from the cache before the callee (numba/numba#8578,
    reproduced here with q4_linear over q4_matmul), so every process loads the callees first: a
    BlockLinear calls this when it is made, before any of its kernels can run. Once a process is
    enough (later calls return at once)."""
    global _compiled
    if _compiled:
        return
    if features.INT8:  # the int8 kernels (CPU_ACTIVATIONS=int8) and their parallel callees, first too
        int8_matmul.compile_int8_kernels()
    vm, rounding = vector_matmul, int16_rounding
    x = np.zeros((1, SUPER * GROUP), np.float32)  # one super-block: every layout's shapes hold
    y, room = np.zeros((1, TILE), np.float32), rounding.scratch(1, x.shape[1])
    sums = np.zeros((1, 2 * SUPER), np.float32)

    def scales(layout: int, halves: int = 1) -> np.ndarray:
        return np.zeros((1, *vm.scale_shape.py_func(layout, halves, SUPER)), np.uint8)

    def codes(kind: str, dtype=np.int8) -> np.ndarray:
        return np.zeros((1, SUPER, PAIRS[kind], TILE, 2), dtype)

    per_block = np.zeros((1, SUPER), np.float32)
    rounding.round_rows_parallel(x, np.zeros(x.shape, np.int16), per_block, per_block)  # quantize's callee
    xq, dx, xs = rounding.quantize(x)
    for dtype in (np.uint8, np.int8):
        vm.q4_matmul(xq, dx, xs, codes("q4", dtype), scales(vm.F16_MIN), vm.F16_MIN, y)
        vm.q8_matmul(xq, dx, codes("q8", dtype), scales(vm.F16), vm.F16, y)
    # the kinds below: one code type (int8, or the packed kinds' uint8), vectors only
    vm.q4i_matmul(xq, dx, codes("q4i", np.uint8), scales(vm.SUB), vm.SUB, y)
    vm.q8h_matmul(xq, dx, codes("q8h"), scales(vm.SUB, 2), y)
    vm.q3h_matmul(xq, dx, codes("q3h", np.uint8), scales(vm.SUB, 2), y)
    vm.q2hm_matmul(xq, dx, sums, codes("q2hm", np.uint8), scales(vm.SUB_MIN4, 2), y)
    vm.q8hm_matmul(xq, dx, sums, codes("q8hm"), scales(vm.SUB_MIN, 2), y)
    vm.q5_matmul(xq, dx, codes("q5", np.uint8), scales(vm.F16), y)
    vm.q5m_matmul(xq, dx, xs, codes("q5m", np.uint8), scales(vm.F16_MIN), vm.F16_MIN, y)
    vm.q6h_matmul(xq, dx, codes("q6h", np.uint8), scales(vm.SUB, 2), y)
    rounding.half_sums(x, sums.reshape(-1))
    if features.AMX:  # the tiles' kernels too, callees first: split, tile_matmul, then its wrappers
        amx_matmul.split(xq)
        for dtype in (np.uint8, np.int8):
            amx_matmul.tile_matmul(True, vm.F16_MIN, xq, dx, xs, codes("q4", dtype), scales(vm.F16_MIN), y)
            amx_matmul.q4_matmul(xq, dx, xs, codes("q4", dtype), scales(vm.F16_MIN), vm.F16_MIN, y)
            amx_matmul.q8_matmul(xq, dx, codes("q8", dtype), scales(vm.F16), vm.F16, y)
    block_matmul.q4_linear(x, codes("q4", np.uint8), scales(vm.F16_MIN), vm.F16_MIN, y, room)
    block_matmul.q8_linear(x, codes("q8"), scales(vm.F16), vm.F16, y, room)
    block_matmul.q4i_linear(x, codes("q4i", np.uint8), scales(vm.SUB), vm.SUB, y, room)
    block_matmul.q8h_linear(x, codes("q8h"), scales(vm.SUB, 2), y, room)
    block_matmul.q3h_linear(x, codes("q3h", np.uint8), scales(vm.SUB, 2), y, room)
    block_matmul.q2hm_linear(x, codes("q2hm", np.uint8), scales(vm.SUB_MIN4, 2), y, room, sums.reshape(-1))
    block_matmul.q8hm_linear(x, codes("q8hm"), scales(vm.SUB_MIN, 2), y, room, sums.reshape(-1))
    block_matmul.q5_linear(x, codes("q5", np.uint8), scales(vm.F16), y, room)
    block_matmul.q5m_linear(x, codes("q5m", np.uint8), scales(vm.F16_MIN), vm.F16_MIN, y, room)
    block_matmul.q6h_linear(x, codes("q6h", np.uint8), scales(vm.SUB, 2), y, room)
    _compiled = True


_compiled = False  # compile_kernels has run in this process


def tile_bytes_bound(type_name: str, n: int, k: int) -> int:
    """At most the bytes a BlockLinear's tiles of an [n, k] tensor of type_name take in a WeightArena: the
    codes exactly, the scales at most a quarter of a byte an input (Q4_1's and Q5_1's, the most, hold 0.125),
    alignment included. A fused weight's tiles take no more than its parts' apart."""
    rows = -(-n // TILE) * TILE
    return rows * (k // GROUP * PAIRS[BLOCK_TYPES[type_name][0]] * 2 + k // 4) + 2 * ALIGN


def _layout_of(type_name: str) -> int:
    """The scale layout (vector_matmul's F16 .. SUB_MIN4) a GGUF type's blocks are held in."""
    if type_name in AS_FILED:
        return vector_matmul.F16 if AS_FILED[type_name][2] is None else vector_matmul.F16_MIN
    return getattr(vector_matmul, COMPILED_TYPES[type_name])


def _tile_scales_shape(type_name: str, n: int, k: int) -> tuple[int, int, int]:
    """The shape of _tile_scales' array for n rows of k inputs of type_name, from the shapes alone."""
    halves = vector_matmul.KINDS[BLOCK_TYPES[type_name][0]][1]
    return -(-n // TILE), *vector_matmul.scale_shape.py_func(_layout_of(type_name), halves, k // GROUP)


def _tile_scales(blocks: WeightBlocks, pad: int, empty=np.empty) -> np.ndarray:
    """The blocks' scales as the kernels read them (vector_matmul._scale_shape): uint8 [N/TILE,
    super-blocks, bytes], per tile and super-block (or block) its TILE rows' fp16 d, fp16 m, then
    the int8 sub-block scales [block, half, TILE] of d, then of m (SUB_MIN4: one byte, d's | m's << 4)."""

    def tiled(t: torch.Tensor) -> np.ndarray:  # [N, S, ...] -> [N/TILE, S, ..., TILE]
        a = t.numpy()  # numpy's copies: torch's run on its OpenMP pool, slow on a busy machine
        a = np.concatenate((a, np.zeros((pad, *a.shape[1:]), a.dtype))) if pad else a
        return np.ascontiguousarray(np.moveaxis(a.reshape(-1, TILE, *a.shape[1:]), 1, -1))

    supers = blocks.d.shape[1]
    parts = [tiled(t).view(np.uint8) for t in (blocks.d, blocks.m) if t is not None]  # [N/TILE, S, 2 TILE]
    subs = (blocks.ds, blocks.ms)
    if blocks.layout == vector_matmul.SUB_MIN4:  # 4-bit scales and minimums, a byte holding both
        if not (0 <= int(blocks.ds.min()) and int(blocks.ds.max()) < 16 and 0 <= int(blocks.ms.min())
                and int(blocks.ms.max()) < 16):
            raise ValueError("SUB_MIN4 holds scales and minimums of 4 bits")
        subs = (blocks.ds.to(torch.uint8) | blocks.ms.to(torch.uint8) << 4, None)
    for t in subs:
        if t is not None:  # [N, 8 S(, 2)] -> [N/TILE, 8 S(, 2), TILE] -> [N/TILE, S, 8 (2) TILE]
            t = tiled(t)
            parts.append(t.view(np.uint8).reshape(t.shape[0], supers, -1))
    out = empty((*parts[0].shape[:2], sum(p.shape[2] for p in parts)), np.uint8)
    return np.concatenate(parts, -1, out=out)


class BlockLinear:
    """y = x W^T (+ b) for W in blocks, fp32 activations: the codes (qs) and scales (the bytes of
    vector_matmul's `layout`) laid out for the kernels, and nothing else held."""

    dtype = "gguf"

    def __init__(self, blocks: WeightBlocks, b: torch.Tensor | None):
        self.kind, self.layout, self.b = blocks.kind, blocks.layout, b
        self.out_features, self.in_features = blocks.shape
        compile_kernels()  # the kernels loaded in a safe order before any runs (numba/numba#8578)
        self.arena = None  # the WeightArena holding qs and scales, if any (fused_decode._Weights reads it)
        if isinstance(blocks, FileBlocks):  # from the file's bytes straight to the tiles
            self.qs, self.scales = blocks.tiles()
            self.arena = blocks.arena
            return
        pad = -self.out_features % TILE  # the kernels work in whole tiles of output rows
        # codes [N, G, B] -> [N/TILE, G, B/2, TILE, 2]: pairs of neighbouring bytes, a tile's rows side by side
        qs = np.ascontiguousarray(blocks.qs.numpy())
        n, groups, width = qs.shape
        out = np.empty((-(-n // TILE), groups * width // 2, TILE), np.uint16)
        if pad:
            out[-1, :, TILE - pad:] = 0
        block_conversion.gather_codes(qs.view(np.uint16), np.arange(n), 0, out)
        self.qs = out.view(qs.dtype).reshape(len(out), groups, width // 2, TILE, 2)
        self.scales = _tile_scales(blocks, pad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous().numpy()
        y = np.empty((x.shape[0], self.qs.shape[0] * TILE), np.float32)
        room = int16_rounding.scratch(*x.shape)
        if self.kind == "q4":
            block_matmul.q4_linear(x, self.qs, self.scales, self.layout, y, room)
        elif self.kind == "q4i":
            block_matmul.q4i_linear(x, self.qs, self.scales, self.layout, y, room)
        elif self.kind == "q8":
            block_matmul.q8_linear(x, self.qs, self.scales, self.layout, y, room)
        elif self.kind == "q3h":
            block_matmul.q3h_linear(x, self.qs, self.scales, y, room)
        elif self.kind == "q8h":
            block_matmul.q8h_linear(x, self.qs, self.scales, y, room)
        elif self.kind == "q5":
            block_matmul.q5_linear(x, self.qs, self.scales, y, room)
        elif self.kind == "q5m":
            block_matmul.q5m_linear(x, self.qs, self.scales, self.layout, y, room)
        elif self.kind == "q6h":
            block_matmul.q6h_linear(x, self.qs, self.scales, y, room)
        else:
            sums = np.empty(x.shape[0] * (x.shape[1] // 16), np.float32)
            linear = block_matmul.q2hm_linear if self.kind == "q2hm" else block_matmul.q8hm_linear
            linear(x, self.qs, self.scales, y, room, sums)
        out = torch.from_numpy(y)
        if y.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out if self.b is None else out + self.b
