"""GPU kernels for the paged KV cache: decode-step append, flash-decode attention, bulk
fp8 / q4 packing and CUDA-graph replay (see README.md in this folder).

Importing this package never needs CuPy, Numba or a GPU; `available()` says whether the
kernels can run here, and `supports()` whether they serve a KV format. The entry points live
in kvgen.gpu.ops (CUDA tensors only) and kvgen.gpu.graphs.
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


def supports(format_name: str, head_dim: int, window: int = 0, chunk: int = 0) -> bool:
    """Whether the decode kernels (ops.kv_append / ops.flash_decode) can serve a KV format at
    this head_dim: they attend to every cached key, so sliding-window and chunked attention,
    which need masks, are not theirs; flash-decode reads K and V in runs of 8 dims (every
    Llama-family head_dim is a multiple of 8). Says nothing about this machine (see available())."""
    from kvgen.gpu import ops  # torch and numpy only: no CuPy needed to ask

    return (format_name in ops.FORMATS and head_dim <= ops.MAX_HEAD_DIM and head_dim % 8 == 0
            and not (window or chunk))


__all__ = ["available", "supports"]
