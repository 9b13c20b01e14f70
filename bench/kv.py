"""KV cache storage formats: quality and memory, on the embedded SmolLM2-135M. Writes bench/results/kv.md.

Method
- Perplexity: teacher forcing over EVAL_TEXT (bench/kv_text.py) in prefill chunks of 16
  tokens through a paged cache of the format under test, logits for every row of every chunk.
  The model writes each chunk's K/V into the store and attention reads every key and value
  back from it, so each prediction sees the quantized cache exactly as serving would.
- Greedy agreement: the prompts of kv_text.PROMPTS are prefilled together, then decoded
  greedily (64 new tokens, EOS ignored) in one batch; per prompt, the length of the prefix
  that agrees with fp32, averaged.
- Formats are built as the Generator builds them: fp8 key scales and q3 codebooks fitted
  first (kvgen.engine.kv_samples), and fp8 / q4 / q3 keep each sequence's newest block
  and first token exact (KIVI's residual, the attention sink; kv/stage.py); "nothing kept exact" rows
  turn that off to measure what it buys.
  Chunks of half a block make every query see its own block exact and the blocks before it
  quantized, as a decode step does.

- Decode speed (issue 19): batch-1 greedy decode tok/s (1 / the median time between streamed
  tokens) at ~1k tokens of context with the default weights (WEIGHT_DTYPE=auto) per KV format as
  the Generator builds it, formats interleaved round by round in one process (best of the rounds),
  each as a ratio to fp32 from the same run; fp8 and
  q4 are also timed through Model.forward (the fused step turned off) to show what fusing buys.

Run: `make bench-kv` (or .venv/bin/python bench/kv.py [--tokens N]); `--speed` measures only the
decode speed and replaces that section of the results file; `--compress` only KV_COMPRESS's
methods (bench/kv_compress.py), likewise.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import peers  # noqa: E402
from bench.kv_text import EVAL_TEXT, PROMPTS  # noqa: E402
from kvgen.engine.attention import Step  # noqa: E402
from kvgen.engine.kv.formats import KV_DTYPES, KVFormat, make_format  # noqa: E402
from kvgen.engine.kv_samples import calibrate_format  # noqa: E402

BLOCK = 16
CHUNK = 8  # half a block: each query sees its own block as decode does (kv/stage.py)
NEW_TOKENS = 64
# Relative perplexity increase over fp32 that issue 4 accepts per format.
BOUNDS = {"fp32": 0.0, "fp16": 0.001, "bf16": 0.001, "fp8": 0.01, "q4": 0.05, "q3": 0.10}
QUANTIZED = ("fp8", "q4", "q3")
SPEED_FORMATS = ("fp32", "fp8", "q4")
SPEED_CONTEXT, SPEED_NEW = 1024, 64  # prompt of 992 tokens + 64 decoded: context 992..1056
SPEED_GOAL = 0.85  # issue 19: quantized formats decode within 15% of fp32
SPEED_HEADING = "## Decode speed at 1k tokens of context"
RESULTS = Path(__file__).resolve().parent / "results" / "kv.md"


class Emulated(KVFormat):
    """A format with one half of its cache (`exact`: "k" or "v") read from an fp32 shadow of
    every write: which half carries the loss?"""

    def __init__(self, inner: KVFormat, exact: str):
        super().__init__(inner.num_layers, inner.block_size, inner.num_kv_heads, inner.head_dim,
                         inner.compute_dtype)
        self.inner, self.exact = inner, exact
        self.qk_scale = inner.qk_scale  # the model equalises keys for the inner format
        self.name = f"{inner.name} + {exact.upper()} exact"
        self.shadow = make_format("fp32", inner.num_layers, inner.block_size, inner.num_kv_heads,
                                  inner.head_dim, compute_dtype=inner.compute_dtype)

    def allocate(self, num_blocks, device="cpu"):
        store = self.inner.allocate(num_blocks, device)
        store["shadow"] = self.shadow.allocate(num_blocks, device)["kv"]
        return store

    def write(self, store, layer, blocks, offsets, k, v, positions=None):
        self.inner.write(store, layer, blocks, offsets, k, v, positions)
        self.shadow.write({"kv": store["shadow"]}, layer, blocks, offsets, k, v)

    def read(self, store, layer, block_ids):
        k, v = self.inner.read(store, layer, block_ids)
        sk, sv = self.shadow.read({"kv": store["shadow"]}, layer, block_ids)
        return (sk, v) if self.exact == "k" else (k, sv)


RECENT_SLOTS = 16  # more than the greedy prompts, so every sequence keeps its newest block exact


def eval_format(model, name: str, tokenizer, recent: bool = True, exact: str = "") -> KVFormat:
    """The format as the Generator builds it (calibrated; quantized formats keep the newest
    block exact unless recent=False), optionally with one half exact (Emulated)."""
    cfg = model.cfg
    fmt = make_format(name, cfg.num_layers, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                      compute_dtype=model.act_dtype,
                      recent_slots=RECENT_SLOTS if recent and name in QUANTIZED else None)
    calibrate_format(model, fmt, tokenizer)
    return Emulated(fmt, exact) if exact else fmt


def _step(seqs: list[tuple[int, int]], tables: torch.Tensor, bs: int, all_rows: bool) -> Step:
    """A Step for sequences given as (first new position, number of new tokens), with
    per-sequence block tables; logits for every new row, or for each sequence's last row."""
    pos = torch.cat([torch.arange(s, s + n) for s, n in seqs])
    seq_of = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(seqs)])
    ends = torch.tensor([n for _, n in seqs]).cumsum(0) - 1
    return Step(positions=pos, write_blocks=tables[seq_of, pos // bs], write_offsets=pos % bs,
                query_lens=[n for _, n in seqs], context_lens=[s + n for s, n in seqs],
                block_tables=tables, logits_rows=torch.arange(len(pos)) if all_rows else ends,
                is_decode=all(n == 1 for _, n in seqs))


def perplexity(model, ids: list[int], fmt: KVFormat, chunk: int = CHUNK) -> float:
    """exp(mean NLL) of ids[1:] given the prefix, fed in chunks through a cache of `fmt`."""
    n_blocks = -(-len(ids) // fmt.block_size)
    store = fmt.allocate(n_blocks)
    table = torch.arange(n_blocks)[None]
    x = torch.tensor(ids)
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)  # the last token is only ever a target
        step = _step([(start, end - start)], table, fmt.block_size, all_rows=True)
        logits = model.forward(x[start:end], step, fmt, store)
        nll += F.cross_entropy(logits, x[start + 1:end + 1], reduction="sum").item()
    return math.exp(nll / (len(ids) - 1))


def greedy(model, prompts: list[list[int]], fmt: KVFormat, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded together as one batch (EOS ignored)."""
    bs = fmt.block_size
    need = [-(-(len(p) + new_tokens) // bs) for p in prompts]
    first = [sum(need[:i]) for i in range(len(need))]
    width = max(need)
    tables = torch.tensor([[f + min(j, n - 1) for j in range(width)] for f, n in zip(first, need, strict=True)])
    store = fmt.allocate(sum(need))
    step = _step([(0, len(p)) for p in prompts], tables, bs, all_rows=False)
    logits = model.forward(torch.tensor([t for p in prompts for t in p]), step, fmt, store)
    out = [[t] for t in logits.argmax(-1).tolist()]
    for i in range(1, new_tokens):
        step = _step([(len(p) + i - 1, 1) for p in prompts], tables, bs, all_rows=False)
        logits = model.forward(torch.tensor([o[-1] for o in out]), step, fmt, store)
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt: how many leading tokens of the two continuations are equal."""
    lens = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        lens.append(n)
    return lens


def sequences_in(fmt: KVFormat, budget_bytes: int, seq_tokens: int, extra_per_seq: int = 0) -> int:
    """How many seq_tokens-long sequences fit in budget_bytes of whole blocks."""
    per_seq = -(-seq_tokens // fmt.block_size) * fmt.bytes_per_block() + extra_per_seq
    return budget_bytes // per_seq


VARIANTS = [(n, True) for n in KV_DTYPES if n != "auto"] + [(n, False) for n in QUANTIZED]
DIAG_TOKENS = 512  # the which-half-loses diagnosis runs on the start of the text only


def run(model, tokenizer, tokens: int | None = None, new_tokens: int = NEW_TOKENS,
        diag_tokens: int = DIAG_TOKENS) -> dict:
    ids = tokenizer.encode(EVAL_TEXT)[:tokens]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows = []
    ref = None
    for name, recent in VARIANTS:
        fmt = eval_format(model, name, tokenizer, recent)
        t0 = time.perf_counter()
        ppl = perplexity(model, ids, fmt)
        t1 = time.perf_counter()
        cont = greedy(model, prompts, fmt, new_tokens)
        t2 = time.perf_counter()
        if ref is None:
            ref = (ppl, cont)
        agree = agreement(cont, ref[1])
        extra = fmt.stage_bytes() // max(fmt.recent_slots, 1)  # one exact block per sequence
        rows.append({
            "name": fmt.name + ("" if recent or name not in QUANTIZED else " (nothing kept exact)"),
            "base": name, "variant": not recent, "ppl": ppl, "rel": ppl / ref[0] - 1,
            "agree": sum(agree) / len(agree), "agree_each": agree,
            "bytes_tok_layer": fmt.bytes_per_token_per_layer(),
            "seqs_256mb": sequences_in(fmt, 256 * 2**20, 2048, extra),
            "ppl_s": t1 - t0, "greedy_s": t2 - t1, "stage_block": extra,
        })
        print(f"{fmt.name:>44}: ppl {ppl:.4f} ({rows[-1]['rel']:+.4%}), greedy prefix {rows[-1]['agree']:.1f}"
              f" {agree}  [{t1 - t0:.0f}s + {t2 - t1:.0f}s]", flush=True)
    return {"tokens": len(ids), "prompts": len(prompts), "new_tokens": new_tokens, "rows": rows,
            "stage_block": max(r["stage_block"] for r in rows), "diag": diagnose(model, tokenizer, diag_tokens)}


def diagnose(model, tokenizer, tokens: int) -> dict:
    """Perplexity gap to fp32 on the first `tokens` tokens with everything quantized, only the
    keys (V exact), only the values (K exact)."""
    ids = tokenizer.encode(EVAL_TEXT)[:tokens]
    ref = perplexity(model, ids, eval_format(model, "fp32", tokenizer))
    out = {"tokens": len(ids), "rows": {}}
    for name in ("fp8", "q4", "q3"):
        gaps = [perplexity(model, ids, eval_format(model, name, tokenizer, exact=ex)) / ref - 1
                for ex in ("", "v", "k")]
        out["rows"][name] = gaps
        print(f"diagnosis {name}: all {gaps[0]:+.3%}, K only {gaps[1]:+.3%}, V only {gaps[2]:+.3%}", flush=True)
    return out


def verdict(rows: list[dict]) -> list[str]:
    """Per quantized format: what keeping the newest block and the first token exact buys."""
    by = {(r["base"], r["variant"]): r for r in rows}
    lines = []
    for name in QUANTIZED:
        on, off = by[(name, False)], by[(name, True)]
        clear = on["rel"] < 0.8 * off["rel"] and on["agree"] >= off["agree"]
        lines.append(f"- {name}: perplexity gap to fp32 {off['rel']:+.2%} without -> {on['rel']:+.2%} with, "
                     f"greedy prefix {off['agree']:.1f} -> {on['agree']:.1f} of {NEW_TOKENS}: "
                     f"{'clearly helps' if clear else 'does not clearly help'}.")
    return lines


def markdown(res: dict, seconds: float) -> str:
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = [
        "# KV cache formats: quality and memory",
        "",
        f"Generated by `make bench-kv` (bench/kv.py) on {datetime.date.today().isoformat()}: "
        f"{cores} cores ({peers.cpu_name()}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {load:.1f} at the end, {seconds:.0f} s in all.",
        "",
        f"Model: the embedded SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), fp32 weights. "
        f"Perplexity over {res['tokens']} tokens of bench/kv_text.py, teacher-forced in chunks of {CHUNK} "
        f"through {BLOCK}-token blocks; attention reads every key and value back from the format's store "
        f"(fp8 key channel scales and q3 codebooks calibrated first, as the Generator does; q4 / q3 keys "
        f"are per channel per block). Chunks of {CHUNK} tokens: each query sees its own block as a decode "
        f"step does (exact in fp8 / q4 / q3, which keep each sequence's newest block and first token "
        f"exact), older blocks quantized. "
        f"Greedy: {res['prompts']} prompts, {res['new_tokens']} new tokens, mean length of the prefix "
        f"equal to fp32's. Memory: whole blocks, scales included; sequences of 2,048 tokens in 256 MB, "
        f"each with its exact newest block and first token ({res['stage_block'] / 1024:.0f} KiB in fp32) where "
        f"the format keeps them.",
        "",
        "| format | bytes/token/layer | 2,048-token seqs in 256 MB | perplexity | vs fp32 | bound | "
        "within | greedy prefix (of 64) |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for r in res["rows"]:
        bound = BOUNDS[r["base"]]
        shown = not r["variant"] and r["base"] != "fp32"
        within = ("yes" if abs(r["rel"]) <= bound else "NO") if shown else "-"
        out.append(f"| {r['name']} | {r['bytes_tok_layer']:.1f} | {r['seqs_256mb']} | {r['ppl']:.4f} | "
                   f"{r['rel']:+.3%} | {f'{bound:.1%}' if shown else ''} | {within} | {r['agree']:.1f} |")
    d = res["diag"]
    out += [
        "",
        "Per-prompt greedy prefixes: " + "; ".join(f"{r['name']} {r['agree_each']}" for r in res["rows"]),
        "",
        "## Keeping each sequence's newest block (KIVI's residual) and first token (the attention sink) exact",
        "",
        "A block is quantized once its sequence has moved on to the next one, so its key scales see "
        "all its tokens and the nearest tokens are never rounded; the first token, which most heads "
        "attend to, stays exact. Without them (rows \"nothing kept exact\") every write goes "
        "straight to the quantized store.",
        "",
        *verdict(res["rows"]),
        "",
        f"## Where the loss comes from (first {d['tokens']} tokens)",
        "",
        "Perplexity gap to fp32 with the whole cache quantized, only the keys (values exact), only "
        "the values (keys exact):",
        "",
        "| format | K and V | K only | V only |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {a:+.3%} | {k:+.3%} | {v:+.3%} |" for n, (a, k, v) in d["rows"].items()],
        "",
        "Eval seconds per format (perplexity + greedy), on this machine as it was: "
        + ", ".join(f"{r['name']} {r['ppl_s']:.0f}+{r['greedy_s']:.0f}" for r in res["rows"]),
        "",
    ]
    return "\n".join(out)


def decode_speed(rounds: int = 3, context: int = SPEED_CONTEXT, new_tokens: int = SPEED_NEW) -> dict:
    """Batch-1 greedy decode tok/s per KV format (and fp8 / q4 through Model.forward), best of
    `rounds` rounds that each run every setting once. One Generator at a time (an idle engine's
    thread pool would slow the busy one); the model is loaded once and shared."""
    from kvgen.engine.generator import EngineOptions, Generator, load_model
    from kvgen.engine.model_files import embedded_model_path
    from kvgen.engine.sampling import SamplingParams

    model, tok = load_model(embedded_model_path(), "auto")
    prompt = (tok.encode(EVAL_TEXT) * 2)[:context - new_tokens // 2]
    greedy_n = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    settings = [(n, True) for n in SPEED_FORMATS] + [(n, False) for n in SPEED_FORMATS if n != "fp32"]
    best = {s: 0.0 for s in settings}
    fused_seen = {}
    for _ in range(rounds):
        for name, fused in settings:
            g = Generator(model, tok, EngineOptions(kv_dtype=name, prefix_cache=False))
            try:
                if not fused:
                    g.engine.runner.fused = None  # every decode step through Model.forward
                fused_seen[name, fused] = g.engine.runner.fused is not None
                g.generate(prompt[:64], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
                per_token = []
                last = None
                for ev in g.generate_stream(prompt, greedy_n):
                    now = time.perf_counter()
                    if last is not None and ev.token_ids:
                        per_token += [(now - last) / len(ev.token_ids)] * len(ev.token_ids)
                    last = now
            finally:
                g.close()
            # the median step: a shared machine's stalls (another process, a stopped one) hit a few
            # steps, not the median, so rounds agree far better than with the mean
            best[name, fused] = max(best[name, fused], 1 / statistics.median(per_token))
    return {"weights": model.weight_dtype, "prompt": len(prompt), "new_tokens": new_tokens, "rounds": rounds,
            "best": best, "fused": fused_seen}


def speed_markdown(sp: dict) -> str:
    base = sp["best"]["fp32", True]
    out = [SPEED_HEADING, "",
           "Batch-1 greedy decode (tok/s = 1 / the median time between streamed tokens) with the default "
           f"weights (WEIGHT_DTYPE=auto: {sp['weights']}), a "
           f"{sp['prompt']}-token prompt and {sp['new_tokens']} new tokens (context {sp['prompt']} to "
           f"{sp['prompt'] + sp['new_tokens']}), each KV format as the Generator builds it (fp8 / q4: key scales "
           f"fitted, newest block and first token exact); best of {sp['rounds']} rounds that interleave the "
           f"settings, in one process on {len(os.sched_getaffinity(0))} cores ({peers.cpu_name()}). Goal "
           f"(issue 19): fp8 and q4 >= {SPEED_GOAL:.2f}x fp32.", "",
           "| KV format | decode step | tok/s | vs fp32 | goal met |", "|---|---|---:|---:|:---:|"]
    for (name, fused), tps in sp["best"].items():
        step = "fused (one Numba call)" if sp["fused"][name, fused] else "Model.forward"
        goal = ("yes" if tps >= SPEED_GOAL * base else "NO") if fused and name != "fp32" else ""
        out.append(f"| {name} | {step} | {tps:.1f} | {tps / base:.2f}x | {goal} |")
    return "\n".join(out) + "\n"


def splice_speed(text: str, section: str) -> str:
    """text with its decode-speed section replaced by section (appended when it has none)."""
    start = text.find(SPEED_HEADING)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section
    end = text.find("\n## ", start + len(SPEED_HEADING))
    return text[:start] + section + (text[end:] if end >= 0 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="evaluate only the first N tokens")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="greedy tokens per prompt")
    ap.add_argument("--diag-tokens", type=int, default=DIAG_TOKENS, help="tokens of the K/V diagnosis")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--speed", action="store_true", help="only the decode speed section (spliced into --out)")
    ap.add_argument("--speed-rounds", type=int, default=3)
    ap.add_argument("--compress", action="store_true", help="only the KV_COMPRESS section (spliced into --out)")
    ap.add_argument("--compress-new", type=int, default=32, help="greedy tokens at 2k for --compress")
    ap.add_argument("--compress-long-new", type=int, default=32, help="greedy tokens at 8k for --compress")
    args = ap.parse_args()
    if args.compress:
        from bench import kv_compress
        from kvgen.engine.generator import load_model
        from kvgen.engine.model_files import embedded_model_path

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        model, tokenizer = load_model(embedded_model_path(), "fp32")
        res = kv_compress.run(model, tokenizer, EVAL_TEXT, args.tokens, args.compress_new, 64,
                              args.compress_long_new)
        section = kv_compress.markdown(res)
        old = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(kv_compress.splice(old, section))
        print(section)
        return
    if args.speed:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        section = speed_markdown(decode_speed(args.speed_rounds))
        old = args.out.read_text() if args.out.exists() else ""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(splice_speed(old, section))
        print(section)
        return
    from kvgen.engine.generator import load_model
    from kvgen.engine.model_files import embedded_model_path

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    model, tokenizer = load_model(embedded_model_path(), "fp32")
    res = run(model, tokenizer, args.tokens, args.new_tokens, args.diag_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(res, time.perf_counter() - t0))
    # The speed section in a process of its own: run here after the perplexity evaluation's torch
    # work, decode measured half what a fresh process measures (fp32 KV 62 against 114 tok/s).
    subprocess.run([sys.executable, __file__, "--speed", "--out", str(args.out),
                    "--speed-rounds", str(args.speed_rounds)], check=True)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
