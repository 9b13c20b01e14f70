"""`make bench-ab BASE=<rev>`: the engine at a base revision against the working tree, on this
machine, in one run: prefill of a 512-token prompt and decode of 128 tokens at batch 1, per
weight dtype, the two measured in alternating rounds so drift in the machine's load hits both.

Each measurement is a fresh process on one tree (a git worktree of BASE under bench/.cache/ab,
or this checkout), so neither sees the other's OpenMP pool (kvgen/cpu/threads.py). Only the
Python API both revisions have is used: load_model, Generator, generate's timings. Writes
bench/results/ab.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "ab.md"
CACHE = ROOT / "bench" / ".cache" / "ab"

# Run inside the measured tree (its kvgen on sys.path first): prints one JSON line.
MEASURE = r"""
import json, sys
import torch
try:
    from kvgen.engine import model_files
except ImportError:  # a revision before the module's rename (loader.py)
    from kvgen.engine import loader as model_files
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.sampling import SamplingParams

weights, prompt, new_tokens, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
greedy = lambda n: SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
opts = EngineOptions(weight_dtype=weights)
if hasattr(opts, "prefix_cache"):  # measure the engine, not the cache: the prompt repeats
    opts.prefix_cache = False
gen = Generator(*load_model(model_files.embedded_model_path(), weights), opts)
gen.generate(prompt[:32], greedy(4))  # warm-up
prefill = max(len(prompt) / (gen.generate(prompt, greedy(1)).timings["time_to_first_token_ms"] / 1e3)
              for _ in range(repeats))
decode, tokens = 0.0, None
for _ in range(repeats):
    r = gen.generate("The capital of France is", greedy(new_tokens))
    t = r.timings
    decode = max(decode, (new_tokens - 1) / ((t["total_ms"] - t["time_to_first_token_ms"]) / 1e3))
    tokens = list(r.token_ids)
gen.close()
print(json.dumps({"prefill_tps": prefill, "decode_tps": decode, "tokens": tokens}))
"""


def worktree(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = CACHE / sha[:12]
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def measure(tree: Path, weights: str, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", MEASURE, weights, json.dumps(prompt), str(new_tokens), str(repeats)],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{tree}: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    ap.add_argument("--weights", default="fp32,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="measurements per round (the best is kept)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench import peers

    prompt = peers.prompt_ids(512)
    trees = {"base": worktree(args.base), "work": ROOT}
    load0 = os.getloadavg()[0]
    got: dict = {}
    for weights in args.weights.split(","):
        for i in range(args.rounds):
            order = ("base", "work") if i % 2 == 0 else ("work", "base")
            for name in order:
                r = measure(trees[name], weights, prompt, args.new_tokens, args.repeats)
                got.setdefault((weights, name), []).append(r)
                print(f"{weights} round {i} {name}: prefill {r['prefill_tps']:.0f} decode {r['decode_tps']:.1f}",
                      file=sys.stderr)
    base_sha = trees["base"].name
    lines = ["# Before / after: the engine at a base revision against the working tree\n",
             f"{datetime.date.today()} · {peers.cpu_name()} · {peers.cores()} cores · "
             f"base {base_sha} vs the working tree of {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()} · "  # noqa: E501
             f"{args.rounds} alternating rounds, best of {args.repeats} per round, median, prefix cache off · "
             f"load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n",
             "| weights | prefill tok/s base | prefill tok/s work | work / base | decode tok/s base | "
             "decode tok/s work | work / base | same greedy tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for weights in args.weights.split(","):
        b, w = got[(weights, "base")], got[(weights, "work")]
        med = {k: {n: statistics.median(r[k] for r in rs) for n, rs in (("b", b), ("w", w))}
               for k in ("prefill_tps", "decode_tps")}
        same = all(r["tokens"] == b[0]["tokens"] for r in b + w)
        p, d = med["prefill_tps"], med["decode_tps"]
        lines.append(f"| {weights} | {p['b']:.0f} | {p['w']:.0f} | {p['w'] / p['b']:.2f} | {d['b']:.1f} | "
                     f"{d['w']:.1f} | {d['w'] / d['b']:.2f} | {'yes' if same else 'NO'} |")
    lines.append("\nPer round (prefill / decode tok/s): " + "; ".join(
        f"{wt} {n}: " + ", ".join(f"{r['prefill_tps']:.0f}/{r['decode_tps']:.1f}" for r in rs)
        for (wt, n), rs in got.items()))
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
