"""The int8-activation kernels (kvgen/cpu/int8_matmul.py: q4, q8, q5, q5m, q6h) against the int16 kernels kvgen
runs by default.

    .venv/bin/python bench/int8_matmul.py [--types Q4_K Q4_0 Q8_0 Q6_K Q5_K Q5_0 Q5_1] [--rows 1 4 16 64 512]

Same weights (random blocks of each type, the shapes of a 1.7B llama's matrices), same activations,
both kernels on the process's Numba threads: block_matmul's linear of the type's kind (int16 activations,
vpdpwssd; AMX tiles from 12 rows where the CPU has them, q4 and q8) and int8_matmul's (int8, vpdpbusd), the
activations' rounding included in both. Prints each one's best time in ms (--reps calls at least,
after a warm-up call, the two kernels called in turn, more calls until each has run 0.3 s), the
ratio, the weights' GB/s at 1 row (one weight called over and over: from the caches, its 2.4 to
19 MB fit a Zen 4's L3; and a ring of copies past the L3 called in turn: DRAM's), and each
kernel's largest error against gguf-py's fp32 weights (float64 product) relative to the output's
largest value, on the first ERR_ROWS outputs. Prints the load average before and after: on a
busy machine the times mean little.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import gguf
import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvgen.cpu import block_matmul, features, int8_matmul, int16_rounding  # noqa: E402
from kvgen.cpu.vector_matmul import TILE  # noqa: E402
from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks  # noqa: E402

# (name, N, K): a 1.7B llama (2048 wide, 8192 MLP): q (and o), gate|up fused, down
SHAPES = (("q/o 2048x2048", 2048, 2048), ("gate|up 16384x2048", 16384, 2048), ("down 2048x8192", 2048, 8192))
# a random block's fp16 fields: (byte offset, magnitude), as tests/cpu/test_weight_blocks.py's
FP16_FIELDS = {"Q4_0": ((0, 2e-2),), "Q4_1": ((0, 2e-2), (2, 0.1)), "Q4_K": ((0, 2e-4), (2, 1e-3)),
               "Q8_0": ((0, 2e-3),), "Q5_0": ((0, 1e-2),), "Q5_1": ((0, 5e-3), (2, 0.1)),
               "Q5_K": ((0, 1e-4), (2, 1e-3)), "Q6_K": ((208, 5e-5),)}
NO_LAYOUT = ("q5", "q6h")  # the kinds of one scale layout: their linears take no layout argument
ERR_ROWS = 1024  # output rows the error is measured on


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid blocks for an [n, k] weight: every code and packed scale at random, fp16 scales sane."""
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at, scale in FP16_FIELDS[type_name]:
        v = (rng.uniform(0.25, 1, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]) * scale).astype(np.float16)
        raw[..., at:at + 2] = v[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def int16(weights: list, x: np.ndarray, y: np.ndarray, room) -> None:
    """y = x W^T through the int16 path, for each (kind, qs, scales, layout) of weights in turn."""
    for kind, qs, scales, layout in weights:
        linear = getattr(block_matmul, f"{kind}_linear")
        if kind in NO_LAYOUT:
            linear(x, qs, scales, y, room)
        else:
            linear(x, qs, scales, layout, y, room)


def int8(weights: list, x: np.ndarray, y: np.ndarray, room=None) -> None:
    for kind, qs, scales, layout in weights:
        linear = getattr(int8_matmul, f"{kind}_linear_int8")
        if kind in NO_LAYOUT:
            linear(x, qs, scales, y)
        else:
            linear(x, qs, scales, layout, y)


def best_ms(fns, reps: int, seconds: float = 0.3, most: int = 200) -> list[float]:
    """Each fn's best time in ms: the fns called in turn (A, B, A, B, ...: a busy spell on the
    machine slows both alike), reps rounds at least, more until each has run `seconds`."""
    for fn in fns:
        fn()  # warm: caches, pages
    best, spent, rounds = [float("inf")] * len(fns), [0.0] * len(fns), 0
    while rounds < reps or (min(spent) < seconds and rounds < most):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            t = time.perf_counter() - t
            best[i], spent[i] = min(best[i], t), spent[i] + t
        rounds += 1
    return [1e3 * b for b in best]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q4_0", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 512])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="Numba threads (default: all the process has)")
    ap.add_argument("--ring-mb", type=int, default=320,
                    help="at 1 row, also time a ring of copies of the weight this large (past the L3: DRAM's GB/s)")
    ap.add_argument("--error-rows", type=int, default=16, help="activation rows the errors are measured at")
    args = ap.parse_args()
    if not features.VNNI:
        sys.exit("this CPU has no AVX512-VNNI: the int8 kernels do not run here")
    if features.INT8:
        sys.exit("run it with CPU_ACTIVATIONS unset (int16): block_matmul's linears are then the int16 ones")
    if args.threads:
        numba.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()}, numba threads {numba.get_num_threads()}, path {features.path()}, "
          f"int8 ROWS_AT_ONCE {int8_matmul.ROWS_AT_ONCE} CHAINS {int8_matmul.CHAINS}")
    int8_matmul.compile_int8_kernels()
    rng = np.random.default_rng(0)
    print("GB/s: the weights' bytes over the best time, a weight called over and over (the cache's), and")
    print(f"a ring of copies of it ({args.ring_mb} MB) called in turn (DRAM's)")
    print("| type | matrix | rows | int16 ms | int8 ms | int16 / int8 | GB/s int16 | GB/s int8 | ring GB/s int16 "
          "| ring GB/s int8 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    errors = []
    for type_name in args.types:
        for si, (name, n, k) in enumerate(SHAPES):
            raw = random_blocks(type_name, n, k, seed=si)
            lin = BlockLinear(WeightBlocks.from_gguf(type_name, raw), None)
            weight_bytes = lin.qs.nbytes + lin.scales.nbytes
            one = [(lin.kind, lin.qs, lin.scales, lin.layout)]
            for rows in args.rows:
                x = rng.standard_normal((rows, k)).astype(np.float32)
                y = np.empty((rows, lin.qs.shape[0] * TILE), np.float32)
                room = int16_rounding.scratch(rows, k)
                old, new = best_ms([partial(int16, one, x, y, room), partial(int8, one, x, y)], args.reps)
                gbs = " |  |  | "
                if rows == 1:
                    ring = [(lin.kind, lin.qs.copy(), lin.scales.copy(), lin.layout)
                            for _ in range(-(-args.ring_mb * 2**20 // weight_bytes))]
                    ring_old, ring_new = best_ms([partial(int16, ring, x, y, room), partial(int8, ring, x, y)], 3, 0)
                    b = weight_bytes * len(ring)
                    gbs = " | ".join(f"{v / 1e6:.1f}" for v in (weight_bytes / old, weight_bytes / new,
                                                                 b / ring_old, b / ring_new))
                    del ring
                print(f"| {type_name} | {name} | {rows} | {old:.3f} | {new:.3f} | {old / new:.2f} | {gbs} |",
                      flush=True)
            # errors against the fp32 weights (float64 product), first ERR_ROWS outputs
            x = rng.standard_normal((args.error_rows, k)).astype(np.float32)
            w = gguf.quants.dequantize(raw[:ERR_ROWS], gguf.GGMLQuantizationType[type_name]).reshape(ERR_ROWS, k)
            want = x.astype(np.float64) @ w.astype(np.float64).T
            got = []
            for fn in (int16, int8):
                y = np.empty((len(x), lin.qs.shape[0] * TILE), np.float32)
                fn(one, x, y, int16_rounding.scratch(*x.shape))
                got.append(np.abs(y[:, :ERR_ROWS] - want).max() / np.abs(want).max())
            errors.append((type_name, name, *got))
    print(f"load average {os.getloadavg()}")
    print("\nlargest |y - x W^T| / largest |x W^T| (fp32 weights, float64 product)")
    print("| type | matrix | int16 | int8 |\n| --- | --- | ---: | ---: |")
    for type_name, name, e16, e8 in errors:
        print(f"| {type_name} | {name} | {e16:.2e} | {e8:.2e} |")


if __name__ == "__main__":
    main()
