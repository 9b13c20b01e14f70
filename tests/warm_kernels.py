"""Compile the kernels most of the suite shares, once, before `make test`'s two workers start.

Numba's disk cache (kvgen/cpu/kernel_cache.py) holds a kernel once one process has compiled it, but two
workers that start together both compile the block kernels and the fused step before either has cached
them: minutes of both cores on a fresh machine. `make test` runs this beside the clients' installs, which
wait on the network, so the workers find the kernels cached: the embedded model served with each KV format
the engine's suites decode through (fp32 and the quantized fp8 and q4, each a step of its own).

    .venv/bin/python -m tests.warm_kernels
"""

from __future__ import annotations

import time

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.sampling import SamplingParams


def main() -> None:
    t0 = time.perf_counter()
    for kv in ("auto", "fp8", "q4"):
        gen = Generator.load(None, EngineOptions(kv_dtype=kv, kv_cache_mb=64))
        try:
            gen.generate("The kernels", SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        finally:
            gen.close()
    print(f"kernels compiled or loaded in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
