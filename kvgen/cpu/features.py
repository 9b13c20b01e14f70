"""What the CPU gives the block kernels (vector_matmul.py, amx_matmul.py): the instruction set
features Numba compiles for, the code path they select, and AMX tiles where Linux grants them."""

from __future__ import annotations

import ctypes
import os

import numba
from llvmlite import binding


def _request_amx() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)): a
    process that has not gets killed by its first tile instruction."""
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, x86-64
    except (OSError, AttributeError):
        return False


# The features Numba compiles for: the host's, or NUMBA_CPU_FEATURES where set (the tests build
# every path below this CPU's that way, with "-amx-int8", "-avx512vnni", "-avx512bw" or "-avx2").
binding.initialize_native_target()
FEATURES = numba.config.CPU_FEATURES or binding.get_host_cpu_features().flatten()
PMADDWD = "+avx2" in FEATURES.split(",")
WIDE = PMADDWD and "+avx512bw" in FEATURES.split(",")
VNNI = WIDE and "+avx512vnni" in FEATURES.split(",")  # vpdpwssd: pmaddwd and the add in one
LANES = 16 if WIDE else 8  # weight rows per vector of sums
# AMX-INT8 tiles for steps of many rows (amx_matmul.py), where Linux grants the process them
AMX = VNNI and "+amx-int8" in FEATURES.split(",") and _request_amx()
# CPU_ACTIVATIONS=int8 (the service's setting, read here because it picks what the kernels compile to):
# the q4, q8, q5, q5m and q6h weights (Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) multiply activations
# rounded to int8 per block of 32 (int8_matmul.py: vpdpbusd, 1.6-2.0x the int16 kernels' multiply-adds from 16
# rows up, Q8_0 1.4-1.6x, at llama.cpp's activation rounding; IQ4, Q3_K, Q2_K keep int16); int16, the default, keeps
# int16_rounding's 2^-16. Every row count takes the same kernel, so a row's output still does not
# depend on the others. Needs AVX512-VNNI; the service refuses the setting elsewhere.
ACTIVATIONS = os.environ.get("CPU_ACTIVATIONS", "int16").strip().lower() or "int16"
INT8 = VNNI and ACTIVATIONS == "int8"


def path() -> str:
    """The code path the block kernels were built for here (GetModelInfo.cpu_kernels and the log):
    amx (tiles for steps of amx_matmul.AMX_FROM rows or more, vpdpwssd below), avx512-vnni,
    avx512, avx2 or portable; "+int8" where block weights take int8 activations (CPU_ACTIVATIONS)."""
    if AMX:
        return "amx+int8" if INT8 else "amx"
    if INT8:
        return "avx512-vnni+int8"
    return "avx512-vnni" if VNNI else "avx512" if WIDE else "avx2" if PMADDWD else "portable"
