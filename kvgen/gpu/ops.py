"""GPU entry points the engine calls on CUDA tensors.

CUDA C kernels (kernels/*.cu, compiled by CuPy's RawModule with NVRTC, cached per process
and on disk by CuPy):
    kv_append(fmt, store, layer, k, v, block_tables, seq_lens)   decode-step append
    increment(seq_lens, valid=None, n=1)                         advance the length counters
    flash_decode(q, fmt, store, layer, block_tables, context_lens, num_splits=None, ...)
(The Numba bulk (de)quantisation kernels have their torch entry points in codecs.py.)

Everything is launched on torch's current stream (CuPy through an ExternalStream, Numba
through cuda.external_stream), so it orders with the surrounding torch work and is captured
by torch.cuda.graph. Tensors reach the CuPy kernels as their device addresses (np.uint64) and
Numba through __cuda_array_interface__, without copies (bf16 / fp16 / fp8 as int16 / uint8
views of the same memory; the kernels decode the bits). Scalars are passed as np.int32 /
np.float32 so the kernel parameter sizes match. No function here reads a device value on the
host: nothing syncs, which is what makes the decode step capturable.

A decode step (the engine's Model.forward with attention.KernelAttention), with seq_lens[b] =
tokens already cached for row b (-1 for padding rows):
    for layer in layers:
        kv_append(fmt, store, layer, k, v, block_tables, seq_lens)        # writes at seq_lens[b]
        out = flash_decode(q, fmt, store, layer, block_tables, seq_lens, len_offset=1)
    increment(seq_lens)                                                    # once, after the last layer
With an ExactTail format (fp8 / q4 with recent_slots, kvgen/engine/kv/stage.py) the step starts
with fmt.prepare_decode(...) on the host; the kernels then read its exact rows and slot maps.
"""

from __future__ import annotations

import functools
import math
import pathlib
import re

import numpy as np
import torch

KERNEL_DIR = pathlib.Path(__file__).parent / "kernels"
KERNEL_FILES = ("kv_append", "flash_decode")
FORMATS = ("fp32", "fp16", "bf16", "fp8", "q4")
MAX_HEAD_DIM = 256
APPEND_THREADS = 128  # kv_append.cu KVG_APPEND_THREADS
DECODE_THREADS = 128  # flash_decode.cu KVG_FD_THREADS
MAX_HEADS_PER_CTA = 4  # flash_decode.cu KVG_FD_MAX_G
# Resident flash-decode thread blocks per SM assumed by the split heuristic: flash_decode.cu's
# __launch_bounds__ (KVG_FD_MIN_BLOCKS) keeps 4 per SM at head_dim <= 128; on an H100, 8 split
# blocks per SM measured 5-20% slower and 5 resident ones the same as 4.
CTAS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = 128

_DTYPE_NAME = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_DTYPE_ID = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # common.cuh KVG_F32 / F16 / BF16


# ---- plumbing -------------------------------------------------------------------------------


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("kvgen.gpu needs CuPy (pip install cupy-cuda12x) and a CUDA device") from e
    return cupy


def paste_includes(text: str, folder: pathlib.Path) -> str:
    """text with each `#include "X.cuh"` replaced by folder/X.cuh (recursively), so NVRTC needs
    no include path and CuPy's cache key (the source text) changes whenever a header does."""
    def paste(m: re.Match) -> str:
        return paste_includes((folder / m.group(1)).read_text(), folder)

    return re.sub(r'^#include "([\w.]+\.cuh)"$', paste, text, flags=re.M)


def kernel_source(name: str) -> str:
    """Source of kernels/<name>.cu with its headers (common.cuh, ...) pasted in."""
    return paste_includes((KERNEL_DIR / f"{name}.cu").read_text(), KERNEL_DIR)


@functools.cache
def _module(name: str, device_index: int):
    cp = _cupy()
    with cp.cuda.Device(device_index):
        return cp.RawModule(code=kernel_source(name), options=("-std=c++17",))


@functools.cache
def _function(module: str, fn: str, device_index: int):
    cp = _cupy()
    with cp.cuda.Device(device_index):
        return _module(module, device_index).get_function(fn)


def device_index(t: torch.Tensor) -> int:
    if t.device.type != "cuda":
        raise ValueError(f"expected a CUDA tensor, got one on {t.device}")
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def raw(t: torch.Tensor) -> torch.Tensor:
    """Same memory, a dtype both CuPy and Numba understand (kernels take raw bits)."""
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.bool):
        return t.view(torch.uint8)
    return t


def _ptr(t: torch.Tensor) -> np.uint64:
    """A pointer parameter: the tensor's device address. CuPy passes a numpy scalar's bytes as
    they are, so a uint64 is a pointer argument; a CuPy array made per argument (through
    __cuda_array_interface__) cost ~15 us each, ~200 us of host time per flash_decode call."""
    device_index(t)  # raises for a tensor not on a CUDA device
    return np.uint64(raw(t).data_ptr())


def _launch(module: str, fn: str, device_index: int, grid, block, args) -> None:
    cp = _cupy()
    kernel = _function(module, fn, device_index)
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device_index).cuda_stream)
    with cp.cuda.Device(device_index), stream:
        kernel(grid, block, args)


def _format_name(fmt) -> str:
    name = getattr(fmt, "name", "")
    if name not in FORMATS:
        raise ValueError(f"no GPU kernels for KV format {name!r}; supported: {', '.join(FORMATS)}")
    return name


def _cache_tensors(name: str, store: dict[str, torch.Tensor], head_dim: int):
    """(codes / values tensor, scale tensor or None, q4 key scales or None, q4 value group size)
    of a store."""
    if name == "q4":
        cache, scale, key_scale = store["q"], store["vscale"], store["kscale"]
        if cache.shape[-1] * 2 != head_dim or head_dim % scale.shape[-1] or key_scale.shape[-1] != head_dim:
            raise ValueError(f"q4 store shapes {tuple(cache.shape)}, {tuple(scale.shape)}, "
                             f"{tuple(key_scale.shape)} do not fit head_dim {head_dim}")
        group = head_dim // scale.shape[-1]
    else:
        cache, scale, key_scale, group = store["kv"], store.get("scale") if name == "fp8" else None, None, 1
        if cache.shape[-1] != head_dim:
            raise ValueError(f"store head_dim {cache.shape[-1]} != {head_dim}")
    for t in (cache, scale, key_scale):
        if t is not None and not t.is_contiguous():
            raise ValueError("the KV store tensors must be contiguous")
    return cache, scale, key_scale, group


def _exact_tail(fmt, store: dict[str, torch.Tensor], cache: torch.Tensor, hd: int) -> tuple:
    """Kernel arguments (exact rows, recent slot map, sink, first-token slot map, dtype id) of
    a format that keeps each sequence's newest block and first token exact (ExactTail,
    kvgen/engine/kv/stage.py), or stand-ins and -1 (no exact tail) for any other format."""
    if not getattr(fmt, "recent_slots", 0):
        return _ptr(cache), _ptr(cache), _ptr(cache), _ptr(cache), np.int32(-1)
    rows, recent_of, sink, first_of = fmt.exact_tensors(store)
    nb, n_layers, _, bs, kvh = cache.shape[:5]
    ok = (rows.shape[1:] == (n_layers, 2, bs, kvh, hd) and sink.shape[1:] == (n_layers, 2, kvh, hd)
          and rows.dtype == sink.dtype and rows.dtype in _DTYPE_ID
          and all(t.shape == (nb,) and t.dtype == torch.int64 for t in (recent_of, first_of))
          and all(t.is_contiguous() for t in (rows, recent_of, sink, first_of)))
    if not ok:
        raise ValueError(f"exact tail {tuple(rows.shape)} {rows.dtype}, sink {tuple(sink.shape)}, slot maps "
                         f"{tuple(recent_of.shape)} {recent_of.dtype} do not fit the store {tuple(cache.shape)}")
    return _ptr(rows), _ptr(recent_of), _ptr(sink), _ptr(first_of), np.int32(_DTYPE_ID[rows.dtype])


def _check_int32(name: str, t: torch.Tensor, ndim: int, batch: int) -> None:
    if t.dtype != torch.int32 or t.dim() != ndim or t.shape[0] != batch or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 tensor with {ndim} dims and batch "
                         f"{batch}, got {t.dtype} {tuple(t.shape)}")


# ---- decode-step append ---------------------------------------------------------------------


def kv_append(fmt, store: dict[str, torch.Tensor], layer: int, k: torch.Tensor, v: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Write row b's new k[b], v[b] ([B, kv_heads, head_dim], fp32/fp16/bf16) for `layer` at
    position seq_lens[b] (the tokens already cached) of its sequence: block
    block_tables[b, pos // block_size], offset pos % block_size, both looked up on the GPU.
    Rows with seq_lens[b] < 0, a position past the table or a -1 table entry write nothing.
    fp8 and q4 quantise on the way in (fp8 grows the block's scale and requantises the block's
    other rows when needed), byte for byte as the torch formats do. With an exact tail
    (ExactTail: fmt.prepare_decode has run for the step) a row whose block holds a recent slot
    goes to the exact rows instead, and a row at position 0 to its block's sink slot too, as
    ExactTail.write does. seq_lens is not changed: call increment() once per step after the
    last layer."""
    name = _format_name(fmt)
    if k.shape != v.shape or k.dim() != 3 or k.dtype != v.dtype or k.dtype not in _DTYPE_NAME:
        raise ValueError(f"k, v must be [B, kv_heads, head_dim] fp32/fp16/bf16, got "
                         f"{tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    b, kvh, hd = k.shape
    _check_int32("block_tables", block_tables, 2, b)
    _check_int32("seq_lens", seq_lens, 1, b)
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {hd} > {MAX_HEAD_DIM}")
    cache, scale, key_scale, group = _cache_tensors(name, store, hd)
    _, n_layers, _, block_size, cache_kvh, _ = cache.shape
    if cache_kvh != kvh or not 0 <= layer < n_layers:
        raise ValueError(f"kv_heads {kvh} / layer {layer} do not fit the store {tuple(cache.shape)}")
    if b == 0:
        return
    dev = device_index(k)
    k, v = k.contiguous(), v.contiguous()
    *exact, exact_dt = _exact_tail(fmt, store, cache, hd)
    args = (_ptr(k), _ptr(v), _ptr(cache), _ptr(scale if scale is not None else cache),
            _ptr(key_scale if key_scale is not None else cache), _ptr(block_tables),
            _ptr(seq_lens), *exact, np.int32(block_tables.shape[1]), np.int32(n_layers), np.int32(layer),
            np.int32(block_size), np.int32(kvh), np.int32(hd), np.int32(group), exact_dt)
    fn = f"kv_append_{name}_{_DTYPE_NAME[k.dtype]}"
    _launch("kv_append", fn, dev, (b, kvh, 2), (APPEND_THREADS,), args)


def increment(seq_lens: torch.Tensor, valid: torch.Tensor | None = None, n: int = 1) -> None:
    """seq_lens[b] += n on the GPU for rows with seq_lens[b] >= 0 (and valid[b], a bool or
    uint8 [B] mask, when given). Padding rows (-1) stay -1."""
    _check_int32("seq_lens", seq_lens, 1, seq_lens.shape[0] if seq_lens.dim() else -1)
    batch = seq_lens.shape[0]
    if valid is not None and (valid.shape != (batch,) or valid.dtype not in (torch.bool, torch.uint8)):
        raise ValueError("valid must be a bool / uint8 [B] tensor")
    if batch == 0:
        return
    dev = device_index(seq_lens)
    has_valid = valid is not None
    mask = valid.contiguous() if has_valid else seq_lens
    args = (_ptr(seq_lens), _ptr(mask), np.int32(has_valid), np.int32(batch), np.int32(n))
    _launch("kv_append", "kv_increment", dev, (-(-batch // 128),), (128,), args)


# ---- flash-decode ---------------------------------------------------------------------------


def num_splits_heuristic(num_ctas: int, num_slots: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's split-KV heuristic: the smallest split count whose wave efficiency
    (CTAs / slots rounded up to whole waves) is within 85% of the best one.

    num_ctas: thread blocks per split; num_slots: thread blocks the GPU runs at once;
    num_n_blocks: chunks of the longest sequence a split can be made of."""
    if num_ctas >= 0.8 * num_slots:
        return 1
    max_splits = max(1, min(max_splits, num_slots, num_n_blocks))

    def ceil_div(a, b):
        return -(-a // b)

    def eligible(s):  # a split count that changes the chunks per split (no empty splits)
        return s == 1 or ceil_div(num_n_blocks, s) != ceil_div(num_n_blocks, s - 1)

    eff = []
    for s in range(1, max_splits + 1):
        waves = num_ctas * s / num_slots
        eff.append(waves / math.ceil(waves) if eligible(s) else 0.0)
    best = max(eff)
    for s in range(1, max_splits + 1):
        if eligible(s) and eff[s - 1] >= 0.85 * best:
            return s
    return 1


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, num_heads: int, max_context_len: int,
                      block_size: int, num_sms: int) -> int:
    """Split count for flash_decode from host-known sizes only (no sync, so it is fixed for a
    CUDA graph): the longest possible context is cut into chunks of whole cache blocks of at
    least MIN_TOKENS_PER_SPLIT tokens, and the FA2 heuristic picks how many chunks to spread
    over thread blocks so batch x kv heads x splits fills the GPU."""
    chunks = -(-(num_heads // num_kv_heads) // MAX_HEADS_PER_CTA)
    chunk_tokens = block_size * max(1, -(-MIN_TOKENS_PER_SPLIT // block_size))
    n_blocks = max(1, -(-max_context_len // chunk_tokens))
    return num_splits_heuristic(batch * num_kv_heads * chunks, num_sms * CTAS_PER_SM, n_blocks)


def flash_decode(q: torch.Tensor, fmt, store: dict[str, torch.Tensor], layer: int,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, num_splits: int | None = None,
                 *, len_offset: int = 0, max_context_len: int | None = None,
                 sm_scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [B, H, head_dim] (fp32/fp16/bf16) over the paged cache of `layer`.

    Row b attends to its first context_lens[b] + len_offset tokens (including the new one;
    <= 0 gives a zero output) through block_tables[b]; query head h uses kv head
    h // (H // kv_heads); with an exact tail (ExactTail) K/V are read where it holds them, as
    ExactTail.read does. Returns out [B, H, head_dim] in q's dtype (written into `out` when
    given). num_splits (KV splits per sequence, flash-decoding) defaults to
    choose_num_splits(...) with max_context_len (default: the block table's capacity) -- all
    host-side, so a captured graph keeps a fixed launch shape and any lengths stay correct."""
    name = _format_name(fmt)
    if q.dim() != 3 or q.dtype not in _DTYPE_NAME:
        raise ValueError(f"q must be [B, H, head_dim] fp32/fp16/bf16, got {tuple(q.shape)} {q.dtype}")
    b, h, hd = q.shape
    _check_int32("block_tables", block_tables, 2, b)
    _check_int32("context_lens", context_lens, 1, b)
    if hd > MAX_HEAD_DIM or hd % 8:
        raise ValueError(f"head_dim {hd}: flash_decode takes multiples of 8 up to {MAX_HEAD_DIM}")
    cache, scale, key_scale, group = _cache_tensors(name, store, hd)
    n_blocks, n_layers, _, block_size, kvh, _ = cache.shape
    if h % kvh or not 0 <= layer < n_layers:
        raise ValueError(f"{h} query heads / layer {layer} do not fit the store {tuple(cache.shape)}")
    if n_blocks * n_layers * 2 * block_size * kvh >= 2**31:  # the kernel's int32 row indices
        raise ValueError(f"a store of {tuple(cache.shape)} has 2^31 rows or more")
    if out is None:
        out = torch.empty((b, h, hd), dtype=q.dtype, device=q.device)
    elif out.shape != (b, h, hd) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor shaped and typed like q")
    if b == 0:
        return out
    dev = device_index(q)
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        max_len = max_context_len if max_context_len is not None else max_blocks * block_size
        num_splits = choose_num_splits(b, kvh, h, max_len, block_size, _sm_count(dev))
    num_splits = max(1, int(num_splits))
    chunks = -(-(h // kvh) // MAX_HEADS_PER_CTA)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(hd)

    q = q.contiguous()
    part_acc = torch.empty((b, h, num_splits, hd), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, h, num_splits, 2), dtype=torch.float32, device=q.device)
    hd_name = "hd128" if hd <= 128 else "hd256"
    *exact, exact_dt = _exact_tail(fmt, store, cache, hd)
    split_args = (
        _ptr(q), _ptr(cache), _ptr(scale if scale is not None else cache),
        _ptr(key_scale if key_scale is not None else cache), _ptr(block_tables),
        _ptr(context_lens), *exact, _ptr(part_acc), _ptr(part_ml), np.int32(max_blocks), np.int32(len_offset),
        np.int32(h), np.int32(kvh), np.int32(hd), np.int32(n_layers), np.int32(layer),
        np.int32(block_size), np.int32(group), np.int32(num_splits), exact_dt,
        np.float32(sm_scale * math.log2(math.e)))
    _launch("flash_decode", f"flash_decode_split_{name}_{_DTYPE_NAME[q.dtype]}_{hd_name}", dev,
            (num_splits, kvh * chunks, b), (DECODE_THREADS,), split_args)
    reduce_args = (_ptr(part_acc), _ptr(part_ml), _ptr(out), np.int32(h), np.int32(hd), np.int32(num_splits))
    _launch("flash_decode", f"flash_decode_reduce_{_DTYPE_NAME[q.dtype]}", dev, (h, b), (128,), reduce_args)
    return out
