"""How a bf16 / fp16 model's matrices should run on this CPU (issue #41's HF folders): one layer's
four matmuls (q|k|v, o, gate|up, down) of two model shapes, at 1 row (a decode step) and 512 rows (a
prompt), through
  - fp32:  torch.mm on fp32 weights and activations (what an HF folder ran as before),
  - bf16:  torch.mm on bf16 weights and bf16 activations, on the transposed weight as kvgen's Linear runs
           it, and F.linear on the weight as it is (torch's oneDNN path: avx512_bf16 where the CPU has it),
  - q8:    kvgen's block kernels on Q8_0 blocks made from the weights (WeightBlocks.q8_from_float ->
           BlockLinear: int8 codes and an fp16 scale per 32, int16 activations).
Each route holds several layers of distinct weights, cycled, so a decode step reads its weights from
memory, not the cache, as a real model's does. Prints the best ms per layer of --repeat passes, the
routes' passes alternating.

    .venv/bin/python bench/float_routes.py [--layers 6] [--repeat 5] [--threads N] [--rows 1,512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks  # noqa: E402

# (name, hidden, intermediate, heads, kv heads, head dim): SmolLM2-135M's and SmolLM2-1.7B's shapes
SHAPES = [("135M", 576, 1536, 9, 3, 64), ("1.7B", 2048, 8192, 32, 32, 64)]
ROWS = (1, 512)


def layer_shapes(hidden: int, inter: int, heads: int, kv: int, d: int) -> list[tuple[int, int]]:
    """[out, in] of a layer's fused matrices, as the model holds them."""
    return [((heads + 2 * kv) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]


def make_route(route: str, shapes: list[tuple[int, int]], g: torch.Generator):
    """One layer's matmuls as callables x -> y for a route, over fresh random weights."""
    calls = []
    for out, inp in shapes:
        w = (torch.randn(out, inp, generator=g) * 0.02).to(torch.bfloat16)  # a bf16 checkpoint's values
        if route == "q8":
            calls.append(BlockLinear(WeightBlocks.q8_from_float(w), None))
        elif route == "bf16-linear":  # F.linear on the [out, in] weight, where "bf16" is kvgen's Linear (mm on w.t())
            calls.append(lambda x, w=w: F.linear(x, w))
        else:
            wt = w.to(torch.float32 if route == "fp32" else torch.bfloat16).contiguous().t()
            calls.append(lambda x, wt=wt: torch.mm(x, wt))
    return calls


def time_routes(routes: list[str], shape, layers: int, rows: int, repeat: int) -> dict[str, float]:
    """Best ms per layer of `repeat` passes through `layers` layers, for each route: the routes' passes
    alternate, so that a busy spell on a shared machine slows each alike, and the best pass is the
    least disturbed."""
    g = torch.Generator().manual_seed(0)
    _, hidden, inter, heads, kv, d = shape
    shapes = layer_shapes(hidden, inter, heads, kv, d)
    stacks = {r: [make_route(r, shapes, g) for _ in range(layers)] for r in routes}
    xs = {r: [torch.randn(rows, inp, generator=g).to(torch.float32 if r in ("fp32", "q8") else torch.bfloat16)
              for _, inp in shapes] for r in routes}

    def one_pass(r: str) -> float:
        t = time.perf_counter()
        for calls in stacks[r]:
            for call, x in zip(calls, xs[r], strict=True):
                call(x)
        return (time.perf_counter() - t) / layers * 1e3

    for r in routes:  # warm-up: oneDNN's primitives and weight layouts, Numba's kernels loaded
        one_pass(r)
    best = dict.fromkeys(routes, float("inf"))
    for _ in range(repeat):
        for r in routes:
            best[r] = min(best[r], one_pass(r))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--rows", default=",".join(str(r) for r in ROWS))
    ap.add_argument("--threads", type=int, default=0, help="torch's and Numba's threads (0: as they start)")
    args = ap.parse_args()
    if args.threads:
        import numba

        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| shape | rows | fp32 ms/layer | bf16 mm ms/layer | bf16 linear ms/layer | q8 ms/layer | bf16 / q8 | "
          "fp32 / q8 |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        if shape[0] not in args.shapes.split(","):
            continue
        for rows in (int(r) for r in args.rows.split(",")):
            layers = args.layers if rows == 1 else 1  # a prompt's matmuls are compute-bound: 1 layer does
            ms = time_routes(["fp32", "bf16", "bf16-linear", "q8"], shape, layers, rows, args.repeat)
            bf16 = min(ms["bf16"], ms["bf16-linear"])
            print(f"| {shape[0]} | {rows} | {ms['fp32']:.3f} | {ms['bf16']:.3f} | {ms['bf16-linear']:.3f} | "
                  f"{ms['q8']:.3f} | {bf16 / ms['q8']:.2f} | {ms['fp32'] / ms['q8']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
