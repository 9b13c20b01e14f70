"""kvgen's CPU backend: Numba kernels for weights kept in GGUF's quantized blocks, paged attention
over the KV pool's fp32 / fp8 / q4 blocks, and a model's whole decode step as one compiled call.

It knows nothing of the engine: its functions take numpy arrays (and torch tensors that wrap
them), and the engine (kvgen/engine/model.py, fused_decode.py) decides when they run. README.md
beside this file lists the modules and says how each kernel is checked.

Importing the package sets, once, what every kernel module needs before its first decorator runs:
Numba's OpenMP threading layer and the folder of its disk cache (kernel_cache.py), keyed on this
package's sources and the CPU's features, so a change anywhere else in kvgen recompiles nothing.
"""

from __future__ import annotations

import numba

from kvgen.cpu import features, kernel_cache

# torch's CPU parallelism is libgomp's: the kernels take the same runtime kind (vector_matmul.py's
# note on threads)
numba.config.THREADING_LAYER = "omp"
kernel_cache.use_cache_dir(f"{features.FEATURES} parts={numba.config.NUMBA_NUM_THREADS} amx={features.AMX} "
                           f"int8={features.INT8}")
