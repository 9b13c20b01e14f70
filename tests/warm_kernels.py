"""Compile the kernels most of the suite shares, once, before `make test`'s two workers start.

Numba's disk cache (kvgen/cpu/kernel_cache.py) holds a kernel once one process has compiled it, but two
workers that start together both compile the block kernels and the fused step before either has cached
them: minutes of both cores on a fresh machine. `make test` runs this beside the clients' installs, so the
workers find the kernels cached: the embedded model served with each KV format the engine's suites decode
through (fp32 and the quantized fp8 and q4, each a step of its own).

The fused step (decode_step.step) can only be compiled once its callees are, but its two families of
callees do not need each other: the block kernels (weight_blocks.compile_kernels, ~55 s on a Zen 3 core)
and the attention and row kernels (decode_step.warm_up, ~40 s, paged_attention.attend most of it). Each
is compiled in a process of its own, at once, on the machine's two cores; then the step, here, loading
both from the cache (~50 s). One after another in one process the three took ~140 s, this way ~115 s
(beside the installs, which keep the other core busy, no faster: 3 to 4 minutes either way).

    .venv/bin/python -m tests.warm_kernels
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.sampling import SamplingParams


def block_kernels() -> None:
    from kvgen.cpu.weight_blocks import compile_kernels

    compile_kernels()


def attention_kernels() -> None:
    """decode_step.warm_up on a tiny shape: what it compiles depends on its arguments' types alone,
    which are the same for every model (float32 arrays, int64 sizes)."""
    from kvgen.cpu import decode_step

    layers, heads, kv_heads, head_dim, hidden, inter = 2, 4, 2, 16, 64, 128
    norm = np.ones(hidden, np.float32)
    cos, sin = np.ones((32, head_dim // 2), np.float32), np.zeros((32, head_dim // 2), np.float32)
    decode_step.warm_up(layers, heads, kv_heads, head_dim, hidden, inter, norm, 1e-5, cos, sin)


PARTS = {"blocks": block_kernels, "attention": attention_kernels}


def main() -> None:
    t0 = time.perf_counter()
    parts = [subprocess.Popen([sys.executable, "-m", "tests.warm_kernels", name]) for name in PARTS]
    if any([p.wait() for p in parts]):  # both waited for: neither left running behind a failed one
        sys.exit("a kernel warm-up process failed")
    t1 = time.perf_counter()
    for kv in ("auto", "fp8", "q4"):
        gen = Generator.load(None, EngineOptions(kv_dtype=kv, kv_cache_mb=64))
        try:
            gen.generate("The kernels", SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        finally:
            gen.close()
    print(f"kernels compiled or loaded in {time.perf_counter() - t0:.0f} s "
          f"(the step's callees {t1 - t0:.0f} s, two processes at once)")


if __name__ == "__main__":
    PARTS[sys.argv[1]]() if len(sys.argv) > 1 else main()
