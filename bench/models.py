"""`make bench-models`: kvgen next to llama.cpp's llama-bench on the same GGUF files, same run.

Writes bench/results/models.md. bench/setup_models.sh makes the files (the embedded SmolLM2-135M
Q4_1 re-encoded as Q4_K_M, Q5_K_M, Q6_K and Q8_0, offline) and builds llama-bench; this script
only measures.

Per file, ROUNDS rounds (BENCH_ROUNDS, default 3), the peers interleaved (the order alternating
from round to round), each peer's best round reported:
- llama-bench: `llama-bench -m FILE -p 512 -n 128 -t CORES -r 1 -o json`: pp512 (a 512-token
  batch on an empty context) and tg128 (128 single-token decodes) tokens/s, after llama-bench's
  own warm-up.
- kvgen: a fresh `python bench/models.py --kvgen FILE` per round (so no two OpenMP pools share the
  cores), loading the file as `make serve MODEL=FILE` does (Generator.load with the default
  EngineOptions: WEIGHT_DTYPE=auto, prefix cache on, ...). After a warm-up (a different 512-token
  prompt, so the prefix cache has nothing to share, and an 8-token decode), prefill = 512 / time to
  first token of a 512-token prompt at batch 1; decode = 127 / (total - time to first token) of a
  128-token greedy generation from a 5-token prompt, EOS ignored (as bench/cpu.py counts it).
  It also reports the weight dtype auto chose, the block kinds the linears run on, whether the
  fused decode step (kvgen/engine/fused_decode.py) is on and ran, and VmRSS / VmHWM from
  /proc/self/status: after imports, after load_model, after the Generator is built, at the end.

The large files (bench/make_shaped_model.py: SmolLM2-1.7B's shape as Q4_0 and Q4_K_M, Llama 3.1
8B's layers as Q4_K_M, random weights), where setup_models.sh made them, get the same rounds (one
a peer from 2 GiB) and a table of their own: the machine's read bandwidth (a 2 GiB tensor read by
torch on every core, best of 3), each peer's decode tok/s x file bytes against it, and kvgen's RSS
against the issue's bound (1.2x the file + the KV pool). A kvgen round that cannot load a file
(memory) is written as failed, not fatal.

The family files (bench/make_shaped_model.py's FAMILY_SHAPES: each family at its real model's
widths, ~0.4-1.2B parameters, SmolLM2's vocabulary, random weights, Q4_K_M by llama-quantize), where
setup_models.sh made them, get the same rounds and a section of their own ("Families"), with the
decode path kvgen's engine took for each (fused, Model.forward, or mamba2's state-space torch steps, and
why). `--models families` (`make bench-models MODELS=families`) runs those rows only and rewrites only that
section; `--family NAME` (repeatable) runs only the named families' rows and prints them without writing
models.md (a check of one file: `BENCH_ROUNDS=1 python bench/models.py --models families --family mamba2`).
A family file that either peer cannot load is written as failed, with llama.cpp's own reason (llama-bench
-v's "error loading model" line), and the other families still run.

Other processes on the cores slow both peers' rounds: the load average is printed and written.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CACHE = BENCH / ".cache"
TOOLS = CACHE / "llama-tools" / "bin"
MODELS = CACHE / "models"
OUT = BENCH / "results" / "models.md"
# Q4_1: the embedded file itself; the low-bit ones last (Q3_K_M, Q2_K, IQ4_XS, IQ4_NL: kinds q3h, q2hm, q4i)
TYPES = ("Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")
# The large files (bench/make_shaped_model.py's random weights in a real model's shape), where
# present: decode reads the whole file a token, so they measure bandwidth, not arithmetic
SHAPED = (("1.7B Q4_0", "shaped-1.7b.Q4_0.gguf"), ("1.7B Q4_K_M", "shaped-1.7b.Q4_K_M.gguf"),
          ("1.7B Q3_K_M", "shaped-1.7b.Q3_K_M.gguf"), ("1.7B Q2_K", "shaped-1.7b.Q2_K.gguf"),
          ("1.7B IQ4_XS", "shaped-1.7b.IQ4_XS.gguf"),
          ("8B Q4_K_M", "shaped-8b.Q4_K_M.gguf"))
# One file per family (bench/make_shaped_model.py FAMILY_SHAPES), where present
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mamba2")
# a layer's linears: an attention family's four (fused as model.py fuses them), a Mamba-2's two
LINEARS = ("qkv", "o", "gate_up", "down", "in_proj", "out_proj")
FAMILIES_HEADER = "## Families at a 1B-ish shape"
ONE_ROUND_FROM = 2 * 2**30  # files this large get one round a peer (a kvgen round of the 8B file is minutes)
BANDWIDTH_BYTES = 2 * 2**30
PREFILL, NEW_TOKENS = 512, 128
DECODE_PROMPT = "The capital of France is"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def status_kb(*keys: str) -> dict:
    """Fields of /proc/self/status in MiB (VmRSS, VmHWM)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) / 1024
    return out


# ---------------------------------------------------------------- kvgen, in its own process


def kvgen_round(path: str) -> dict:
    import torch

    from kvgen.cpu.weight_blocks import BlockLinear
    from kvgen.engine.generator import Generator, kernel_path, load_model
    from kvgen.engine.options import EngineOptions
    from kvgen.engine.sampling import SamplingParams

    sys.path.insert(0, str(ROOT))
    from bench.peers import PROMPT_TEXT  # noqa: E402  (peers sets torch's threads to the cores too)

    mem = {"imports": status_kb("VmRSS")["VmRSS"]}
    opts = EngineOptions()  # the defaults `make serve` runs with (WEIGHT_DTYPE=auto ...)
    torch.set_num_threads(opts.threads or cores())  # as Generator.load
    t = time.perf_counter()
    model, tokenizer = load_model(path, opts.weight_dtype, opts.device)
    mem["model"] = status_kb("VmRSS")["VmRSS"]
    gen = Generator(model, tokenizer, opts, path)
    load_s = time.perf_counter() - t
    mem["ready"] = status_kb("VmRSS")["VmRSS"]
    mem["load_peak"] = status_kb("VmHWM")["VmHWM"]  # the most it held while loading, before any request
    mem["kv_pool"] = sum(t.nbytes for t in gen.pool.store.values() if isinstance(t, torch.Tensor)) / 2**20

    lins = [getattr(layer, f) for layer in model.layers for f in LINEARS if hasattr(layer, f)]

    def kind(lin) -> str:  # a fused weight with parts of different kinds (PartsLinear): their kinds
        if isinstance(lin, BlockLinear):
            return lin.kind
        parts = getattr(lin, "parts", None)
        return "+".join(kind(p) for p in parts) if parts else str(lin.dtype)

    kinds = collections.Counter(kind(lin) for lin in lins)
    head = kind(model.lm_head)
    runner = gen.engine.runner

    def greedy(n):
        return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)

    ids = tokenizer.encode(" ".join([PROMPT_TEXT] * 4), add_bos=False)
    prompt, warm = ids[:PREFILL], ids[200:200 + PREFILL]  # different first blocks: no prefix-cache hit
    assert len(prompt) == PREFILL and len(warm) == PREFILL
    short = tokenizer.encode(DECODE_PROMPT, add_bos=False)
    gen.generate(warm, greedy(1))
    fused_steps = [0]
    if runner.fused is not None:  # count the warm-up decode's fused steps (not in the timed runs)
        step = runner._fused_step
        runner._fused_step = lambda wanted: (fused_steps.__setitem__(0, fused_steps[0] + 1), step(wanted))[1]
    gen.generate(short, greedy(8))
    runner.__dict__.pop("_fused_step", None)
    t1 = gen.generate(prompt, greedy(1)).timings
    t2 = gen.generate(short, greedy(NEW_TOKENS)).timings
    mem["end"] = status_kb("VmRSS")["VmRSS"]
    mem["peak"] = status_kb("VmHWM")["VmHWM"]
    gen.close()
    return {
        "prefill_tps": PREFILL / (t1["time_to_first_token_ms"] / 1e3),
        "decode_tps": (NEW_TOKENS - 1) / ((t2["total_ms"] - t2["time_to_first_token_ms"]) / 1e3),
        "weight_dtype": model.weight_dtype,
        "kinds": dict(kinds),
        "lm_head": head,
        "fused": runner.fused is not None,
        "fused_steps": fused_steps[0],
        "kernels": kernel_path(model),
        "decode_path": runner.decode_path,
        "decode_path_reason": runner.decode_path_reason,
        "load_s": load_s,
        "rss_mib": mem,
        "threads": torch.get_num_threads(),
    }


def read_bandwidth() -> float:
    """GB/s of a plain read of a 2 GiB float32 tensor (torch's sum on all cores, best of 5): what a
    decode step that reads every weight once can reach at most."""
    import torch

    torch.set_num_threads(cores())
    t = torch.ones(BANDWIDTH_BYTES // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return BANDWIDTH_BYTES / best / 1e9


def run_bandwidth(_path: str = "") -> dict:
    p = subprocess.run([sys.executable, __file__, "--bandwidth"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, check=True)
    return {"gb_s": float(p.stdout.split()[-1])}


def run_kvgen(path: str) -> dict:
    p = subprocess.run([sys.executable, __file__, "--kvgen", path], capture_output=True, text=True, timeout=3600,
                       cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"kvgen on {path} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- llama-bench


def run_llama_bench(path: str) -> dict:
    cmd = [str(TOOLS / "llama-bench"), "-m", path, "-p", str(PREFILL), "-n", str(NEW_TOKENS), "-t", str(cores()),
           "-r", "1", "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        why = ""
        if "failed to load model" in p.stderr:  # llama-bench mutes llama.cpp's log: its -v says why, as the last line
            v = subprocess.run([*cmd, "-v"], capture_output=True, text=True, timeout=900).stderr.splitlines()
            why = "".join(f"\n{line}" for line in v if "error loading model" in line)
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}{why}")
    tests = json.loads(p.stdout)
    out = {"info": {k: tests[0].get(k) for k in ("build_commit", "cpu_info", "backends", "model_type", "model_size",
                                                  "n_batch", "n_ubatch", "flash_attn", "type_k")}}
    for t in tests:
        key = "pp_tps" if t["n_gen"] == 0 else "tg_tps"
        out[key] = t["avg_ts"]
    return out


# ---------------------------------------------------------------- the others on the machine


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v) - idle, sum(v)


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the peers' runs)."""
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def wait_quiet(budget: list[float], limit: float = 45.0, busy_max: float = 0.15) -> float:
    """Wait (at most `limit` s, and while budget[0] s of waiting are left) for a second in which the
    CPUs are at most busy_max busy (nothing of ours runs now, so that is the others' load);
    returns the last second's busy fraction."""
    t0 = time.time()
    while True:
        b0, a0 = cpu_jiffies()
        time.sleep(1.0)
        b1, a1 = cpu_jiffies()
        busy = (b1 - b0) / max(a1 - a0, 1)
        waited = time.time() - t0
        if busy <= busy_max or waited >= limit or waited >= budget[0]:
            budget[0] -= waited
            return busy


def measured(fn, path: str, budget: list[float]) -> dict:
    """fn(path), after wait_quiet, with `others`: the share of the CPUs' time during the run
    that was not ours (other processes on the machine), and `before`: the busy fraction of the
    second before."""
    before = wait_quiet(budget)
    hz = os.sysconf("SC_CLK_TCK")
    (b0, a0), c0, t0 = cpu_jiffies(), own_cpu_s(), time.time()
    res = fn(path)
    (b1, a1), c1 = cpu_jiffies(), own_cpu_s()
    res["others"] = max(0.0, ((b1 - b0) / hz - (c1 - c0)) / max((a1 - a0) / hz, 1e-9))
    res["wall_s"] = time.time() - t0
    res["before"] = before
    return res


# ---------------------------------------------------------------- the table


def cpu_summary() -> tuple[str, str]:
    """(lscpu's model name, the vector extensions the kernels care about)."""
    name = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    avx512 = sorted(f.removeprefix("avx512").lstrip("_") for f in flags if f.startswith("avx512"))
    vnni = [f for f in ("avx512_vnni", "avx_vnni") if f in flags]
    amx = [f for f in ("amx_tile", "amx_int8", "amx_bf16") if f in flags]
    summary = (f"AVX2 {'yes' if 'avx2' in flags else 'no'} · "
               f"AVX-512 {('yes (' + ' '.join(avx512) + ')') if avx512 else 'no'} · "
               f"VNNI {('yes (' + ', '.join(vnni) + ')') if vnni else 'no'} · "
               f"AMX {('yes (' + ', '.join(amx) + ')') if amx else 'no'}")
    return name, summary


def tensor_types(path: str) -> str:
    """The quant types of a file's 2-D tensors (the weights), most common first."""
    from gguf import GGUFReader

    types = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{k} {v}" for k, v in types.most_common())


def family_files(only: list[str] | None = None) -> list[tuple[str, str]]:
    return [(f, str(MODELS / f"family-{f}.Q4_K_M.gguf")) for f in FAMILIES
            if (MODELS / f"family-{f}.Q4_K_M.gguf").exists() and (not only or f in only)]


def files(models: str = "all", only: list[str] | None = None) -> list[tuple[str, str]]:
    from kvgen.engine.model_files import embedded_model_path

    if models == "families":
        if not family_files(only):
            names = f"family-{{{','.join(only)}}}" if only else "family-*"
            raise SystemExit(f"no {names}.Q4_K_M.gguf in {MODELS}: run MODELS=families bash bench/setup_models.sh")
        return family_files(only)
    out = []
    if only:  # some rows of the main table, by name (--only)
        known = {ty: None for ty in TYPES} | dict(SHAPED)
        return [(ty, embedded_model_path() if ty == "Q4_1" else str(MODELS / (known[ty] or
                                                                        f"SmolLM2-135M-Instruct.{ty}.gguf")))
                for ty in only]
    for ty in TYPES:
        path = embedded_model_path() if ty == "Q4_1" else str(MODELS / f"SmolLM2-135M-Instruct.{ty}.gguf")
        if not os.path.exists(path):
            raise SystemExit(f"{path} missing: run bash bench/setup_models.sh")
        out.append((ty, path))
    out += [(name, str(MODELS / f)) for name, f in SHAPED if (MODELS / f).exists()]
    return out + family_files()


CLEAN = 0.10  # a round is clean when other processes took at most this share of the CPUs


def ran(runs: list[dict]) -> list[dict]:
    """The rounds that ran (a kvgen round that could not load the file has an error instead)."""
    return [x for x in runs if "error" not in x]


def clean(runs: list[dict]) -> list[dict]:
    """The clean runs, or all of them when none is."""
    return [x for x in runs if x["others"] <= CLEAN] or runs


def git_commit() -> str:
    """HEAD's short hash, with '+changes' when kvgen/ differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvgen"], capture_output=True, text=True,
                               cwd=ROOT).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(models: str = "all", only: list[str] | None = None) -> None:
    """only: the families to run (models families); their rows are printed, models.md left as it is."""
    if not os.access(TOOLS / "llama-bench", os.X_OK):
        raise SystemExit(f"{TOOLS / 'llama-bench'} missing: run bash bench/setup_models.sh")
    rounds = int(os.environ.get("BENCH_ROUNDS", "3"))
    t0, load0 = time.time(), os.getloadavg()
    name, flags = cpu_summary()
    print(f"{name} · {flags} · {cores()} cores · loadavg {load0}", flush=True)
    budget = [float(os.environ.get("BENCH_QUIET_BUDGET", "600"))]  # seconds of waiting for quiet, in all
    commit = git_commit()
    results = []
    for ty, path in files(models, only):
        kv, lb = [], []
        n = 1 if os.path.getsize(path) >= ONE_ROUND_FROM else rounds
        # rounds until each peer has `n` clean ones (others <= CLEAN) or ran 2 * n times
        for r in range(2 * n):
            order = (run_llama_bench, run_kvgen) if r % 2 == 0 else (run_kvgen, run_llama_bench)
            for fn in order:
                got = lb if fn is run_llama_bench else kv
                if len(clean(got)) < n and len(got) < 2 * n and not any("error" in x for x in got):
                    try:
                        got.append(measured(fn, path, budget))
                    except (RuntimeError, subprocess.TimeoutExpired) as e:  # the peer could not load or run it
                        if fn is run_llama_bench and ty not in FAMILIES:  # llama.cpp's own llama files: a
                            raise  # failure there is a broken setup, not a result
                        got.append({"error": str(e).strip().splitlines()[-1], "others": 0.0})
                        print(f"{ty} {'llama-bench' if fn is run_llama_bench else 'kvgen'} failed: "
                              f"{got[-1]['error']}", flush=True)
                        continue
                    x = got[-1]
                    what = (f"pp {x['pp_tps']:.1f} tg {x['tg_tps']:.1f}" if fn is run_llama_bench
                            else f"prefill {x['prefill_tps']:.1f} decode {x['decode_tps']:.1f}")
                    print(f"{ty} round {r + 1} {'llama-bench' if fn is run_llama_bench else 'kvgen'}: {what} "
                          f"(others {x['others']:.0%}, {x['wall_s']:.1f} s) · quiet-wait left {budget[0]:.0f} s",
                          flush=True)
        results.append((ty, path, lb, kv))
        print(json.dumps({"file": ty, "llama_bench": lb, "kvgen": kv}), flush=True)
    bandwidth = [measured(run_bandwidth, "", budget) for _ in range(3)] if any(
        ty in dict(SHAPED) for ty, *_ in results) else []
    now = git_commit()
    if now != commit:
        commit = f"{commit}, then {now} (the tree changed during the run)"
    if models == "families":
        write_families(results, rounds, name, flags, load0, time.time() - t0, commit, write=not only)
    elif only:  # printed above, models.md left as it is
        return
    else:
        write([r for r in results if r[0] not in FAMILIES], rounds, name, flags, load0, time.time() - t0, commit,
              bandwidth)
        if any(r[0] in FAMILIES for r in results):
            write_families([r for r in results if r[0] in FAMILIES], rounds, name, flags, load0, time.time() - t0,
                           commit)


def large_rows(results, bandwidth) -> list[str]:
    """The bandwidth-bound files: bytes read a token against the machine's read bandwidth, and
    memory against the issue's bound (RSS <= 1.2x the file + the KV pool)."""
    gb_s = statistics.median(x["gb_s"] for x in clean(bandwidth))  # (one round read 54 GB/s, the others 31)
    each = " / ".join(f"{x['gb_s']:.1f}" for x in bandwidth)
    lines = [
        "\n## The large files: bandwidth and memory\n",
        f"Read bandwidth: a plain read of a {BANDWIDTH_BYTES // 2**30} GiB float32 tensor on {cores()} threads "
        f"(torch sum), the median of {len(bandwidth)}: **{gb_s:.1f} GB/s** (rounds: {each}). "
        "A decode step at batch 1 reads every weight once, so tok/s x file bytes is the bandwidth it "
        "draws (the embedding table's one row a token aside). Memory: kvgen's VmRSS ready to serve, less the "
        "interpreter with its imports, and the most it held while loading (VmHWM when ready, before any request), "
        "less the same, against 1.2x the file plus the KV pool (the issue's bound).\n",
        "| file | GB | llama-bench tg128 | llama GB/s | kvgen decode | kvgen GB/s | kvgen % of read bandwidth | "
        "decode kvgen/llama | RSS ready - imports MiB | load peak - imports MiB | KV pool MiB | "
        "bound 1.2 file + pool MiB | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ty, path, lb, kv in results:
        if ty not in dict(SHAPED):
            continue
        gb = os.path.getsize(path) / 1e9
        tg = max(x["tg_tps"] for x in clean(lb))
        ok = ran(kv)
        if not ok:
            lines.append(f"| {ty} | {gb:.2f} | {tg:.1f} | {tg * gb:.1f} | failed: {kv[-1]['error'][:80]} "
                         "| | | | | | | |")
            continue
        dc = max(x["decode_tps"] for x in clean(ok))
        m = ok[0]["rss_mib"]
        used, bound = m["ready"] - m["imports"], 1.2 * os.path.getsize(path) / 2**20 + m["kv_pool"]
        peak = m.get("load_peak", float("nan")) - m["imports"]
        lines.append(f"| {ty} | {gb:.2f} | {tg:.1f} | {tg * gb:.1f} | {dc:.1f} | {dc * gb:.1f} | "
                     f"{dc * gb / gb_s:.0%} | {dc / tg:.2f}x | {used:.0f} | {peak:.0f} | {m['kv_pool']:.0f} | "
                     f"{bound:.0f} | {'yes' if used <= bound and peak <= bound else 'no'} |")
    return lines


def family_shape(family: str) -> str:
    sys.path.insert(0, str(ROOT))
    from bench.make_shaped_model import FAMILY_SHAPES

    real, layers, shape = FAMILY_SHAPES[family]
    if "state_size" in shape:  # mamba2: no FFN; its scan's heads and state instead
        width = (f"inner {shape['expand'] * shape['hidden_size']} ({shape['num_heads']} heads of {shape['head_dim']}), "
                 f"state {shape['state_size']}")
    else:
        width = f"ffn {shape['intermediate_size']}"
    return f"{real}: hidden {shape['hidden_size']}, {width}, {shape['num_hidden_layers']}/{layers} layers"


def params_b(path: str) -> float:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(path).tensors) / 1e9


def write_families(results, rounds, cpu, flags, load0, secs, commit, write: bool = True) -> None:
    """The Families section of models.md, replacing the one there (the other sections kept); write False:
    printed only (--family: some families' rows, not the section)."""
    lines = [
        FAMILIES_HEADER + "\n",
        f"{datetime.date.today()} · **{cpu}** · {cores()} cores · {flags} · kvgen at {commit}, `make serve`'s "
        f"defaults · load average (1 min) at the start {load0[0]:.2f}, at the end {os.getloadavg()[0]:.2f} · "
        f"{secs / 60:.1f} min · best of {rounds} round(s) per peer (clean ones first: see the others columns).\n",
        "`make bench-models MODELS=families`: each family at its real model's widths (heads, KV heads, head dim, "
        "its own features), layers reduced where the real model is past ~1B, over SmolLM2's vocabulary (49152 "
        "tokens, not the real ones'), random weights (bench/make_shaped_model.py FAMILY_SHAPES), converted to "
        "BF16 by convert_hf_to_gguf.py and quantized to Q4_K_M by llama-quantize (bench/setup_models.sh). "
        "Decode path: the code kvgen's engine runs a decode step with (GetModelInfo.decode_path): fused "
        "(kvgen/engine/fused_decode.py) or torch (Model.forward; mamba2: its state-space forward, "
        "kvgen/engine/model_mamba2.py), and why.\n",
        "| family | shape | params B | MiB | tensor types (2-D) | llama-bench pp512 tok/s | kvgen prefill tok/s | "
        "prefill kvgen/llama | llama-bench tg128 tok/s | kvgen decode tok/s | decode kvgen/llama | decode path | "
        "others (llama / kvgen) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fam, path, lb, kv in results:
        head = (f"| {fam} | {family_shape(fam)} | {params_b(path):.2f} | {os.path.getsize(path) / 2**20:.0f} | "
                f"{tensor_types(path)} | ")
        llama, ok = clean(ran(lb)), clean(ran(kv))  # either peer may have failed to load the file
        others = " / ".join(f"{max(x['others'] for x in runs):.0%}" if runs else "-" for runs in (llama, ok))
        if llama:
            pp, tg = max(x["pp_tps"] for x in llama), max(x["tg_tps"] for x in llama)
            pp_s, tg_s = f"{pp:.0f}", f"{tg:.1f}"
        else:
            pp_s, tg_s = f"llama-bench failed: {lb[-1]['error'][:120]}", ""
        if not ok:
            lines.append(head + f"{pp_s} | kvgen failed: {kv[-1]['error'][:80]} | | {tg_s} | | | | {others} |")
            continue
        pf, dc = max(x["prefill_tps"] for x in ok), max(x["decode_tps"] for x in ok)
        why = ok[0].get("decode_path_reason") or ""
        path_s = ok[0].get("decode_path", "?") + (f" ({why})" if why else "")
        pf_vs, dc_vs = (f"{pf / pp:.2f}x", f"{dc / tg:.2f}x") if llama else ("", "")
        lines.append(head + f"{pp_s} | {pf:.0f} | {pf_vs} | {tg_s} | {dc:.1f} | {dc_vs} | {path_s} | {others} |")
    section = "\n".join(lines) + "\n"
    if not write:
        print(section, flush=True)
        return
    text = OUT.read_text() if OUT.exists() else "# kvgen and llama-bench on the same GGUF files\n"
    if FAMILIES_HEADER in text:  # the section runs to the next top-level section, or the end
        before, _, after = text.partition(FAMILIES_HEADER)
        rest = after.split("\n## ", 1)
        text = before.rstrip("\n") + "\n\n" + ("## " + rest[1] if len(rest) > 1 else "")
    OUT.write_text(text.rstrip("\n") + "\n\n" + section)
    print(section, flush=True)


def write(results, rounds, cpu, flags, load0, secs, commit, bandwidth) -> None:
    info = results[0][2][0]["info"]
    lines = [
        "# kvgen and llama-bench on the same GGUF files\n",
        f"{datetime.date.today()} · **{cpu}** · {cores()} cores · {flags}\n",
        f"`make bench-models` (bench/models.py, files from bench/setup_models.sh). llama-bench "
        f"{'' if info['build_commit'] in (None, 'unknown') else info['build_commit'] + ' '}built from the "
        f"llama.cpp in the llama-cpp-python {os.environ.get('LLAMACPP_VERSION', '0.3.36')} sdist (-march=native, "
        f"AMX off, OpenMP), backends "
        f"{info['backends']}, n_batch {info['n_batch']}, n_ubatch {info['n_ubatch']}, flash_attn "
        f"{info['flash_attn']}, KV {info['type_k']}. kvgen at {commit} with `make serve`'s defaults "
        f"(WEIGHT_DTYPE=auto), torch threads = {cores()}, llama-bench -t {cores()}.\n",
        f"Load average (1 min) at the start {load0[0]:.2f}, at the end {os.getloadavg()[0]:.2f}; the bench took "
        f"{secs / 60:.1f} min. Best of {rounds} interleaved rounds per peer and file, counting only clean rounds "
        f"(other processes took <= {CLEAN:.0%} of the CPUs; a contended round is rerun, up to {2 * rounds} runs): "
        "see Every round.\n",
        "The files: the embedded SmolLM2-135M-Instruct Q4_1 GGUF, and the same weights re-encoded offline "
        "(transformers -> HF folder -> convert_hf_to_gguf.py --outtype f16 -> llama-quantize). SmolLM2-135M's "
        "hidden size 576 is not a multiple of 256, so llama-quantize gives the K-quant files' attention and "
        "gate/up tensors a fallback type: the tensor types column says what each file really holds.\n",
        f"## Speed: prefill of a {PREFILL}-token prompt, decode of {NEW_TOKENS} tokens, batch 1\n",
        "| file | MiB | llama-bench pp512 tok/s | kvgen prefill tok/s | prefill kvgen/llama | "
        "llama-bench tg128 tok/s | kvgen decode tok/s | decode kvgen/llama |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ty, path, lb, kv in results:
        lb, kv = clean(lb), clean(ran(kv))
        pp, tg = max(x["pp_tps"] for x in lb), max(x["tg_tps"] for x in lb)
        if not kv:
            lines.append(f"| {ty} | {os.path.getsize(path) / 2**20:.1f} | {pp:.0f} | kvgen failed | | {tg:.1f} | | |")
            continue
        pf, dc = max(x["prefill_tps"] for x in kv), max(x["decode_tps"] for x in kv)
        lines.append(f"| {ty} | {os.path.getsize(path) / 2**20:.1f} | {pp:.0f} | {pf:.0f} | {pf / pp:.2f}x | "
                     f"{tg:.1f} | {dc:.1f} | {dc / tg:.2f}x |")
    lines += [
        "\n## What kvgen ran, and its memory\n",
        "Linears: every layer's qkv, o, gate_up and down (kvgen's block kinds: q4 = Q4_0/Q4_1/Q4_K nibbles, "
        "q8 = Q8_0/IQ4 int8 codes, q5 = Q5_0, q5m = Q5_1/Q5_K, q6h = Q6_K packed codes, q8h = Q3_K, "
        "q8hm = Q2_K; a+b: a fused weight whose parts "
        "differ in kind). Fused: whether the engine's model runner has kvgen/engine/fused_decode.py's decode "
        "step (FusedDecode.supports the model), and its steps in an 8-token warm-up decode; otherwise decode "
        "runs Model.forward. RSS: VmRSS after "
        "load_model (weights and tokenizer), after the Generator is built (KV pool, ready to serve), "
        "and VmHWM at the end; the interpreter with torch and kvgen imported is about "
        f"{results[0][3][0]['rss_mib']['imports']:.0f} MiB of it.\n",
        "| file | tensor types in the file (2-D) | kvgen weights | linears' kinds | lm_head | kernels | fused "
        "(steps /8) | load s | RSS model MiB | RSS ready MiB | peak MiB | (RSS model - imports) / file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ty, path, _lb, kv in results:
        kv = ran(kv)
        if not kv:
            continue
        k = kv[0]
        m = k["rss_mib"]
        size = os.path.getsize(path) / 2**20
        kinds = ", ".join(f"{a} {b}" for a, b in sorted(k["kinds"].items(), key=lambda x: -x[1]))
        lines.append(f"| {ty} | {tensor_types(path)} | {k['weight_dtype']} | {kinds} | {k['lm_head']} | "
                     f"{k['kernels'] or '-'} | {'yes' if k['fused'] else 'no'} ({k['fused_steps']}) | "
                     f"{min(x['load_s'] for x in kv):.1f} | {m['model']:.0f} | {m['ready']:.0f} | "
                     f"{max(x['rss_mib']['peak'] for x in kv):.0f} | {(m['model'] - m['imports']) / size:.2f} |")
    if bandwidth:
        lines += large_rows(results, bandwidth)
    lines += ["\n## Every round\n",
              "tok/s per round in run order; others: the share of the CPUs' time during that peer's runs that other "
              "processes on the machine took (from /proc/stat less this bench's own CPU time; before each run the "
              "bench waits up to 45 s for a quiet second).\n",
              "| file | llama-bench pp512 | kvgen prefill | llama-bench tg128 | kvgen decode | others during "
              "llama-bench | others during kvgen |", "|---|---|---|---|---|---|---|"]
    for ty, _, lb, kv in results:
        kv = ran(kv)
        cols = [[f"{x['pp_tps']:.0f}" for x in lb], [f"{x['prefill_tps']:.0f}" for x in kv],
                [f"{x['tg_tps']:.1f}" for x in lb], [f"{x['decode_tps']:.1f}" for x in kv],
                [f"{x['others']:.0%}" for x in lb], [f"{x['others']:.0%}" for x in kv]]
        lines.append(f"| {ty} | " + " | ".join(" / ".join(c) for c in cols) + " |")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text(), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvgen", metavar="FILE", help="one kvgen round on FILE; prints JSON (internal)")
    ap.add_argument("--bandwidth", action="store_true", help="the read bandwidth in GB/s (internal)")
    ap.add_argument("--models", choices=("all", "families"), default=os.environ.get("MODELS") or "all",
                    help="all files (default), or the family files only (MODELS=families)")
    ap.add_argument("--family", action="append", choices=FAMILIES, metavar="NAME",
                    help="with --models families: only this family's row (repeatable), printed, models.md left as "
                         f"it is (one of {', '.join(FAMILIES)}; BENCH_ROUNDS=1 for one round a peer)")
    ap.add_argument("--only", action="append", metavar="ROW",
                    help="only this row of the main table (repeatable: " + ", ".join([*TYPES, *dict(SHAPED)])
                    + "), printed, models.md left as it is")
    args = ap.parse_args()
    if args.family and args.models != "families":
        ap.error("--family takes --models families")
    if args.only and (args.models != "all" or set(args.only) - {*TYPES, *dict(SHAPED)}):
        ap.error("--only takes rows of the main table")
    if args.bandwidth:
        print(f"{read_bandwidth():.3f}", flush=True)
    elif args.kvgen:
        print(json.dumps(kvgen_round(args.kvgen)), flush=True)
    else:
        main(args.models, args.family or args.only)
