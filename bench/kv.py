"""KV cache storage formats: quality and memory, on the embedded SmolLM2-135M. Writes bench/results/kv.md.

Method
- Perplexity: teacher forcing over EVAL_TEXT (bench/kv_text.py) in prefill chunks of 16
  tokens through a paged cache of the format under test, logits for every row of every chunk.
  The model writes each chunk's K/V into the store and attention reads every key and value
  back from it, so each prediction sees the quantized cache exactly as serving would.
- Greedy agreement: the prompts of kv_text.PROMPTS are prefilled together, then decoded
  greedily (64 new tokens, EOS ignored) in one batch; per prompt, the length of the prefix
  that agrees with fp32, averaged.
- q3 codebooks are fitted first, as the Generator does (kvgen.engine.kv.calibrate).
- "recent block fp32": KIVI keeps the newest tokens in full precision and quantizes them
  only once a group is full. Emulated here without touching the engine: every block written
  by the latest step (each sequence's newest block) is read from an fp32 shadow copy, older
  blocks from the quantized store. With 16-token chunks on 16-token blocks this is exactly what
  decode with such a residual would see.

Run: `make bench-kv` (or .venv/bin/python bench/kv.py [--tokens N]).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.kv_text import EVAL_TEXT, PROMPTS  # noqa: E402
from kvgen.engine.attention import Step  # noqa: E402
from kvgen.engine.kv.calibrate import calibrate_format  # noqa: E402
from kvgen.engine.kv.formats import KV_DTYPES, KVFormat, make_format  # noqa: E402

BLOCK = 16
CHUNK = 16
NEW_TOKENS = 64
# Relative perplexity increase over fp32 that issue 4 accepts per format.
BOUNDS = {"fp32": 0.0, "fp16": 0.001, "bf16": 0.001, "fp8": 0.01, "q4": 0.05, "q3": 0.10}
RESULTS = Path(__file__).resolve().parent / "results" / "kv.md"


class Emulated(KVFormat):
    """A quantized format with parts of its cache read from an fp32 shadow of every write, to
    measure layouts the engine does not have without building them:

    recent_fp32    the blocks of the latest write (the block each sequence of the step is
                   filling) are exact; a block drops to its quantized copy as soon as a write
                   lands elsewhere (KIVI's full-precision residual).
    exact          "k" or "v": that half is always exact (which half carries the loss?).
    channel_k_bits keys of the other blocks are quantized uniformly with this many bits and one
                   float16 scale per block, head and channel (KIVI's key layout) instead of the
                   format's own key layout. Needs recent_fp32: a block is quantized only once
                   full, so its scales never depend on tokens a query must not see.
    Memory is reported as the quantized format's (plus one fp32 block per sequence, by the caller).
    """

    def __init__(self, inner: KVFormat, recent_fp32: bool = False, exact: str = "",
                 channel_k_bits: int = 0):
        super().__init__(inner.num_layers, inner.block_size, inner.num_kv_heads, inner.head_dim,
                         inner.compute_dtype)
        if channel_k_bits and not recent_fp32:
            raise ValueError("per-channel keys are emulated with the recent block in fp32 only")
        self.inner, self.recent_fp32, self.exact, self.channel_k_bits = inner, recent_fp32, exact, channel_k_bits
        self.qk_scale = inner.qk_scale  # the model equalises keys for the inner format
        parts = [inner.name]
        if channel_k_bits:
            parts.append(f"{channel_k_bits}-bit per-channel K")
        if recent_fp32:
            parts.append("recent block fp32")
        if exact:
            parts.append(f"{exact.upper()} exact")
        self.name = " + ".join(parts)
        self.shadow = make_format("fp32", inner.num_layers, inner.block_size, inner.num_kv_heads,
                                  inner.head_dim, compute_dtype=inner.compute_dtype)
        self._recent = torch.empty(0, dtype=torch.long)

    def allocate(self, num_blocks, device="cpu"):
        store = self.inner.allocate(num_blocks, device)
        store["shadow"] = self.shadow.allocate(num_blocks, device)["kv"]
        return store

    def write(self, store, layer, blocks, offsets, k, v):
        self.inner.write(store, layer, blocks, offsets, k, v)
        self.shadow.write({"kv": store["shadow"]}, layer, blocks, offsets, k, v)
        self._recent = torch.unique(blocks)

    def read(self, store, layer, block_ids):
        k, v = self.inner.read(store, layer, block_ids)
        sk, sv = self.shadow.read({"kv": store["shadow"]}, layer, block_ids)
        if self.channel_k_bits:
            k = _per_channel(sk, self.channel_k_bits)
        if self.exact == "k":
            k = sk
        if self.exact == "v":
            v = sv
        if self.recent_fp32:
            recent = torch.isin(block_ids, self._recent)[:, None, None, None]
            k, v = torch.where(recent, sk, k), torch.where(recent, sv, v)
        return k, v

    def bytes_per_block(self):
        return self.inner.bytes_per_block()


def _per_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric uniform quantize-dequantize of x [M, block, KVH, HD] with an absmax scale per
    block, head and channel (over the block's tokens)."""
    qmax = 2 ** (bits - 1) - 1
    s = (x.abs().amax(1, keepdim=True) / qmax).half().float()
    pos = s > 0
    return torch.where(pos, torch.round(x / torch.where(pos, s, 1.0)).clamp(-qmax - 1, qmax) * s, 0.0)


def eval_format(model, name: str, tokenizer, **emulate) -> KVFormat:
    """The format as the engine builds it (q3 calibrated, as the Generator does), optionally
    wrapped in an Emulated layout (keyword arguments of Emulated)."""
    cfg = model.cfg
    fmt = make_format(name, cfg.num_layers, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                      compute_dtype=model.act_dtype)
    calibrate_format(model, fmt, tokenizer)
    return Emulated(fmt, **emulate) if emulate else fmt


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


RESIDUAL = {"recent_fp32": True}
KIVI = {"recent_fp32": True, "channel_k_bits": 0}  # bits filled in per format
VARIANTS = ([(n, {}) for n in KV_DTYPES if n != "auto"] + [(n, RESIDUAL) for n in ("q4", "q3")]
            + [(n, {**KIVI, "channel_k_bits": b}) for n, b in (("q4", 4), ("q3", 3))])
DIAG_TOKENS = 512  # the which-half-loses diagnosis runs on the start of the text only


def run(model, tokenizer, tokens: int | None = None, new_tokens: int = NEW_TOKENS,
        diag_tokens: int = DIAG_TOKENS) -> dict:
    ids = tokenizer.encode(EVAL_TEXT)[:tokens]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows = []
    ref = None
    for name, emulate in VARIANTS:
        fmt = eval_format(model, name, tokenizer, **emulate)
        t0 = time.perf_counter()
        ppl = perplexity(model, ids, fmt)
        t1 = time.perf_counter()
        cont = greedy(model, prompts, fmt, new_tokens)
        t2 = time.perf_counter()
        if ref is None:
            ref = (ppl, cont)
        agree = agreement(cont, ref[1])
        extra = fmt.shadow.bytes_per_block() if emulate.get("recent_fp32") else 0
        rows.append({
            "name": fmt.name, "base": name, "emulated": bool(emulate), "ppl": ppl, "rel": ppl / ref[0] - 1,
            "agree": sum(agree) / len(agree), "agree_each": agree,
            "bytes_tok_layer": fmt.bytes_per_token_per_layer(),
            "seqs_256mb": sequences_in(fmt, 256 * 2**20, 2048, extra),
            "ppl_s": t1 - t0, "greedy_s": t2 - t1, "shadow_block": extra,
        })
        print(f"{fmt.name:>44}: ppl {ppl:.4f} ({rows[-1]['rel']:+.4%}), greedy prefix {rows[-1]['agree']:.1f}"
              f" {agree}  [{t1 - t0:.0f}s + {t2 - t1:.0f}s]", flush=True)
    cfg = model.cfg
    # What the emulated layouts would add: an fp32 block per sequence; per-channel key scales
    # (float16 per block, head, channel) in place of per-token group scales (per token, head, group).
    shadow = max(r["shadow_block"] for r in rows)
    chan_scales = cfg.num_kv_heads * cfg.head_dim * 2 / BLOCK - cfg.num_kv_heads * (cfg.head_dim // 32) * 2
    return {"tokens": len(ids), "prompts": len(prompts), "new_tokens": new_tokens, "rows": rows,
            "shadow_block": shadow, "chan_scales": chan_scales, "layers": cfg.num_layers,
            "diag": diagnose(model, tokenizer, diag_tokens)}


def diagnose(model, tokenizer, tokens: int) -> dict:
    """Perplexity gap to fp32 on the first `tokens` tokens with everything quantized, only the
    keys (V exact), only the values (K exact)."""
    ids = tokenizer.encode(EVAL_TEXT)[:tokens]
    ref = perplexity(model, ids, eval_format(model, "fp32", tokenizer))
    out = {"tokens": len(ids), "rows": {}}
    for name in ("fp8", "q4", "q3"):
        gaps = [perplexity(model, ids, eval_format(model, name, tokenizer, **em)) / ref - 1
                for em in ({}, {"exact": "v"}, {"exact": "k"})]
        out["rows"][name] = gaps
        print(f"diagnosis {name}: all {gaps[0]:+.3%}, K only {gaps[1]:+.3%}, V only {gaps[2]:+.3%}", flush=True)
    return out


def verdict(rows: list[dict]) -> list[str]:
    """Per quantized format: does the fp32 recent block, and KIVI's layout, clearly help?"""
    by = {}
    for r in rows:
        by.setdefault(r["base"], []).append(r)
    lines = []
    for name in ("q4", "q3"):
        plain, *emulated = by[name]
        for e in emulated:
            clear = e["rel"] < 0.5 * plain["rel"] and e["agree"] >= plain["agree"]
            lines.append(f"- {e['name']}: perplexity gap to fp32 {plain['rel']:+.2%} -> {e['rel']:+.2%}, "
                         f"greedy prefix {plain['agree']:.1f} -> {e['agree']:.1f} of {NEW_TOKENS}: "
                         f"{'clearly helps' if clear else 'does not clearly help'}"
                         f"{'' if e['rel'] <= BOUNDS[name] else f', still outside the {BOUNDS[name]:.0%} bound'}.")
    return lines


def markdown(res: dict, seconds: float) -> str:
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = [
        "# KV cache formats: quality and memory",
        "",
        f"Generated by `make bench-kv` (bench/kv.py) on {datetime.date.today().isoformat()}: "
        f"{cores} cores ({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {load:.1f} at the end, {seconds:.0f} s in all.",
        "",
        f"Model: the embedded SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), fp32 weights. "
        f"Perplexity over {res['tokens']} tokens of bench/kv_text.py, teacher-forced in chunks of {CHUNK} "
        f"through {BLOCK}-token blocks; attention reads every key and value back from the format's store "
        f"(key channel scales of fp8/q4/q3 and the q3 codebooks calibrated first, as the Generator does). "
        f"Greedy: {res['prompts']} prompts, {res['new_tokens']} new tokens, mean length of the prefix "
        f"equal to fp32's. Memory: whole blocks, scales included; sequences of 2,048 tokens in 256 MB.",
        "",
        "| format | bytes/token/layer | 2,048-token seqs in 256 MB | perplexity | vs fp32 | bound | "
        "within | greedy prefix (of 64) |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for r in res["rows"]:
        bound = BOUNDS[r["base"]]
        shown = not r["emulated"] and r["base"] != "fp32"
        within = ("yes" if abs(r["rel"]) <= bound else "NO") if shown else "-"
        out.append(f"| {r['name']} | {r['bytes_tok_layer']:.1f} | {r['seqs_256mb']} | {r['ppl']:.4f} | "
                   f"{r['rel']:+.3%} | {f'{bound:.1%}' if shown else ''} | {within} | {r['agree']:.1f} |")
    d = res["diag"]
    out += [
        "",
        "Per-prompt greedy prefixes: " + "; ".join(f"{r['name']} {r['agree_each']}" for r in res["rows"]),
        "",
        "## Emulated layouts: recent block in fp32 (KIVI's residual) and KIVI's per-channel keys",
        "",
        "Not in the engine; read from an fp32 shadow of every write (bench/kv.py `Emulated`). "
        "\"recent block fp32\": each sequence's filling block is exact and is quantized once full; "
        f"cost one fp32 block per sequence ({res['shadow_block'] / 1024:.0f} KiB here, all layers), counted in "
        "the 256 MB column. \"per-channel K\": full blocks' keys quantized uniformly with one float16 "
        "scale per block, head and channel instead of per token and group of 32; values stay as the "
        f"format has them. Bytes listed are the format's; per-channel key scales would add "
        f"{res['chan_scales']:.0f} B/token/layer at {BLOCK}-token blocks.",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="evaluate only the first N tokens")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="greedy tokens per prompt")
    ap.add_argument("--diag-tokens", type=int, default=DIAG_TOKENS, help="tokens of the K/V diagnosis")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    from kvgen.engine.generator import load_model
    from kvgen.engine.loader import embedded_model_path

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    model, tokenizer = load_model(embedded_model_path(), "fp32")
    res = run(model, tokenizer, args.tokens, args.new_tokens, args.diag_tokens)
    text = markdown(res, time.perf_counter() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
