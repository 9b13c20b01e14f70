"""make bench-lora: 16 streams over 8 LoRA adapters against 16 streams on the base model alone, in the
same run on the embedded model, and the ratio of their aggregate decode tokens/s (issue #44's goal:
>= 0.8x). Results: bench/results/lora.md.

The adapters are random (rank 16 on all of q/k/v/o/gate/up/down, the layout PEFT writes): speed does
not depend on what they learned. Each round runs the 16 streams in one engine (all submitted at
once, so they share steps), the base round and the adapter round alternating ROUNDS times; the
figure is each side's median.

Beside it, llama.cpp's llama-server (bench/setup_llama_server.sh builds it; --skip-llama-server leaves
it out) on the same GGUF with the same 8 adapters, converted to GGUF LoRAs by llama.cpp's
convert_lora_to_gguf.py (bench/lora_trained.to_gguf) and loaded at scale 0 (--lora ...
--lora-init-without-apply), 16 slots, the same threads: the same 16 streams (the same prompt token ids,
greedy, ignore_eos), stream i asking for adapter i mod 8 (`"lora": [{"id": i mod 8, "scale": 1}]`), and
16 on the base model, its rounds alternating with kvgen's. The adapters and their GGUFs are kept in
bench/.cache/lora-bench (random but seeded: the same every run), so they are converted once. A second
llama-server with no adapter loaded runs the base streams too (what loading them costs it)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peers  # noqa: E402
from bench.lora_trained import to_gguf  # noqa: E402
from bench.serving import LLAMA_SERVER, Served, _free_port  # noqa: E402
from kvgen.engine.generator import Generator  # noqa: E402
from kvgen.engine.options import EngineOptions  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List ten uses for a paperclip.", "Describe the water cycle to a child."]
ADAPTERS = Path(__file__).parent / ".cache" / "lora-bench"  # the random adapters and their GGUF LoRAs
SLOT_CONTEXT = 2048  # llama-server's context per slot (bench/serving.py's): each stream needs < 200
SERVER_SOURCE = "tools/server/server-context.cpp"  # in the llama-cpp-python sdist's vendor/llama.cpp


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


def adapter_folders(cfg, n: int, rank: int) -> list[Path]:
    """The n random adapters (seeds 0 .. n - 1) in ADAPTERS, written where they are not there yet."""
    folders = []
    for i in range(n):
        folder = ADAPTERS / f"{cfg.name.replace(' ', '_')}-r{rank}" / f"lora{i}"
        if not (folder / "adapter_config.json").exists():
            write_random_adapter(folder, cfg, rank, i)
        folders.append(folder)
    return folders


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


def llama_server(gguf_loras: list[Path]) -> Served:
    """llama-server on the embedded GGUF with every adapter loaded at scale 0 (a request's `lora` list
    picks its own), 16 slots of SLOT_CONTEXT tokens, kvgen's thread count, no prompt cache reuse asked."""
    port = _free_port()
    cmd = [str(LLAMA_SERVER), "-m", peers.model_path(), "--port", str(port), "--host", "127.0.0.1",
           "-np", "16", "-c", str(16 * SLOT_CONTEXT), "-t", str(peers.cores()), "--cont-batching",
           *(a for f in gguf_loras for a in ("--lora", str(f))), "--lora-init-without-apply"]
    return Served("llama-server", cmd, None, port)


async def server_round(srv: Served, ids: list[list[int]], adapters: int, new_tokens: int) -> dict:
    """llama-server's round: len(ids) /completion calls at once, call i on adapter i mod adapters (0: the
    base model). Aggregate tokens/s, each call's seconds, and its text (to see the adapters applied)."""
    async def one(s: aiohttp.ClientSession, i: int) -> tuple[int, float, str]:
        body = {"prompt": ids[i], "n_predict": new_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        if adapters:
            body["lora"] = [{"id": i % adapters, "scale": 1.0}]
        async with s.post(srv.url + "/completion", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"llama-server: HTTP {r.status}: {(await r.text())[:500]}")
            out = await r.json()
        return out["tokens_predicted"], time.perf_counter() - started, out["content"]

    # a connection per call: llama-server's HTTP library drops kept-alive ones (bench/serving.py)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        started = time.perf_counter()
        out = await asyncio.gather(*(one(s, i) for i in range(len(ids))))
        took = time.perf_counter() - started
    return {"tok_s": sum(n for n, _, _ in out) / took, "seconds": [t for _, t, _ in out],
            "texts": [text for _, _, text in out]}


def _row(name: str, xs: list[float]) -> str:
    return f"| {name} | {statistics.median(xs):.1f} | {', '.join(f'{x:.1f}' for x in xs)} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora.md"))
    ap.add_argument("--skip-llama-server", action="store_true")
    a = ap.parse_args()
    probe = Generator.load(None, EngineOptions(prefix_cache=False))
    cfg = probe.cfg
    probe.close()
    names = [f"lora{i}" for i in range(a.adapters)]
    folders = adapter_folders(cfg, a.adapters, a.rank)
    spec = ",".join(f"{n}={f}" for n, f in zip(names, folders, strict=True))
    srv = None
    if a.skip_llama_server:
        why = "left out (--skip-llama-server)"
    elif not LLAMA_SERVER.exists():
        why = f"not built ({LLAMA_SERVER} missing: bash bench/setup_llama_server.sh)"
    else:
        why = ""
        srv = llama_server([to_gguf(f) for f in folders])
        bare = llama_server([])  # the base model with no adapter loaded: what loading them costs it
    peer = {"base": [], "lora": [], "bare": [], "last": None, "changed": 0}
    # no prefix cache: every round computes its prompts, as the other side's does
    gen = Generator.load(None, EngineOptions(lora_adapters=spec, max_loras=a.adapters, prefix_cache=False))
    try:
        ids = [gen.tokenize(PROMPTS[i % len(PROMPTS)]) for i in range(a.streams)]
        run_round(gen, [""], 2, 8)  # warm-up: kernels, allocations
        run_round(gen, names[:2], 2, 8)
        if srv is not None:  # warm-up at full width: its first rounds after start-up ran slow, once for minutes
            for peer_srv in (srv, bare):
                asyncio.run(peer_srv.ready())
                asyncio.run(server_round(peer_srv, ids, 0, 8))
            asyncio.run(server_round(srv, ids, a.adapters, 8))
        base, lora = [], []
        load = [os.getloadavg()[0]]  # other work on the cores shows here
        for _ in range(a.rounds):
            base.append(run_round(gen, [""], a.streams, a.tokens))
            lora.append(run_round(gen, names, a.streams, a.tokens))
            print(f"base {base[-1]:.1f} tok/s, {a.adapters} adapters {lora[-1]:.1f} tok/s", flush=True)
            if srv is not None:  # its rounds in turn with kvgen's: a burst of other work costs both alike
                plain = asyncio.run(server_round(srv, ids, 0, a.tokens))
                adapted = asyncio.run(server_round(srv, ids, a.adapters, a.tokens))
                peer["bare"].append(asyncio.run(server_round(bare, ids, 0, a.tokens))["tok_s"])
                peer["base"].append(plain["tok_s"])
                peer["lora"].append(adapted["tok_s"])
                peer["last"] = adapted
                peer["changed"] = sum(x != y for x, y in zip(plain["texts"], adapted["texts"], strict=True))
                print(f"llama-server: base {plain['tok_s']:.1f} tok/s, {a.adapters} adapters {adapted['tok_s']:.1f} "
                      f"tok/s (calls ended {min(adapted['seconds']):.1f} .. {max(adapted['seconds']):.1f} s), "
                      f"base with no adapter loaded {peer['bare'][-1]:.1f} tok/s", flush=True)
        load.append(os.getloadavg()[0])
        path = gen.engine.runner.fused is not None
    finally:
        gen.close()
        if srv is not None:
            srv.stop()
            bare.stop()
    b, lr = statistics.median(base), statistics.median(lora)
    ratio = lr / b
    rows = [_row(f"{a.streams} streams, base model", base),
            _row(f"{a.streams} streams over {a.adapters} adapters", lora)]
    if srv is None:
        peer_text = f"llama.cpp's llama-server is not in this table: {why}.\n"
    else:
        rows += [_row(f"llama-server: {a.streams} streams, base model", peer["base"]),
                 _row(f"llama-server: {a.streams} streams over {a.adapters} adapters", peer["lora"]),
                 _row(f"llama-server: {a.streams} streams, base model, no adapter loaded", peer["bare"])]
        peer_text = _peer_text(a, peer, b, lr)
    table = "\n".join(rows)
    text = f"""# LoRA adapters: many adapters batched over one base model (make bench-lora)

{datetime.date.today()} · {peers.cpu_name()} · {peers.cores()} cores · torch {torch.__version__} ·
the embedded model ({cfg.name}, its GGUF's own blocks; fused decode step {'on' if path else 'off'}, adapter rows too).
{a.streams} concurrent streams, {a.tokens} new tokens each (greedy, ignore_eos), short prompts, no prefix cache;
{a.adapters} random adapters of rank {a.rank} on all of q/k/v/o/gate/up/down, stream i on adapter i mod
{a.adapters}. Aggregate tokens/s (all streams' tokens / the round's wall time), median of {a.rounds} rounds,
base and adapter rounds alternating in one process. Load average (1 min) at the start / end of the
measured rounds: {load[0]:.2f} / {load[1]:.2f} (the machine is shared with other work: beyond this run's own
{peers.cores()} busy threads, which count in the end figure, it is someone else's, and makes the rounds noisy).

| run | aggregate tok/s (median) | rounds |
| --- | --- | --- |
{table}

Ratio: **{ratio:.2f}x** (goal >= 0.8x: {'met' if ratio >= 0.8 else 'not met'}).

{peer_text}"""
    out = Path(a.out)
    # the sections after this bench's (bench/lora_trained.py's) are kept as they are
    old = out.read_text() if out.exists() else ""
    rest = old.find("\n## ")
    out.write_text(text + ("" if rest < 0 else old[rest:]))
    print(text)


def _peer_text(a, peer: dict, b: float, lr: float) -> str:
    """What the table's llama-server rows are, and how it serves many adapters (its source, cited)."""
    from tests.tiny import LLAMACPP_VERSION

    pb, pl, pbare = (statistics.median(peer[k]) for k in ("base", "lora", "bare"))
    ended = peer["last"]["seconds"]
    return f"""llama-server: llama.cpp as vendored in llama-cpp-python {LLAMACPP_VERSION}'s sdist
(bench/setup_llama_server.sh), on the same GGUF with the same {a.adapters} adapters as GGUF LoRAs
(convert_lora_to_gguf.py, f32), loaded at scale 0 (`--lora-init-without-apply`);
`-np 16 -c {16 * SLOT_CONTEXT}` ({SLOT_CONTEXT} tokens a slot, fp16 KV), `-t {peers.cores()}`.
The same prompt token ids through its `/completion`, stream i with
`"lora": [{{"id": i mod {a.adapters}, "scale": 1.0}}]`; its rounds alternate with kvgen's.
kvgen runs in process (the engine API), llama-server over loopback HTTP. Its replies with the
adapters differed from its base replies in {peer['changed']}/{a.streams} streams (the adapters are applied).
Its ratio: **{pl / pb:.2f}x**; kvgen's adapter rounds ran at {lr / pl:.2f}x llama-server's, its base
rounds at {b / pb:.2f}x. A second llama-server, started with no `--lora`, gives the last row (its rounds
in turn with the others): with the {a.adapters} adapters loaded at scale 0, llama-server's base rounds ran
at {pb / pbare:.2f}x its speed without them (kvgen's base rounds run with the adapters loaded too).

llama-server does not batch rows of different adapters in one step: a slot joins a step's batch only
if its adapter list (ids and scales) equals that of the first slot taken (`server_slot::can_batch_with`
and `are_lora_equal`, {SERVER_SOURCE}); the others wait for a later step, the slots are taken
in a fixed order, and each change of the adapter set re-reserves the compute graph
(`llama_context::set_adapters_lora`, src/llama-context.cpp). So its {a.streams} streams over
{a.adapters} adapters run in steps of {a.streams // a.adapters} rows, one adapter's at a time: in the last round
its calls ended {min(ended):.1f} s to {max(ended):.1f} s after the round began, where kvgen's share every step.
"""


if __name__ == "__main__":
    main()
