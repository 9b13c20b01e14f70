"""Fidelity of CPU_ACTIVATIONS: greedy agreement with transformers' fp32 model on the embedded Q4_1 GGUF (or
the GGUFs --model names, each against transformers on its own dequantized weights), kvgen with int16
activations (the default) and with int8, and llama.cpp (llama-server's greedy tokens on the same file) beside
them, in one run. Writes bench/results/activations.md.

32 prompts, 24 greedy tokens each (EOS ignored): the mean length of the prefix each continuation shares with
transformers'. Few prompts mislead: one early flip costs a prompt up to 24 (8 prompts put int8 below
llama.cpp, 32 above it, the same day). Each kvgen setting runs in a process of its own (the kernels are built
for it when kvgen.cpu is imported).

    make bench-activations   (or .venv/bin/python bench/activations.py [--model A.gguf B.gguf ...])
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu, peers  # noqa: E402
from bench.serving import LLAMA_SERVER, _free_port  # noqa: E402

OUT = ROOT / "bench" / "results" / "activations.md"
TEXTS = [*cpu.PROMPTS, "Explain photosynthesis in one sentence.", "Write a haiku about the sea.",
         "The best way to learn a language is", "import numpy as np\n", "My favourite book is", "Water boils at",
         "The history of Rome begins", "To make a cup of tea, first", "SELECT name FROM users WHERE",
         "The weather today is", "In machine learning, a neural network", "Dear Sir or Madam,", "The moon is",
         "Q: What is 2 + 2?\nA:", "Paris is known for", "A good password should", "The mitochondria is",
         "Once there was a dragon who", "function add(a, b) {", "The stock market fell because",
         "Our team meeting will cover", "Cats are better than dogs because", "The speed of light is",
         "Step 1: Preheat the oven", "Shakespeare wrote", "The internet was invented"]
TOKENS = 24


def prompts() -> list[list[int]]:
    tok = peers._tokenizer()
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def use_model(path: str) -> None:
    """peers' model (the tokenizer, transformers' oracle, kvgen's and llama-server's file) made the GGUF at path:
    peers joins its folder and MODEL_FILE, and an absolute MODEL_FILE wins the join."""
    peers.MODEL_FILE = os.path.abspath(path)


def kvgen_greedy(activations: str) -> tuple[list[list[int]], str]:
    """(greedy ids, GetModelInfo.cpu_kernels) of a kvgen built for `activations`, in a process of its own."""
    env = dict(os.environ, CPU_ACTIVATIONS=activations)
    r = subprocess.run([sys.executable, __file__, "--kvgen", peers.model_path()], env=env, capture_output=True,
                       text=True, cwd=ROOT, timeout=1800, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["ids"], out["kernels"]


def _kvgen_round() -> None:
    from kvgen.engine.generator import EngineOptions, Generator, kernel_path, load_model

    g = Generator(*load_model(peers.model_path(), "gguf"), EngineOptions(prefix_cache=False))
    try:
        print(json.dumps({"ids": cpu.greedy_ids(g, prompts(), TOKENS), "kernels": kernel_path(g.model)}))
    finally:
        g.close()


def llama_server_greedy(ids: list[list[int]]) -> list[list[int]] | None:
    if not LLAMA_SERVER.exists():
        print(f"llama-server skipped: {LLAMA_SERVER} missing (bash bench/setup_llama_server.sh)")
        return None
    port = _free_port()
    proc = subprocess.Popen([str(LLAMA_SERVER), "-m", peers.model_path(), "--port", str(port), "--host", "127.0.0.1",
                             "-t", str(peers.cores()), "-c", "2048"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        got = []
        for p in ids:  # top-k 1 as the only sampler: greedy
            body = json.dumps({"prompt": p, "n_predict": TOKENS, "temperature": 0, "ignore_eos": True, "top_k": 1,
                               "samplers": ["top_k"], "return_tokens": True, "cache_prompt": False}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            got.append(json.loads(urllib.request.urlopen(req, timeout=300).read())["tokens"])
        return got
    finally:
        proc.terminate()
        proc.wait(30)


def one_model() -> list[tuple[str, str, float]]:
    """(engine, kernels, mean agreement) of each engine on peers' model against transformers on the same file."""
    from kvgen.cpu.threads import in_fresh_thread

    peers._tokenizer.cache_clear()
    peers._model.cache_clear()
    ids = prompts()
    oracle = in_fresh_thread(peers.transformers_greedy, ids, TOKENS)
    rows = []
    for act in ("int16", "int8"):
        got, kernels = kvgen_greedy(act)
        rows.append((f"kvgen CPU_ACTIVATIONS={act}", kernels, cpu.agreement(oracle, got)))
    llama = llama_server_greedy(ids)
    if llama is not None:
        rows.append(("llama.cpp (llama-server)", "its CPU backend (int8 activations)", cpu.agreement(oracle, llama)))
    return rows


def main(models: list[str]) -> None:
    t0 = time.perf_counter()
    results = []
    for path in models or [peers.model_path()]:
        use_model(path)
        results.append((os.path.basename(path), one_model()))
        print(results[-1], flush=True)
    lines = ["# Fidelity of the CPU kernels' activations\n",
             f"{datetime.date.today()} · {peers.cpu_name()} · {peers.cores()} cores · `bench/activations.py` "
             f"({time.perf_counter() - t0:.0f} s)\n",
             f"Mean greedy prefix (of {TOKENS} tokens) agreeing with transformers' fp32 model on the same GGUF "
             f"(SmolLM2-135M: the embedded Q4_1, or its re-encodings), over {len(TEXTS)} prompts (EOS ignored).\n",
             "| file | engine | kernels | greedy agree /24 |", "|---|---|---|---:|"]
    lines += [f"| {name} | {engine} | {kernels} | {agree:.2f} |" for name, rows in results
              for engine, kernels, agree in rows]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kvgen"]:
        use_model(sys.argv[2])
        _kvgen_round()
    else:
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("--model", nargs="+", default=[], help="GGUF files of the embedded model (default: it)")
        main(ap.parse_args().model)
