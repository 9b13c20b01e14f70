"""Bulk fp8 / q4 pack and unpack of torch tensors on the GPU: the warm tier's lossy codecs on a
CUDA pool (kvgen.engine.kv.tiers.WarmCodec) call these, which launch pack.py's Numba kernels on
torch's current stream. Each gives exactly what its torch reference in kvgen.engine.kv.quant
gives. Under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) they take CPU tensors, which is
how CI runs them without a GPU.
"""

from __future__ import annotations

import contextlib
import math

import torch

from kvgen.gpu.ops import device_index, raw

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # pack.F32 / F16 / BF16


def numba_simulated() -> bool:
    try:
        from numba.cuda import config
    except ImportError:  # numba's built-in CUDA target
        from numba import config
    return bool(config.ENABLE_CUDASIM)


def _numba_env(t: torch.Tensor):
    """(numba.cuda, the torch current stream as a Numba stream, device context). Under Numba's
    CUDA simulator (NUMBA_ENABLE_CUDASIM=1) CPU tensors are accepted, which is how CI runs
    these wrappers without a GPU."""
    from numba import cuda

    if t.device.type == "cpu" and numba_simulated():
        return cuda, 0, contextlib.nullcontext()
    dev = device_index(t)
    return cuda, cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream), cuda.gpus[dev]


def _nb(cuda, t: torch.Tensor):
    bits = raw(t)
    if bits.device.type == "cpu":  # simulator only (see _numba_env): numpy view, same memory
        return bits.numpy()
    return cuda.as_cuda_array(bits)  # zero-copy through __cuda_array_interface__


def _out(t: torch.Tensor | None, shape, dtype, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if t.dtype != dtype or t.device != like.device:
        raise ValueError(f"output must be {dtype} on {like.device}, got {t.dtype} on {t.device}")
    return t


def pack_fp8(x: torch.Tensor, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise whole blocks to fp8: x [*lead, T, kv_heads, head_dim] (fp32/fp16/bf16) ->
    q float8_e4m3fn (same shape) and scale float32 [*lead, kv_heads] = absmax over (T,
    head_dim) / 448, q = quant.fp8_quantize(x, scale). A store slice `store["kv"][blocks]`
    [n, L, 2, BS, KVH, HD] gives scales shaped like `store["scale"][blocks]`. Outputs may be
    given (any strides that view as [M, T, KVH, HD] / [M, KVH])."""
    if x.dim() < 3 or x.dtype not in _KIND:
        raise ValueError(f"x must be [..., T, kv_heads, head_dim] fp32/fp16/bf16, got "
                         f"{tuple(x.shape)} {x.dtype}")
    from kvgen.gpu import pack

    *lead, t, kvh, hd = x.shape
    m = math.prod(lead)
    q = _out(q_out, x.shape, torch.float8_e4m3fn, x)
    scale = _out(scale_out, (*lead, kvh), torch.float32, x)
    cuda, stream, ctx = _numba_env(x)
    with ctx:
        pack.fp8_pack(_nb(cuda, x.reshape(m, t, kvh, hd)), _KIND[x.dtype], _nb(cuda, q.view(m, t, kvh, hd)),
                      _nb(cuda, scale.view(m, kvh)), stream)
    return q, scale


def unpack_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 blocks back to values: q [*lead, T, kv_heads, head_dim] float8_e4m3fn (or its uint8
    bits), scale [*lead, kv_heads] -> float32(q) * scale, cast (nearest even) to `dtype`."""
    from kvgen.gpu import pack

    *lead, t, kvh, hd = q.shape
    m = math.prod(lead)
    out = _out(out, q.shape, dtype, q)
    cuda, stream, ctx = _numba_env(q)
    with ctx:
        pack.fp8_unpack(_nb(cuda, q.view(m, t, kvh, hd)), _nb(cuda, scale.reshape(m, kvh)), _KIND[dtype],
                        _nb(cuda, out.view(m, t, kvh, hd)), stream)
    return out


def pack_q4(x: torch.Tensor, group: int | None = None, packed_out: torch.Tensor | None = None,
            scales_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q4 of x [..., head_dim] (fp32/fp16/bf16), group size `group` (default min(32, head_dim))
    -> packed uint8 [..., head_dim // 2] and scales float16 [..., head_dim // group], exactly
    quant.q4_quantize."""
    if x.dtype not in _KIND:
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    from kvgen.gpu import pack

    hd = x.shape[-1]
    group = group or min(32, hd)
    if hd % 2 or hd % group:
        raise ValueError(f"q4 needs an even head_dim divisible by the group size, got {hd} / {group}")
    r = x.numel() // hd if hd else 0
    packed = _out(packed_out, (*x.shape[:-1], hd // 2), torch.uint8, x)
    scales = _out(scales_out, (*x.shape[:-1], hd // group), torch.float16, x)
    cuda, stream, ctx = _numba_env(x)
    with ctx:
        pack.q4_pack(_nb(cuda, x.reshape(r, hd)), _KIND[x.dtype], group, _nb(cuda, packed.view(r, hd // 2)),
                     _nb(cuda, scales.view(r, hd // group)), stream)
    return packed, scales


def unpack_q4(packed: torch.Tensor, scales: torch.Tensor, group: int | None = None,
              dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """q4 back to values [..., head_dim] (quant.q4_dequantize, cast nearest-even to dtype)."""
    from kvgen.gpu import pack

    hd = packed.shape[-1] * 2
    group = group or hd // scales.shape[-1]
    r = packed.numel() // (hd // 2) if hd else 0
    out = _out(out, (*packed.shape[:-1], hd), dtype, packed)
    cuda, stream, ctx = _numba_env(packed)
    with ctx:
        pack.q4_unpack(_nb(cuda, packed.view(r, hd // 2)), _nb(cuda, scales.view(r, hd // group)), group,
                       _KIND[dtype], _nb(cuda, out.view(r, hd)), stream)
    return out
