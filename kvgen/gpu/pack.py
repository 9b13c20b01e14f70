"""Bulk fp8 / q4 pack and unpack of whole KV blocks, as Numba CUDA kernels.

Used by the warm tier's lossy codecs on CUDA pools (kvgen.engine.kv.tiers.WarmCodec, setting
kv_warm_codec fp8 / q4): a demoted block is packed on the GPU and only the small payload
crosses to host memory; promotion unpacks it on the GPU. Numba, not CUDA C, so the same code
also runs in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) and CI checks it bit-exactly
against the torch references in kvgen.engine.kv.quant without a GPU.

Bit-exactness rules the style of the scalar helpers (bits.py) and the kernels:
  * every float is float32: constants are written np.float32(...), so neither Numba on the
    device nor numpy in the simulator promotes anything to float64 (tests/gpu/test_numba_pack.py
    lowers every kernel and fails on any double in the IR);
  * fp16 / bf16 / e4m3 values are handled as raw bits (int16 / uint8 views of the tensors,
    because Numba has no bf16 or fp8 type), and converted arithmetically with exact steps
    (power-of-two scaling, floor) plus an explicit round-half-to-even;
  * no multiply followed by an add (the device compiler would fuse it into an fma).

Array arguments are anything Numba accepts as a device array: numba device arrays or
`cuda.as_cuda_array(torch_tensor)` on a GPU, numpy arrays in the simulator. kvgen.gpu.ops
wraps these for torch tensors.
"""

from __future__ import annotations

import numpy as np

# numba-cuda 0.30 (the newest release) registers an overload for np.row_stack whenever NumPy is
# 2.x, but NumPy 2.5 removed that alias (a plain vstack), so its first kernel compile fails
# with AttributeError there. Restore the alias before numba-cuda looks for it; drop this when
# numba-cuda checks for the attribute as numba itself does.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402 (after the alias above)

from kvgen.gpu.bits import F32, build_helpers  # noqa: E402

THREADS = 128
MAX_BLOCKS = 4096  # grid-stride loops cover the rest


# Device versions, called by the kernels.
_d = build_helpers(cuda.jit(device=True))
_load, _encode16, _fp8_code, _e4m3_value = _d["load"], _d["encode16"], _d["fp8_code"], _d["e4m3_value"]
_q4_code, _f16_bits, _f16_value = _d["q4_code"], _d["f16_bits"], _d["f16_value"]


# ---- kernels ------------------------------------------------------------------------------
# fp8 arrays are 4-D [M, T, KVH, HD] with scales [M, KVH] (M = blocks x layers x k|v for a
# slice of the store); q4 arrays are 2-D rows [R, HD], codes [R, HD // 2], scales [R, HD // G].


@cuda.jit
def fp8_scale_kernel(x, kind, scale):
    """scale[m, h] = absmax(x[m, :, h, :]) / 448. Grid (M, KVH), THREADS threads (a power of 2)."""
    m = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    t_n = x.shape[1]
    hd = x.shape[3]
    red = cuda.shared.array(THREADS, np.float32)
    amax = np.float32(0.0)
    for i in range(tid, t_n * hd, cuda.blockDim.x):
        a = abs(_load(x[m, i // hd, h, i % hd], kind))
        if a > amax:
            amax = a
    red[tid] = amax
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step and red[tid + step] > red[tid]:
            red[tid] = red[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        scale[m, h] = red[0] / np.float32(448.0)


@cuda.jit
def fp8_quant_kernel(x, kind, scale, q):
    """q[m, t, h, d] = e4m3(x / scale[m, h]); one thread per element (grid-stride)."""
    t_n, kvh, hd = x.shape[1], x.shape[2], x.shape[3]
    total = x.shape[0] * t_n * kvh * hd
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        d = i % hd
        r = i // hd
        h = r % kvh
        r = r // kvh
        t = r % t_n
        m = r // t_n
        q[m, t, h, d] = _fp8_code(_load(x[m, t, h, d], kind), scale[m, h])


@cuda.jit
def fp8_dequant_f32_kernel(q, scale, out):
    """out[m, t, h, d] = float(q) * scale[m, h] as float32."""
    t_n, kvh, hd = q.shape[1], q.shape[2], q.shape[3]
    total = q.shape[0] * t_n * kvh * hd
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        d = i % hd
        r = i // hd
        h = r % kvh
        r = r // kvh
        t = r % t_n
        m = r // t_n
        out[m, t, h, d] = _e4m3_value(int(q[m, t, h, d])) * scale[m, h]


@cuda.jit
def fp8_dequant_16_kernel(q, scale, kind, out):
    """Same as fp8_dequant_f32_kernel, out as int16 fp16 / bf16 bits (rounded to nearest even)."""
    t_n, kvh, hd = q.shape[1], q.shape[2], q.shape[3]
    total = q.shape[0] * t_n * kvh * hd
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        d = i % hd
        r = i // hd
        h = r % kvh
        r = r // kvh
        t = r % t_n
        m = r // t_n
        out[m, t, h, d] = _encode16(_e4m3_value(int(q[m, t, h, d])) * scale[m, h], kind)


@cuda.jit
def q4_scale_kernel(x, kind, group, scales):
    """scales[r, g] = fp16 bits of absmax(x[r, g*G:(g+1)*G]) / 7; one thread per group."""
    ng = scales.shape[1]
    total = x.shape[0] * ng
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        r = i // ng
        g = i % ng
        amax = np.float32(0.0)
        for j in range(group):
            a = abs(_load(x[r, g * group + j], kind))
            if a > amax:
                amax = a
        b = _f16_bits(amax / np.float32(7.0))
        scales[r, g] = b - 65536 if b >= 32768 else b


@cuda.jit
def q4_pack_kernel(x, kind, group, scales, packed):
    """packed[r, j] = code(x[r, 2j]) | code(x[r, 2j+1]) << 4 with the stored (rounded) scales;
    one thread per byte. Run after q4_scale_kernel on the same stream."""
    nb = packed.shape[1]
    total = x.shape[0] * nb
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        r = i // nb
        j = i % nb
        d0 = 2 * j
        s0 = _f16_value(int(scales[r, d0 // group]) & 0xFFFF)
        s1 = _f16_value(int(scales[r, (d0 + 1) // group]) & 0xFFFF)
        lo = _q4_code(_load(x[r, d0], kind), s0)
        hi = _q4_code(_load(x[r, d0 + 1], kind), s1)
        packed[r, j] = lo | (hi << 4)


@cuda.jit
def q4_dequant_f32_kernel(packed, scales, group, out):
    """out[r, d] = (code - 8) * scale as float32; one thread per byte (two elements)."""
    nb = packed.shape[1]
    total = packed.shape[0] * nb
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        r = i // nb
        j = i % nb
        byte = int(packed[r, j])
        d0 = 2 * j
        out[r, d0] = np.float32((byte & 15) - 8) * _f16_value(int(scales[r, d0 // group]) & 0xFFFF)
        out[r, d0 + 1] = np.float32((byte >> 4) - 8) * _f16_value(int(scales[r, (d0 + 1) // group]) & 0xFFFF)


@cuda.jit
def q4_dequant_16_kernel(packed, scales, group, kind, out):
    """Same as q4_dequant_f32_kernel, out as int16 fp16 / bf16 bits."""
    nb = packed.shape[1]
    total = packed.shape[0] * nb
    for i in range(cuda.grid(1), total, cuda.gridsize(1)):
        r = i // nb
        j = i % nb
        byte = int(packed[r, j])
        d0 = 2 * j
        v0 = np.float32((byte & 15) - 8) * _f16_value(int(scales[r, d0 // group]) & 0xFFFF)
        v1 = np.float32((byte >> 4) - 8) * _f16_value(int(scales[r, (d0 + 1) // group]) & 0xFFFF)
        out[r, d0] = _encode16(v0, kind)
        out[r, d0 + 1] = _encode16(v1, kind)


KERNELS = (fp8_scale_kernel, fp8_quant_kernel, fp8_dequant_f32_kernel, fp8_dequant_16_kernel,
           q4_scale_kernel, q4_pack_kernel, q4_dequant_f32_kernel, q4_dequant_16_kernel)


# ---- launchers ----------------------------------------------------------------------------


def _grid(total: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-total // THREADS)))


def fp8_pack(x, kind, q, scale, stream=0) -> None:
    """x [M, T, KVH, HD] (float32, or int16 bits of kind F16/BF16) -> q uint8 e4m3 bits (same
    shape) and scale float32 [M, KVH] = absmax over (T, HD) / 448."""
    m, _, kvh, _ = x.shape
    if m == 0 or x.size == 0:
        return
    fp8_scale_kernel[(m, kvh), THREADS, stream](x, np.int32(kind), scale)
    fp8_quant_kernel[_grid(x.size), THREADS, stream](x, np.int32(kind), scale, q)


def fp8_unpack(q, scale, kind, out, stream=0) -> None:
    """q uint8 [M, T, KVH, HD], scale [M, KVH] -> out (float32, or int16 bits of kind)."""
    if q.size == 0:
        return
    if kind == F32:
        fp8_dequant_f32_kernel[_grid(q.size), THREADS, stream](q, scale, out)
    else:
        fp8_dequant_16_kernel[_grid(q.size), THREADS, stream](q, scale, np.int32(kind), out)


def q4_pack(x, kind, group, packed, scales, stream=0) -> None:
    """x [R, HD] -> packed uint8 [R, HD // 2], scales int16 (fp16 bits) [R, HD // group]."""
    if x.size == 0:
        return
    q4_scale_kernel[_grid(scales.size), THREADS, stream](x, np.int32(kind), np.int32(group), scales)
    q4_pack_kernel[_grid(packed.size), THREADS, stream](x, np.int32(kind), np.int32(group), scales, packed)


def q4_unpack(packed, scales, group, kind, out, stream=0) -> None:
    """packed [R, HD // 2], scales (fp16 bits) [R, HD // group] -> out [R, HD]."""
    if packed.size == 0:
        return
    if kind == F32:
        q4_dequant_f32_kernel[_grid(packed.size), THREADS, stream](packed, scales, np.int32(group), out)
    else:
        q4_dequant_16_kernel[_grid(packed.size), THREADS, stream](
            packed, scales, np.int32(group), np.int32(kind), out)
