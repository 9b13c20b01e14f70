"""`make bench`: kvgen on the CPU next to transformers and llama.cpp, same GGUF, same run.

Writes bench/results/cpu.md. Every comparison is a ratio between runs on this machine
in this process, so the table means something on any machine.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peers  # noqa: E402
from kvgen.cpu.threads import in_fresh_thread  # noqa: E402
from kvgen.engine.generator import EngineOptions, Generator, load_model  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "cpu.md"
# gguf: the file's own Q4_1 / Q8_0 blocks, what the default WEIGHT_DTYPE=auto picks on a CPU
WEIGHT_DTYPES = ("fp32", "gguf", "bf16", "int8", "int4")
STREAMS = (1, 4, 16, 32)
PROMPTS = ["The capital of France is", "def quicksort(items):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "Here is a recipe for bread:", "In 1492, Columbus"]


def greedy(n, ignore_eos=True):
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=ignore_eos)


def prefill_decode(gen: Generator, prompt: list[int], new_tokens=128, repeats=3) -> dict:
    gen.generate(prompt[:32], greedy(4))  # warm-up
    prefill = max(len(prompt) / (gen.generate(prompt, greedy(1)).timings["time_to_first_token_ms"] / 1e3)
                  for _ in range(repeats))
    decode = 0.0
    for _ in range(repeats):
        t = gen.generate(PROMPTS[0], greedy(new_tokens)).timings
        decode = max(decode, (new_tokens - 1) / ((t["total_ms"] - t["time_to_first_token_ms"]) / 1e3))
    return {"prefill_tps": prefill, "decode_tps": decode}


def fidelity_prompts() -> list[list[int]]:
    """8 prompts as token ids (the same ids for every engine): PROMPTS and two chat turns."""
    tok = peers._tokenizer()
    texts = PROMPTS + ["Explain photosynthesis in one sentence.", "Write a haiku about the sea."]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:8]]


def greedy_ids(gen: Generator, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    return [gen.generate(p, greedy(n)).token_ids for p in prompts]


def agreement(ref: list[list[int]], other: list[list[int]] | None) -> float | None:
    """Mean length of the prefix each continuation shares with the reference's."""
    if not other:
        return None
    same = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
            for x, y in zip(ref, other, strict=True)]
    return statistics.mean(same)


def answers(gen: Generator) -> list:
    """Greedy 64-token answers to PROMPTS, with the top-5 logprobs of each token."""
    return [gen.generate(p, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True, logprobs=5))
            for p in PROMPTS]


def distance(ref: list, other: list) -> dict:
    """Max |logprob diff| on the first generated token and greedy agreement over 64 tokens."""
    err, agree = 0.0, []
    for a, b in zip(ref, other, strict=True):
        la = dict(a.logprobs[0].top)
        lb = dict(b.logprobs[0].top)
        err = max(err, max(abs(la[t] - lb[t]) for t in la if t in lb))
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), 64)
        agree.append(n)
    return {"logprob_err": err, "agree": statistics.mean(agree)}


def concurrent(gen: Generator, streams: int, new_tokens=64) -> dict:
    """Aggregate tokens/s of `streams` concurrent greedy streams and their inter-token latency."""
    gaps: list[float] = []
    lock = threading.Lock()

    def run(i):
        last, mine = None, []
        for ev in gen.generate_stream(f"{PROMPTS[i % len(PROMPTS)]} (story {i})", greedy(new_tokens)):
            now = time.perf_counter()
            if last is not None and ev.token_ids:
                mine.append(now - last)
            last = now
        with lock:
            gaps.extend(mine)

    gen.generate(PROMPTS[0], greedy(4))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps.sort()
    return {"tps": streams * new_tokens / wall, "p50": gaps[len(gaps) // 2] * 1e3,
            "p99": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3}


def main() -> None:
    cores = peers.cores()
    load0 = os.getloadavg()[0]
    torch.set_num_threads(cores)
    prompt = peers.prompt_ids(512)
    fid = fidelity_prompts()
    auto = in_fresh_thread(auto_choice)  # loading on this thread leaves a torch pool here (threads.py)
    lines = ["# CPU benchmark\n",
             f"{datetime.date.today()} · {peers.cpu_name()} · {cores} cores · "
             f"torch {torch.__version__} · model SmolLM2-135M-Instruct Q4_1 GGUF\n",
             f"CPU flags: {' '.join(peers.cpu_flags()) or 'unknown'}\n",
             f"The default `WEIGHT_DTYPE=auto` chose **{auto}** on this machine.\n",
             "## Single stream: prefill of a 512-token prompt, decode of 128 tokens at batch 1; fidelity\n",
             "Fidelity: mean greedy prefix (of 24 tokens) agreeing with transformers fp32 on the same GGUF, "
             "over 8 prompts.\n",
             "| engine | weights | prefill tok/s | decode tok/s | prefill / llama.cpp | decode / llama.cpp | "
             "greedy agree /24 |",
             "|---|---|---|---|---|---|---|"]
    rows = []
    oracle = in_fresh_thread(peers.transformers_greedy, fid, 24)
    llama = peers.llamacpp_prefill_decode(prompt, 128, greedy=fid, greedy_tokens=24)
    if llama:
        rows.append(("llama.cpp (llama-cpp-python)", "Q4_1 GGUF", llama, agreement(oracle, llama.get("greedy"))))
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        # in a thread that exits: a worker pool left on the main thread slows the engine's (threads.py)
        rows.append(("transformers", name, in_fresh_thread(peers.transformers_prefill_decode, dtype, prompt, 128),
                     None))
    # One Generator at a time: an idle engine thread keeps its OpenMP pool, and a second pool
    # slows the busy one (kvgen/cpu/threads.py); close() ends the thread and its pool.
    said, streams = {}, {}
    for wd in WEIGHT_DTYPES:
        # no prefix cache: prefill_decode repeats one prompt, which would then cost a lookup, not a prefill
        g = Generator(*load_model(peers.model_path(), wd), EngineOptions(weight_dtype=wd, prefix_cache=False))
        rows.append(("kvgen", wd + (" (auto)" if wd == auto else ""), prefill_decode(g, prompt),
                     agreement(oracle, greedy_ids(g, fid))))
        said[wd] = answers(g)
        if wd in ("fp32", fast_dtype()):
            streams[wd] = {n: concurrent(g, n) for n in STREAMS}
        g.close()
    record = {"date": str(datetime.date.today()), "cpu": peers.cpu_name(), "flags": peers.cpu_flags(),
              "cores": cores, "torch": torch.__version__, "auto": auto, "single_stream": [], "streams": {}}
    for engine, weights, r, agree in rows:
        rel = (f"{r['prefill_tps'] / llama['prefill_tps']:.2f}x", f"{r['decode_tps'] / llama['decode_tps']:.2f}x") \
            if llama else ("n/a", "n/a")
        agree_s = "-" if agree is None else f"{agree:.1f}"
        lines.append(f"| {engine} | {weights} | {r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | {rel[0]} | {rel[1]} | "
                     f"{agree_s} |")
        record["single_stream"].append({"engine": engine, "weights": weights, "prefill_tps": r["prefill_tps"],
                                        "decode_tps": r["decode_tps"], "greedy_agree_of_24": agree})
    if not llama:
        lines.append("\nllama.cpp: not built on this machine (run `bash bench/setup_llamacpp.sh`).")
    lines += ["", "Goals (issue 19): the default decodes >= 1.2x llama.cpp at batch 1 with fidelity >= llama.cpp's, "
              "and prefills >= 4x llama.cpp.", "",
              "### Distance of each weight setting from fp32 (6 prompts, greedy, 64 tokens)\n",
              "| weights | max abs logprob diff (first token, top 5) | mean agreeing prefix (of 64) |",
              "|---|---|---|"]
    for wd in WEIGHT_DTYPES[1:]:
        d = distance(said["fp32"], said[wd])
        lines.append(f"| {wd} | {d['logprob_err']:.4f} | {d['agree']:.1f} |")
    lines += ["", "## Concurrent streams: aggregate decode tokens/s, 64 tokens per stream\n",
              "| streams | kvgen fp32 tok/s | x of 1 stream | p50 ITL ms | p99 ITL ms | kvgen "
              f"{fast_dtype()} tok/s | x of 1 | p50 ITL ms | p99 ITL ms | transformers fp32 batched tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for n in STREAMS:
        a, b = streams["fp32"][n], streams[fast_dtype()][n]
        base.setdefault("a", a["tps"])
        base.setdefault("b", b["tps"])
        hf = in_fresh_thread(peers.transformers_batched_decode, torch.float32, n, 64)
        lines.append(f"| {n} | {a['tps']:.1f} | {a['tps'] / base['a']:.1f}x | {a['p50']:.1f} | {a['p99']:.1f} | "
                     f"{b['tps']:.1f} | {b['tps'] / base['b']:.1f}x | {b['p50']:.1f} | {b['p99']:.1f} | {hf:.1f} |")
        record["streams"][n] = {"fp32": a, fast_dtype(): b, "transformers_fp32": hf}
    lines += ["", "Goal: 16 concurrent streams give at least 5x the tokens/s of one stream."]
    tracing = Path(__file__).resolve().parent / "tracing.py"
    if tracing.exists() and not os.environ.get("BENCH_SKIP_TRACING"):
        out = subprocess.run([sys.executable, str(tracing)], capture_output=True, text=True, timeout=900)
        lines += ["", "## Tracing overhead (issue 6)\n", out.stdout.strip() or out.stderr.strip()[-2000:]]
    lines.insert(2, f"Load average (1 min) at the start {load0:.2f}, at the end {os.getloadavg()[0]:.2f} (the "
                    "bench's own load): a start above ~0.5 means something else shared the cores.\n")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    OUT.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(OUT.read_text())


def auto_choice() -> str:
    """What WEIGHT_DTYPE=auto resolves to for the embedded GGUF on this machine's CPU."""
    from kvgen.engine import model_files
    from kvgen.engine.model import resolve_weight_dtype

    return resolve_weight_dtype("auto", torch.device("cpu"), model_files.load(peers.model_path())[2].get("blocks"))


def fast_dtype() -> str:
    return os.environ.get("BENCH_FAST_WEIGHTS", "gguf")


if __name__ == "__main__":
    main()
