"""GPU kernels for the paged KV cache: decode-step append, flash-decode attention, bulk
fp8 / q4 packing and CUDA-graph replay (see README.md in this folder).

Importing this package never needs CuPy, Numba or a GPU; `available()` says whether the
kernels can run here. The entry points live in kvgen.gpu.ops (CUDA tensors only) and
kvgen.gpu.graphs.
"""

from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    """True when torch sees a CUDA device and CuPy and Numba's CUDA target can use it."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # ImportError, or a CUDA runtime / driver that does not load
        return False


__all__ = ["available"]
