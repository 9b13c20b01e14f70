"""Fixtures that run kvgen.gpu.ops' CUDA C kernels on the host, on CPU tensors.

The real kernels/*.cu are compiled by g++ together with host/cuda_emu.h, a shim for the CUDA
built-ins (a block's threads are fibers, __syncthreads and warp shuffles are barriers), and
launched through ops.py's own Python code: this checks the kernels' indexing, online softmax,
split merging, fp8 requantisation and padding handling end to end without a GPU. Host float math
is IEEE like the device's (no fma contraction here; the append kernels have no multiply-add to
contract on the device either), so append must be byte-identical to KVFormat.write.

Test modules elsewhere use these as `emu_lib, emulated = emulator.emu_lib, emulator.emulated`.
"""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch

from tests.gpu.helpers import HOST_DIR, KDIR, run


@pytest.fixture(scope="session")
def emu_lib(tmp_path_factory):
    """The emulated kernels' shared library, built once per run (g++ takes a few seconds)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    tmp = tmp_path_factory.mktemp("emu")
    r = run([gxx, "-std=c++20", "-O2", "-ffp-contract=off", "-shared", "-fPIC", f"-I{KDIR}",
             str(HOST_DIR / "emu_launchers.cpp"), "-o", str(tmp / "libkvg_emu.so")])
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(tmp / "libkvg_emu.so"))


@pytest.fixture
def emulated(emu_lib, monkeypatch):
    """kvgen.gpu.ops running its CUDA C kernels on the host, on CPU tensors."""
    from kvgen.gpu import ops

    def launch(module, fn, dev, grid, block, args):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if fn == "kv_increment":
            family = emu_lib.emu_increment
        elif fn.startswith("kv_append_"):
            family = emu_lib.emu_append
        elif fn.startswith("flash_decode_split_"):
            family = emu_lib.emu_split
        else:
            family = emu_lib.emu_reduce
        cargs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                cargs.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, np.int32):
                cargs.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.float32):
                cargs.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"{fn}: argument of type {type(a)}")
        kernel = ctypes.cast(getattr(emu_lib, fn), ctypes.c_void_p)
        family(kernel, *(ctypes.c_uint(g) for g in grid), ctypes.c_uint(block[0]), *cargs)

    monkeypatch.setattr(ops, "_launch", launch)
    monkeypatch.setattr(ops, "_ptr", ops.raw)
    monkeypatch.setattr(ops, "device_index", lambda t: 0)
    monkeypatch.setattr(ops, "_sm_count", lambda dev: 2)  # a small GPU: the heuristic splits
    return ops
