"""A model's bf16 / fp16 matrices (an HF folder's safetensors, a GGUF's F16 / BF16 tensors) as Q8_0 blocks,
made at load one tensor at a time, for the CPU's block kernels (WEIGHT_DTYPE=auto's choice on the CPU).

Why Q8_0 at every row count and not bf16 (issue #41: "run in bf16 where that is faster"): measured by
bench/float_routes.py on a 2-core Zen 4 with avx512_bf16 and VNNI (torch 2.13's oneDNN bf16 against the
q8 kernels), one layer's four matmuls, best of the passes on one thread (the machine was shared, load
~12: two-thread timings were scheduling noise), ms per layer:

    shape             rows   fp32    bf16 (mm / linear)   q8 blocks
    135M (576/1536)   1      3.90    1.60 / 1.57          0.25
    135M              512    117     51.4 / 62.3          53.9
    1.7B (2048/8192)  1      42.4    37.5 / 39.8          9.66
    1.7B              512    2521    972 / 981            1160

A decode step reads every weight once: Q8_0 holds 8.5 bits a weight where bf16 holds 16, and torch's
one-row bf16 matmul does not reach the memory's speed, so q8 decodes 3.9-6.2x faster. A 512-row prompt
is compute-bound, where bf16 (vdpbf16ps) is 5-16% faster than the int16 x int8 kernels (vpdpwssd):
too little to hold a bf16 copy beside the blocks (1.9x their bytes), to give a prompt's rows other
numerics than a decode step's (a row's output would depend on how the prompt was cut), and to lose
fidelity: on a tiny random llama (tests/engine/test_float_weights.py's), 4 prompts x 32 greedy tokens
agree with transformers' fp32 on the bf16 folder at 99 / 128 (mean prefix 24.8) on Q8_0 blocks, 66 / 128
(16.5) with bf16 weights and bf16 activations (WEIGHT_DTYPE=bf16, llama.cpp's way with a BF16 file);
fp16 folder 119 / 128 (29.8) against 80 / 128 (20.0). The activations stay fp32 rounded to int16 per 32
(2^-16) where a bf16 matmul rounds them to 8 bits; the weights round to 8-bit codes per 32 (llama.cpp's
Q8_0): logits within 1.9e-2 (relative) of the folder's fp32 model's, and within 1e-4 of the largest of
transformers' on the values held (the int16 rounding; test_float_weights.py).

No float32 copy of the model is made: a tensor is read a few rows at a time (`CHUNK` weights), each
chunk's codes and scales written into the tensor's blocks, so a load's peak is the blocks and one tensor's
being laid out for the kernels: a 768 MiB bf16 folder peaks 509 MiB, keeps 424 (fp32: 2603 and 1835).
An HF folder's rows are read with pread, not a mapping, so that the file's pages land in the page cache
and not in the process's RSS (a mapping's pages touched stay counted until it is unmapped: a whole
file's worth by the end of a load). The token embedding stays in the file's rows, read a row at a time
at lookup (embedding.py), as a GGUF's quantized one does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from kvgen.cpu.weight_blocks import GROUP, WeightBlocks

# A file's float type -> the GGUF block type its matrices run as on the CPU (weight_blocks.BLOCK_TYPES).
# F32 is not here: a file in fp32 asked for exactness, and runs fp32 (the oracle's).
CONVERTED = {"F16": "Q8_0", "BF16": "Q8_0"}
CHUNK = 1 << 20  # weights rounded at a time: a few MiB of float32 temporaries, whatever the tensor
_TORCH = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
_GGML = {"F16": gguf.GGMLQuantizationType.F16, "BF16": gguf.GGMLQuantizationType.BF16}


def converts(type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this file type and shape runs as blocks: a bf16 / fp16 matrix whose rows are
    whole blocks of 32 inputs."""
    return type_name in CONVERTED and len(shape) == 2 and shape[1] % GROUP == 0


def q8_blocks(rows: Callable[[int, int], torch.Tensor], n: int, k: int) -> WeightBlocks:
    """Q8_0 blocks of an [n, k] matrix read by rows(start, stop) (any float dtype), a chunk of rows at a
    time: WeightBlocks.q8_from_float's codes and scales, without the whole matrix in float32."""
    qs = torch.empty((n, k // GROUP, GROUP), dtype=torch.int8)
    d = torch.empty((n, k // GROUP), dtype=torch.float16)
    step = max(1, CHUNK // k)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = WeightBlocks.q8_from_float(rows(start, stop))
        qs[start:stop], d[start:stop] = part.qs, part.d
    return WeightBlocks("q8", qs, d, None)


def ggml_type(type_name: str) -> gguf.GGMLQuantizationType:
    """The GGUF type of a float type's bytes, for embedding.py's row lookup (gguf-py dequantizes it)."""
    return _GGML[type_name]


class SafetensorsFile:
    """One .safetensors file: its header (each tensor's dtype, shape and byte range), a tensor's rows read
    with pread, and a tensor's bytes mapped (the token embedding: only the rows looked up become resident)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self._data_start = 8 + size
        self._tensors = header

    def names(self) -> list[str]:
        return list(self._tensors)

    def dtype(self, name: str) -> str:
        return self._tensors[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name]["shape"])

    def _row_bytes(self, name: str) -> tuple[int, int]:
        """(the tensor's first byte in the file, bytes a row)."""
        start, stop = self._tensors[name]["data_offsets"]
        n = self.shape(name)[0]
        return self._data_start + start, (stop - start) // n

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, in its own dtype, read from the file (not mapped)."""
        at, row = self._row_bytes(name)
        buf = np.empty((stop - start) * row, np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < buf.nbytes:  # a regular file reads whole, but pread may stop short (2 GiB a call)
                got = os.preadv(fd, [buf[done:]], at + start * row + done)
                if got <= 0:
                    raise OSError(f"{self.path}: {name} ends early")
                done += got
        finally:
            os.close(fd)
        return torch.from_numpy(buf).view(_TORCH[self.dtype(name)]).reshape(stop - start, -1)

    def mapped(self, name: str) -> np.memmap:
        """A 2-D tensor's bytes [rows, bytes a row], memory-mapped read-only."""
        at, row = self._row_bytes(name)
        return np.memmap(self.path, np.uint8, "r", offset=at, shape=(self.shape(name)[0], row))
