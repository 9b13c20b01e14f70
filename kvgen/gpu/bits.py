"""Scalar helpers of the Numba pack kernels (pack.py): float32 <-> fp16 / bf16 / e4m3 bits and
the fp8 and q4 codes, as plain Python functions that build_helpers compiles with any Numba
decorator (cuda.jit(device=True) for the kernels; numba.njit in the tests, which check them
bit-exactly against kvgen.engine.kv.quant without a GPU; as they are, they are what the CUDA
simulator runs).

Bit-exactness rules their style (pack.py says why): float32 everywhere (constants written
np.float32(...)), fp16 / bf16 / e4m3 handled as raw bits with exact steps and an explicit
round-half-to-even, and no multiply followed by an add (the device compiler would fuse it).
"""

from __future__ import annotations

import math
import types

import numpy as np

# Element kinds of the x / out arrays: float32 values, or int16 bits of fp16 / bf16.
F32, F16, BF16 = 0, 1, 2


def rne(y):
    """Round a float32 to the nearest integer, ties to even (CUDA rintf, torch.round)."""
    f = np.float32(math.floor(y))
    d = y - f  # exact: y and floor(y) are within 1 of each other
    if d > np.float32(0.5) or (d == np.float32(0.5) and (int(f) & 1) == 1):
        f = f + np.float32(1.0)
    return f


def sign_bit(x):
    """1 if float32 x has its sign bit set (also for -0.0), else 0."""
    return 1 if math.copysign(np.float32(1.0), x) < np.float32(0.0) else 0


def f16_bits(x):
    """float32 -> fp16 bits 0..65535, round to nearest even, inf past the range."""
    s = sign_bit(x) << 15
    a = abs(x)
    if a != a:
        return 0x7E00
    if a >= np.float32(65520.0):
        return s | 0x7C00
    if a < np.float32(6.103515625e-05):  # 2^-14, smallest normal: fixed spacing 2^-24
        return s | int(rne(a * np.float32(16777216.0)))  # 2^24; 1024 = smallest normal, right
    mant, e = math.frexp(a)  # a = mant * 2^e, 0.5 <= mant < 1
    m = int(rne(np.float32(math.ldexp(mant, 11))))  # 11 significant bits, 1024..2048
    e = e - 1
    if m == 2048:
        m = 1024
        e = e + 1
    return s | ((e + 15) << 10) | (m - 1024)


def f16_value(b):
    """fp16 bits (0..65535) -> float32."""
    e = (b >> 10) & 31
    m = b & 1023
    if e == 0:
        v = np.float32(m) * np.float32(5.960464477539063e-08)  # m * 2^-24
    elif e == 31:
        v = np.float32(math.inf) if m == 0 else np.float32(math.nan)
    else:
        v = np.float32(math.ldexp(np.float32(1024 + m), e - 25))
    if b & 0x8000:
        v = -v
    return v


def bf16_bits(x):
    """float32 -> bf16 bits 0..65535, round to nearest even."""
    s = sign_bit(x) << 15
    a = abs(x)
    if a != a:
        return s | 0x7FC0
    if a == np.float32(math.inf):
        return s | 0x7F80
    if a < np.float32(1.1754943508222875e-38):  # 2^-126: bf16 subnormals, spacing 2^-133
        y = (a * np.float32(7.378697629483821e19)) * np.float32(1.4757395258967641e20)  # 2^66 * 2^67
        return s | int(rne(y))  # 128 = smallest normal, right
    mant, e = math.frexp(a)
    m = int(rne(np.float32(math.ldexp(mant, 8))))  # 8 significant bits, 128..256
    e = e - 1
    if m == 256:
        m = 128
        e = e + 1
    if e + 127 >= 255:
        return s | 0x7F80
    return s | ((e + 127) << 7) | (m - 128)


def bf16_value(b):
    """bf16 bits (0..65535) -> float32."""
    e = (b >> 7) & 255
    m = b & 127
    if e == 0:
        v = (np.float32(m) * np.float32(6.776263578034403e-21)) * np.float32(1.3552527156068805e-20)
    elif e == 255:
        v = np.float32(math.inf) if m == 0 else np.float32(math.nan)
    else:
        v = np.float32(math.ldexp(np.float32(128 + m), e - 134))
    if b & 0x8000:
        v = -v
    return v


def e4m3_bits(x):
    """float32 (already clamped to +-448) -> float8_e4m3fn bits 0..255, nearest even."""
    s = sign_bit(x) << 7
    a = abs(x)
    if a != a:
        return s | 0x7F
    if a < np.float32(0.015625):  # 2^-6, smallest normal: fixed spacing 2^-9
        return s | int(rne(a * np.float32(512.0)))  # 8 = smallest normal, right
    mant, e = math.frexp(a)
    m = int(rne(np.float32(math.ldexp(mant, 4))))  # 4 significant bits, 8..16
    e = e - 1
    if m == 16:
        m = 8
        e = e + 1
    return s | ((e + 7) << 3) | (m - 8)


def e4m3_value(b):
    """float8_e4m3fn bits (0..255) -> float32."""
    e = (b >> 3) & 15
    m = b & 7
    if e == 0:
        v = np.float32(m) * np.float32(0.001953125)  # m * 2^-9
    elif e == 15 and m == 7:
        v = np.float32(math.nan)
    else:
        v = np.float32(math.ldexp(np.float32(8 + m), e - 10))
    if b & 0x80:
        v = -v
    return v


def fp8_code(x, scale):
    """quant.fp8_quantize for one element: x / scale (0 if scale <= 0), clamp +-448, e4m3."""
    y = np.float32(0.0)
    if scale > np.float32(0.0):
        y = x / scale
    y = min(max(y, np.float32(-448.0)), np.float32(448.0))
    return e4m3_bits(y)


def q4_code(x, s):
    """quant.q4_quantize for one element: clamp(round(x / s), -8, 7) + 8; 8 where s == 0.
    Clamping before rounding is the same thing, as -8 and 7 are integers."""
    if not s > np.float32(0.0):
        return 8
    y = min(max(x / s, np.float32(-8.0)), np.float32(7.0))
    return int(rne(y)) + 8


def load(v, kind):
    """An element of an x array as float32: float32 as is, int16 bits decoded."""
    if kind == F32:
        return np.float32(v)
    b = int(v) & 0xFFFF
    if kind == F16:
        return f16_value(b)
    return bf16_value(b)


def encode16(v, kind):
    """float32 -> int16 holding fp16 (kind F16) or bf16 bits."""
    b = f16_bits(v) if kind == F16 else bf16_bits(v)
    return b - 65536 if b >= 32768 else b


HELPERS = (rne, sign_bit, f16_bits, f16_value, bf16_bits, bf16_value, e4m3_bits, e4m3_value,
           fp8_code, q4_code, load, encode16)


def build_helpers(decorate) -> dict:
    """The helpers compiled with `decorate` (cuda.jit(device=True), numba.njit, ...), calling
    each other's compiled versions: copies of the functions with their own globals."""
    g = {"np": np, "math": math, "F32": F32, "F16": F16, "BF16": BF16}
    out = {}
    for f in HELPERS:
        fn = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
        out[f.__name__] = g[f.__name__] = decorate(fn)
    return out
