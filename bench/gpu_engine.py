"""The engine on a GPU: decode tokens/s against transformers, concurrent streams, and perplexity
of every KV format through the decode kernels. Appends to bench/results/gpu-<device name>.md
(bench/gpu.py writes the flash-decode half first; `make bench-gpu` runs both).

- Batch-1 decode: greedy, EOS ignored, the engine (Generator, as the server drives it) with
  CUDA graphs on and off, next to transformers' `generate` on the same GGUF, same weight dtype,
  same GPU. Decode rate = 128 / (time of 129 new tokens - time of 1 new token): prefill and
  start-up cancel out. Median of `--repeats`.
- Streams: N requests submitted together (distinct prompts, 64 new tokens each): aggregate new
  tokens / wall time, prefill included.
- Perplexity: teacher forcing over bench/kv_text.py, the first 8 tokens prefilled, then ONE
  TOKEN PER STEP through ModelRunner, as serving decodes: through the kernels (kv_append +
  flash_decode, CUDA graphs) and, for comparison, through torch attention on the same GPU.
  Formats are calibrated as the Generator does (fp8 key scales); fp8 / q4 / q3 with and without
  the exact tail (each sequence's newest block and first token, kv/stage.py).

    python bench/gpu_engine.py [--device cuda] [--tokens 1024] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kv_text import EVAL_TEXT  # noqa: E402
from kvgen.engine.generator import EngineOptions, Generator, load_model  # noqa: E402
from kvgen.engine.kv.formats import make_format  # noqa: E402
from kvgen.engine.kv.paged import PagedKVCache  # noqa: E402
from kvgen.engine.kv.pool import BlockPool  # noqa: E402
from kvgen.engine.kv_samples import calibrate_format  # noqa: E402
from kvgen.engine.model_files import embedded_model_path  # noqa: E402
from kvgen.engine.model_runner import ModelRunner  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

PROMPT = "The history of the printing press begins"
NEW = 128


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def decode_rate(run, device: str, repeats: int) -> float:
    """Tokens/s of decode: run(n) generates n tokens; (NEW + 1 vs 1) cancels prefill."""
    run(2)  # warm-up: graphs captured, kernels compiled, allocator primed
    rates = []
    for _ in range(repeats):
        long, short = timed(lambda: run(NEW + 1), device), timed(lambda: run(1), device)
        rates.append(NEW / (long - short))
    return statistics.median(rates)


def kvgen_decode(model_tok, device: str, graphs: bool, repeats: int) -> float:
    gen = Generator(*model_tok, EngineOptions(device=device, cuda_graphs=graphs, kv_cache_mb=256))
    try:
        def run(n):
            out = gen.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
            assert len(out.token_ids) == n
        return decode_rate(run, device, repeats)
    finally:
        gen.close()


def transformers_decode(path: str, dtype: torch.dtype, device: str, repeats: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(pathlib.Path(path).parent), pathlib.Path(path).name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)

    def run(n):
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        assert out.shape[1] == ids.shape[1] + n
    return decode_rate(run, device, repeats)


def story_prompts(n: int) -> list[str]:
    """n distinct prompts (the streams benchmarks' requests)."""
    return [f"Story number {i}: once upon a time, in a town called {chr(65 + i % 26)}ville," for i in range(n)]


def streams(model_tok, device: str, n: int, new: int = 64) -> float:
    gen = Generator(*model_tok, EngineOptions(device=device, kv_cache_mb=1024))
    try:
        params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        prompts = story_prompts(n)
        gen.batch_generate(prompts[:2], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
        wall = timed(lambda: gen.batch_generate(prompts, params), device)
        return n * new / wall
    finally:
        gen.close()


def perplexity(model, tokenizer, ids: list[int], kv: str, exact_tail: bool, kernels: bool) -> tuple[float, bool]:
    """Teacher-forced perplexity with one token per decode step; (ppl, kernel path used)."""
    cfg = model.cfg
    fmt = make_format(kv, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, compute_dtype=model.act_dtype,
                      recent_slots=1 if exact_tail else None)
    calibrate_format(model, fmt, tokenizer)
    width = -(-len(ids) // 16)
    pool = BlockPool(fmt, width, model.device)
    runner = ModelRunner(model, fmt, pool.store, width=width, max_rows=1)
    used = runner.kernel_attention is not None and kernels
    if not kernels:
        runner.kernel_attention = runner.graphs = None  # the same steps through torch attention
    cache = PagedKVCache(pool)
    seq = SimpleNamespace(tokens=ids, cache=cache, prompt_logprobs=None, draft=[])
    nll, first = 0.0, 8
    targets = torch.tensor(ids)
    for n in [first] + [1] * (len(ids) - first - 1):
        cache.reserve(n)
        logits = runner.run([(seq, n)])[0]
        cache.advance(n)
        nll += F.cross_entropy(logits[None].float(), targets[cache.length:cache.length + 1]).item()
    return math.exp(nll / (len(ids) - first)), used


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1024, help="perplexity tokens")
    p.add_argument("--streams", default="1,4,16,64")
    p.add_argument("--formats", default="fp32,fp16,bf16,fp8,q4,q3")
    p.add_argument("--skip", default="", help="comma list of sections to skip: decode,streams,ppl")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    dev = args.device
    name = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu"
    out = pathlib.Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"gpu-{re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('-')}.md")
    path = embedded_model_path()
    lines = ["", f"## The engine on {name}", "",
             f"torch {torch.__version__}; the embedded SmolLM2-135M (Q4_1 GGUF), fp32 weights unless said."]

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    model_tok = load_model(path, "fp32", dev)
    if "decode" not in skip:
        emit("")
        emit(f"### Batch-1 greedy decode, tokens/s ({NEW} tokens; median of {args.repeats})")
        emit("")
        emit("| engine | weights | tok/s | x transformers |")
        emit("| --- | --- | ---: | ---: |")
        for wname, wdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            try:
                hf = transformers_decode(path, wdtype, dev, args.repeats)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                emit(f"| transformers generate | {wname} | failed: {type(e).__name__}: {e} | |")
                hf = float("nan")
            else:
                emit(f"| transformers generate | {wname} | {hf:.1f} | 1.00 |")
            mt = model_tok if wname == "fp32" else load_model(path, wname, dev)
            for graphs in (True, False):
                try:
                    r = kvgen_decode(mt, dev, graphs, args.repeats)
                    emit(f"| kvgen, CUDA graphs {'on' if graphs else 'off'} | {wname} | {r:.1f} | {r / hf:.2f} |")
                except Exception as e:  # noqa: BLE001
                    emit(f"| kvgen, CUDA graphs {'on' if graphs else 'off'} | {wname} | failed: "
                         f"{type(e).__name__}: {e} | |")
    if "streams" not in skip:
        emit("")
        emit("### Concurrent streams (64 new tokens each, prefill included), aggregate tokens/s")
        emit("")
        emit("| streams | tok/s | x 1 stream |")
        emit("| ---: | ---: | ---: |")
        base = None
        for n in map(int, args.streams.split(",")):
            r = streams(model_tok, dev, n)
            base = base or r
            emit(f"| {n} | {r:.1f} | {r / base:.2f} |")
    if "ppl" not in skip:
        model, tokenizer = model_tok
        ids = tokenizer.encode(EVAL_TEXT)[:args.tokens]
        emit("")
        emit(f"### Perplexity, one token per decode step over {len(ids)} tokens of bench/kv_text.py")
        emit("")
        emit("kernels: kv_append + flash_decode under CUDA graphs where the format has them; torch: the "
             "same steps through torch attention on the same device.")
        emit("")
        emit("| KV format | exact tail | decode path | perplexity (kernels) | perplexity (torch) | vs fp32 |")
        emit("| --- | --- | --- | ---: | ---: | ---: |")
        ref = None
        for kv in args.formats.split(","):
            for tail in ((False, True) if kv in ("fp8", "q4", "q3") else (False,)):
                k_ppl, used = perplexity(model, tokenizer, ids, kv, tail, kernels=True)
                t_ppl, _ = perplexity(model, tokenizer, ids, kv, tail, kernels=False)
                ref = ref or k_ppl
                emit(f"| {kv} | {'yes' if tail else 'no'} | {'kernels' if used else 'torch'} | {k_ppl:.4f} | "
                     f"{t_ppl:.4f} | {k_ppl / ref - 1:+.3%} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
