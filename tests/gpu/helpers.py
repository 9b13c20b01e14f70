"""Shared by the kvgen.gpu tests: where the kernels and the CUDA toolchain are, and the test data
(bit views, probe floats, paged stores) that more than one file compares with."""

from __future__ import annotations

import ctypes.util
import glob
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KDIR = ROOT / "kvgen" / "gpu" / "kernels"
HOST_DIR = pathlib.Path(__file__).resolve().parent / "host"
CU_FILES = sorted(KDIR.glob("*.cu"))

FORMATS = ("fp32", "fp16", "bf16", "fp8", "q4")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---- the toolchain ---------------------------------------------------------------------------


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")
                                         if os.path.exists(p)), None)


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def ptxas() -> str:
    return shutil.which("ptxas") or str(pathlib.Path(NVCC).resolve().parent / "ptxas")


def libnvrtc() -> str | None:
    """A libnvrtc to compile with, if this machine has one (CUDA toolkit or the
    nvidia-cuda-nvrtc wheel); KVGEN_NVRTC=path overrides."""
    if os.environ.get("KVGEN_NVRTC"):
        return os.environ["KVGEN_NVRTC"]
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + sys.path
    pats = ["lib64/libnvrtc.so*", "lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*",
            "nvidia/cuda_nvrtc/lib/libnvrtc.so*"]
    for root in roots:
        for pat in pats:
            hits = sorted(p for p in glob.glob(os.path.join(root, pat)) if "builtins" not in p)
            if root and hits:
                return hits[0]
    return ctypes.util.find_library("nvrtc")


def ptx_params(ptx: str) -> dict[str, list[str]]:
    """{entry name: PTX parameter types} of a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


def run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


# ---- bits and probe values -------------------------------------------------------------------


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a float tensor as numpy integers (to compare -0.0, NaNs and ties exactly)."""
    view = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
            torch.float32: torch.int32}[t.dtype]
    return t.view(view).numpy()


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor viewed as integers of its width; any other tensor as it is."""
    view = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
            torch.float32: torch.int32}.get(t.dtype)
    return t.view(view) if view is not None else t


def probe_floats(n=1_000_000, seed=0) -> torch.Tensor:
    """Random float32 bit patterns of every magnitude, every fp16 / bf16 / e4m3 value, the
    midpoints between neighbours (ties) and values just off them, -0.0 and the limits."""
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    rnd = rnd.view(torch.float32)
    parts = [rnd, torch.tensor([0.0, -0.0, 448.0, -448.0, 65504.0, 65519.99, 65520.0, 1e-45, -1e-45])]
    codes16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for grid in (codes16.view(torch.float16).float(), codes16.view(torch.bfloat16).float(),
                 torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()):
        grid = grid[torch.isfinite(grid)].sort().values
        mid = (grid[:-1] + grid[1:]) / 2  # exact in float32 for these formats
        parts += [grid, mid, torch.nextafter(mid, torch.full_like(mid, math.inf)),
                  torch.nextafter(mid, torch.full_like(mid, -math.inf))]
    x = torch.cat(parts)
    return x[torch.isfinite(x)]


# ---- paged KV stores on the CPU --------------------------------------------------------------


def empty_store(fmt_name, layers=2, block_size=16, kvh=2, hd=64, blocks=6):
    """(format, an empty store of it)."""
    from kvgen.engine.kv.formats import make_format

    fmt = make_format(fmt_name, layers, block_size, kvh, hd)
    return fmt, fmt.allocate(blocks)


def paged(name, lens, *, layers=2, block_size=8, kvh=2, hd=64, spare=3, extra=1, seed=0):
    """A store with sequences of the given lengths written through the format, blocks scattered;
    returns (fmt, store, tables [B, width] int32, spare block ids)."""
    from kvgen.engine.kv.formats import make_format

    g = torch.Generator().manual_seed(seed)
    fmt = make_format(name, layers, block_size, kvh, hd)
    need = [-(-max(n, 0) // block_size) for n in lens]
    total = sum(need) + spare
    kv = fmt.allocate(total)
    perm = torch.randperm(total, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + extra), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    for layer in range(layers):
        for b, n in enumerate(lens):
            if n > 0:
                pos = torch.arange(n)
                mag = torch.exp(torch.randn(n, 1, 1, generator=g))  # fp8 scales from different rows
                k = torch.randn(n, kvh, hd, generator=g) * mag
                v = torch.randn(n, kvh, hd, generator=g) * mag
                fmt.write(kv, layer, tables[b][pos // block_size].long(), pos % block_size, k, v)
    return fmt, kv, tables, perm[at:]


def assert_same_store(a, b):
    for key in a:
        x, y = raw_bits(a[key]), raw_bits(b[key])
        assert torch.equal(x, y), f"store[{key!r}] differs at {(x != y).nonzero()[:5].tolist()}"
