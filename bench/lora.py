"""make bench-lora: 16 streams over 8 LoRA adapters against 16 streams on the base model alone, in the
same run on the embedded model, and the ratio of their aggregate decode tokens/s (issue #44's goal:
>= 0.8x). Results: bench/results/lora.md.

The adapters are random (rank 16 on all of q/k/v/o/gate/up/down, the layout PEFT writes): speed does
not depend on what they learned. Each round runs the 16 streams in one engine (all submitted at
once, so they share steps), the base round and the adapter round alternating ROUNDS times; the
figure is each side's median. llama.cpp's llama-server (--lora, a request's `lora` list) is not run
beside it yet: bench/setup_llama_server.sh builds it, bench/results/lora.md says so."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peers  # noqa: E402
from kvgen.engine.generator import Generator  # noqa: E402
from kvgen.engine.options import EngineOptions  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List ten uses for a paperclip.", "Describe the water cycle to a child."]


def write_random_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for the model of cfg: random A and B (B non-zero, so it is a real delta)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size), "v_proj": (kv, cfg.hidden_size),
              "o_proj": (cfg.hidden_size, q), "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (out, inp) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(MODULES), "bias": "none"}))
    return folder


def run_round(gen: Generator, adapters: list[str], streams: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s of `streams` requests submitted together, stream i on adapters[i % n]."""
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    ids = [gen.tokenize(PROMPTS[i % len(PROMPTS)]) for i in range(streams)]

    async def go():
        started = time.perf_counter()
        reqs = [gen.submit(ids[i], sp, adapter=adapters[i % len(adapters)]) for i in range(streams)]
        out = [await r.result() for r in reqs]
        took = time.perf_counter() - started
        for r in reqs:
            await r.released()
        return sum(len(o.token_ids) for o in out) / took

    return gen.bridge.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora.md"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe = Generator.load(None, EngineOptions(prefix_cache=False))
        cfg = probe.cfg
        probe.close()
        names = [f"lora{i}" for i in range(a.adapters)]
        spec = ",".join(f"{n}={write_random_adapter(Path(tmp) / n, cfg, a.rank, i)}" for i, n in enumerate(names))
        # no prefix cache: every round computes its prompts, as the other side's does
        gen = Generator.load(None, EngineOptions(lora_adapters=spec, max_loras=a.adapters, prefix_cache=False))
        try:
            run_round(gen, [""], 2, 8)  # warm-up: kernels, allocations
            run_round(gen, names[:2], 2, 8)
            base, lora = [], []
            load = [os.getloadavg()[0]]  # other work on the cores shows here
            for _ in range(a.rounds):
                base.append(run_round(gen, [""], a.streams, a.tokens))
                lora.append(run_round(gen, names, a.streams, a.tokens))
                print(f"base {base[-1]:.1f} tok/s, {a.adapters} adapters {lora[-1]:.1f} tok/s", flush=True)
            load.append(os.getloadavg()[0])
            path = gen.engine.runner.fused is not None
        finally:
            gen.close()
    b, lr = statistics.median(base), statistics.median(lora)
    ratio = lr / b
    text = f"""# LoRA adapters: many adapters batched over one base model (make bench-lora)

{datetime.date.today()} · {peers.cpu_name()} · {peers.cores()} cores · torch {torch.__version__} ·
the embedded model ({cfg.name}, its GGUF's own blocks; fused decode step {'on' if path else 'off'}, adapter rows too).
{a.streams} concurrent streams, {a.tokens} new tokens each (greedy, ignore_eos), short prompts, no prefix cache;
{a.adapters} random adapters of rank {a.rank} on all of q/k/v/o/gate/up/down, stream i on adapter i mod
{a.adapters}. Aggregate tokens/s (all streams' tokens / the round's wall time), median of {a.rounds} rounds,
base and adapter rounds alternating in one process. Load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}.

| run | aggregate tok/s (median) | rounds |
| --- | --- | --- |
| {a.streams} streams, base model | {b:.1f} | {', '.join(f'{x:.1f}' for x in base)} |
| {a.streams} streams over {a.adapters} adapters | {lr:.1f} | {', '.join(f'{x:.1f}' for x in lora)} |

Ratio: **{ratio:.2f}x** (goal >= 0.8x: {'met' if ratio >= 0.8 else 'not met'}).

llama.cpp's llama-server is not in this table: it takes adapters (`--lora file.gguf`, several, and a
request's `lora` list of ids and scales), but this bench does not drive it yet.
"""
    out = Path(a.out)
    # the sections after this bench's (bench/lora_trained.py's) are kept as they are
    old = out.read_text() if out.exists() else ""
    rest = old.find("\n## ")
    out.write_text(text + ("" if rest < 0 else old[rest:]))
    print(text)


if __name__ == "__main__":
    main()
