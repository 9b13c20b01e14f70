"""The CPU's integer multiply-add ceiling, and what it allows a prefill: how many int16 and int8 multiply-adds
the cores issue a second, measured, against the multiply-adds a prompt token takes on a model file.

A prompt's prefill is compute-bound: each token multiplies every weight once, and a 512-token prompt reuses
each weight 512 times from the caches. kvgen's default activations are int16 (vector_matmul.py: pmaddwd and an
add, or vpdpwssd with AVX512-VNNI: 2 multiply-adds a 32-bit lane); llama.cpp's are int8 (pmaddubsw widened by a
pmaddwd and added, or vpdpbusd: 4 a lane). So the rate of that sequence bounds the tokens a second a kernel
built on it can reach:

    ceiling tok/s = multiply-adds a second / (2-D weights' elements: one multiply-add each a token)

Measured with a loop of 12 independent chains of the sequence (its latency hidden) on every thread the kernels
use (Numba's, one a core), about 2 s each, registers only: no memory, no unpacking of codes, no scales.

    make bench-peak   (or .venv/bin/python bench/mac_peak.py [--model FILE.gguf ...] [--llama-bench] [--out FILE])

--llama-bench runs llama-bench pp512 (bench/setup_models.sh builds it) on each file in the same run, so the
table says how close llama.cpp's prefill comes to its own (int8) ceiling and where kvgen's (int16) lies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from bench import models  # noqa: E402  (its files, llama-bench and kvgen rounds)
from bench.peers import cpu_name  # noqa: E402
from kvgen.cpu import features  # noqa: E402

CHAINS = 12
SECONDS = 2.0
# The multiply-add sequence each kind of kernel is built on, as the kernels issue it: name -> (LLVM
# intrinsics in order, vector bits, multiply-adds a sequence, activations, who runs it). Without VNNI the sum
# is an add of its own (int16), and int8 products widen through a pmaddwd by ones first (llama.cpp's AVX2 dot).
SEQUENCES = {
    "pmaddwd + paddd (AVX2)": (("llvm.x86.avx2.pmadd.wd",), 256, 16, "int16", "kvgen (default)"),
    "pmaddubsw + pmaddwd + paddd (AVX2)": (("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"), 256, 32,
                                           "int8", "llama.cpp"),
    "vpmaddwd + vpaddd (AVX-512)": (("llvm.x86.avx512.pmaddw.d.512",), 512, 32, "int16", "kvgen (default)"),
    "vpmaddubsw + vpmaddwd + vpaddd (AVX-512)": (("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
                                                 512, 64, "int8", "llama.cpp"),
    "vpdpwssd (AVX512-VNNI)": (("llvm.x86.avx512.vpdpwssd.512",), 512, 32, "int16", "kvgen (default)"),
    "vpdpbusd (AVX512-VNNI)": (("llvm.x86.avx512.vpdpbusd.512",), 512, 64, "int8",
                               "llama.cpp; kvgen CPU_ACTIVATIONS=int8"),
}


def available() -> list[str]:
    """The sequences this CPU (as Numba compiles for it) has."""
    need = {256: features.PMADDWD, 512: features.WIDE}
    return [name for name, (fns, bits, *_) in SEQUENCES.items()
            if need[bits] and ("vpdp" not in fns[0] or features.VNNI)]


def _chains(name: str):
    """An intrinsic: n rounds of CHAINS independent sums, each adding one sequence's products of its own
    running value (so nothing is hoisted out of the loop) and a constant; returns a lane of their total."""
    fns, bits, _, _, _ = SEQUENCES[name]
    i32s, i16s, i8s = (ir.VectorType(ir.IntType(w), bits // w) for w in (32, 16, 8))

    def const(ty, v):
        return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)

    @intrinsic
    def run(typingctx, n):
        def codegen(context, builder, signature, args):
            mod = builder.module
            accs = [cgutils.alloca_once_value(builder, const(i32s, i + 1)) for i in range(CHAINS)]
            with cgutils.for_range(builder, args[0]):
                for acc in accs:
                    v = builder.load(acc)
                    if "vpdp" in fns[0]:  # acc + products in one
                        fn = cgutils.get_or_insert_function(mod, ir.FunctionType(i32s, [i32s] * 3), fns[0])
                        builder.store(builder.call(fn, [v, const(i32s, 0x03030303), v]), acc)
                        continue
                    x = builder.bitcast(v, i16s)
                    if len(fns) == 2:  # u8 x s8 pairs to int16, widened by a pmaddwd with ones
                        ubs = cgutils.get_or_insert_function(mod, ir.FunctionType(i16s, [i8s, i8s]), fns[0])
                        x = builder.call(ubs, [const(i8s, 3), builder.bitcast(v, i8s)])
                    wd = cgutils.get_or_insert_function(mod, ir.FunctionType(i32s, [i16s, i16s]), fns[-1])
                    products = builder.call(wd, [x, const(i16s, 1 if len(fns) == 2 else 3)])
                    builder.store(builder.add(v, products), acc)
            total = builder.load(accs[0])
            for acc in accs[1:]:
                total = builder.add(total, builder.load(acc))
            return builder.sext(builder.extract_element(total, ir.Constant(ir.IntType(32), 0)), ir.IntType(64))

        return types.int64(n), codegen

    @njit(parallel=True, nogil=True)
    def on_threads(n, threads):  # pragma: no cover - compiled
        out = np.zeros(threads, np.int64)
        for t in prange(threads):
            out[t] = run(n)
        return out

    return on_threads


def rate(name: str, threads: int) -> float:
    """Multiply-adds a second on `threads` threads: sequences a second x multiply-adds each."""
    f = _chains(name)
    f(1000, threads)  # compile
    n = 1_000_000
    while True:  # grow the loop until a call takes a quarter of SECONDS
        t = time.perf_counter()
        f(n, threads)
        dt = time.perf_counter() - t
        if dt > SECONDS / 4:
            break
        n *= 4
    n = int(n * SECONDS / dt)
    t = time.perf_counter()
    f(n, threads)
    dt = time.perf_counter() - t
    return n * CHAINS * threads / dt * SEQUENCES[name][2]


def weight_elements(path: str) -> int:
    """The 2-D weights' elements a token multiplies: every matrix but the token embedding (a row a token;
    a tied one is the output head too, and counted as that)."""
    import gguf
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    n = 0
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # a row a token, not a matmul
        n += int(np.prod([int(s) for s in t.shape]))
    return n


def llama_pp512(path: str, threads: int) -> float | None:
    llama_bench = models.TOOLS / "llama-bench"  # bench/setup_models.sh builds it
    if not llama_bench.exists():
        return None
    cmd = [str(llama_bench), "-m", path, "-t", str(threads), "-p", "512", "-n", "0", "-r", "2", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def kvgen_prefill(path: str) -> float:
    """kvgen's prefill of a 512-token prompt on path, tok/s: bench/models.py's round (a process of its own,
    `make serve`'s defaults), best of two."""
    return max(models.run_kvgen(path)["prefill_tps"] for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="*", default=None,
                    help="GGUF files (default: the embedded model, its re-encodings and the 1.7B files of "
                         "bench/setup_models.sh)")
    ap.add_argument("--llama-bench", action="store_true", help="llama-bench pp512 on each file, same run")
    ap.add_argument("--kvgen", action="store_true", help="kvgen's prefill of 512 tokens on each file, same run")
    ap.add_argument("--out", default=str(ROOT / "bench/results/mac_peak.md"))
    args = ap.parse_args()
    if args.model is None:  # bench-models' main table but the 8B file, whose kvgen round alone takes minutes
        args.model = [path for name, path in models.files()
                      if name not in models.FAMILIES and not name.startswith("8B")]
    threads = numba.config.NUMBA_NUM_THREADS
    started = time.time()
    load = os.getloadavg()[0]
    rates = {name: rate(name, threads) for name in available()}
    best = {kind: max((r for n, r in rates.items() if SEQUENCES[n][3] == kind), default=0.0)
            for kind in ("int16", "int8")}
    lines = [
        "Each sequence in 12 independent chains on every thread, registers only, nothing else issued: the most "
        "a kernel built on it can multiply (a real one also unpacks the weights' codes, broadcasts the activations "
        "and scales the sums). kvgen's default activations are int16; llama.cpp's int8.\n",
        "| sequence | activations | whose kernels | G multiply-adds / s, all threads | per thread |",
        "|---|---|---|---:|---:|",
    ]
    for name, r in rates.items():
        _, _, _, kind, who = SEQUENCES[name]
        lines.append(f"| {name} | {kind} | {who} | {r / 1e9:.0f} | {r / threads / 1e9:.0f} |")
    if args.model:
        lines += ["", "Prefill ceiling = the best rate / the 2-D weights' elements (one multiply-add each a token; "
                  "the token embedding, a row a token, left out); attention adds to it at 512 tokens. llama-bench: "
                  "pp512, -r 2, its mean; kvgen: bench/models.py's 512-token prefill under `make serve`'s defaults, "
                  "the better of two processes.\n",
                  "| file | weights (2-D, M) | int16 ceiling tok/s | int8 ceiling tok/s | llama-bench pp512 tok/s | "
                  "its % of the int8 ceiling | kvgen prefill tok/s | its % of the int16 ceiling | "
                  "2x pp512 / int16 ceiling |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for path in args.model:
            n = weight_elements(path)
            c16, c8 = best["int16"] / n, best["int8"] / n
            pp = llama_pp512(path, threads) if args.llama_bench else None
            kv = kvgen_prefill(path) if args.kvgen else None
            cols = [f"{n / 1e6:.0f}", f"{c16:.0f}", f"{c8:.0f}" if c8 else "-",
                    f"{pp:.1f}" if pp else "-", f"{100 * pp / c8:.0f}%" if pp and c8 else "-",
                    f"{kv:.1f}" if kv else "-", f"{100 * kv / c16:.0f}%" if kv else "-",
                    f"{2 * pp / c16:.2f}" if pp else "-"]
            lines.append(f"| {os.path.basename(path)} | " + " | ".join(cols) + " |")
            print(lines[-1], flush=True)
    lines[:0] = [
        "# The CPU's integer multiply-add ceiling and the prefill it allows\n",
        f"{datetime.date.today()} · {cpu_name()} · {threads} threads (Numba's, one a core) · "
        f"load average at the start {load:.2f}, at the end {os.getloadavg()[0]:.2f} · `make bench-peak` "
        f"({time.time() - started:.0f} s)\n",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
