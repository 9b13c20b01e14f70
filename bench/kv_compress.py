"""KV_COMPRESS quality and memory (kvgen/engine/kv/compress.py), on the embedded SmolLM2-135M:
the section "Compressed KV" of bench/results/kv.md (`python bench/kv.py --compress`).

Everything runs Model.forward on the torch attention path over a real PagedKVCache that the
engine's own KVCompressor compresses after every chunk, as the engine does after every step.
- KV bytes per token: blocks held at the end / tokens, times the fp32 block's bytes.
- Perplexity: teacher forcing over the bench's long text (kv_text.EVAL_TEXT) in chunks.
- Greedy agreement: a prompt of 2k (the text) and 8k positions (the text four times: the
  embedded model's context is 8192), greedy continuation with and without compression, the
  length of the common prefix.
- Proxy check: at the 2k prompt, the real attention of the last 32 prompt queries (SnapKV's
  observation window), recorded on the torch path, against the rows sink-heavy keeps: the share of
  that attention which falls on the kept rows of each compressed chunk, next to what the best
  possible half (the real top rows) and every other row (a blind half, as mean pooling's grid) hold.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgen.engine.attention import Step, TorchAttention
from kvgen.engine.kv.compress import CHUNK_BLOCKS, KVCompressor
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool

HEADING = "## Compressed KV (KV_COMPRESS)"
BLOCK = 16
WINDOW = 256
METHODS = [("off", 0.5), ("mean", 0.5), ("sink-heavy", 0.5), ("sink-heavy", 0.25)]
FORMATS = ("fp8", "q4", "q3")  # bench/kv.py's quantized KV formats, measured at 8k too for comparison
LONG = 8192  # positions of the long measurements
LONG_HEADING = "### Perplexity at 8k positions"
# The 8k table's rows, by the names --rows takes: each method at its ratio, then each format
LONG_ROWS = [*(m if m == "off" else f"{m}:{r:g}" for m, r in METHODS), *FORMATS]
# Every measured 8k row, kept between runs so that a run of some rows (2982 s for all but q3) replaces
# those and keeps the rest; the table is made from it.
LONG_JSON = Path(__file__).resolve().parent / "results" / "kv_long.json"
# off is every run's reference: a kept row is comparable only when this run's off equals the one it
# was measured beside, to the table's 4 decimals (fp32 perplexity moves only with the order of sums,
# e.g. another thread count; a change to the model or the text moves it far more).
SAME_OFF = 1e-4


def _table(model, tokens: int) -> PagedKVCache:
    cfg = model.cfg
    fmt = make_format("fp32", cfg.num_layers, BLOCK, cfg.num_kv_heads, cfg.head_dim, compute_dtype=model.act_dtype)
    return PagedKVCache(BlockPool(fmt, -(-tokens // BLOCK) + 4))


def _step(table: PagedKVCache, n: int, all_rows: bool) -> Step:
    """The step ModelRunner._forward builds for one sequence of n new tokens."""
    start = table.length
    blocks, offsets = table.slots(start, n)
    return Step(positions=torch.arange(start, start + n), write_blocks=blocks, write_offsets=offsets,
                query_lens=[n], context_lens=[start + n], block_tables=torch.tensor([table.live_blocks]),
                logits_rows=torch.arange(n) if all_rows else torch.tensor([n - 1]), is_decode=n == 1,
                kv_starts=[table.kv_start] if table.kv_start else None)


def _feed(model, table, comp, ids: torch.Tensor, all_rows: bool, backend=None) -> torch.Tensor:
    table.reserve(len(ids))
    logits = model.forward(ids, _step(table, len(ids), all_rows), table.pool.fmt, table.pool.store,
                           *(() if backend is None else (backend,)))
    table.advance(len(ids))
    if comp is not None and comp.due(table):
        comp.compress(table)
    return logits


def _compressor(method: str, ratio: float) -> KVCompressor | None:
    return None if method == "off" else KVCompressor(method, WINDOW, ratio)


def perplexity(model, ids: list[int], method: str, ratio: float, chunk: int) -> tuple[float, float]:
    """(perplexity, fp32 KV bytes per token held at the end)."""
    nll, bpt = token_nll(model, ids, method, ratio, chunk)
    return math.exp(nll.mean().item()), bpt


@torch.inference_mode()
def token_nll(model, ids: list[int], method: str, ratio: float, chunk: int) -> tuple[torch.Tensor, float]:
    """(NLL of each of ids[1:] given what precedes it, fp32 KV bytes per token held at the end)."""
    table, comp = _table(model, len(ids)), _compressor(method, ratio)
    x = torch.tensor(ids)
    nll = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        logits = _feed(model, table, comp, x[start:end], True)
        nll.append(F.cross_entropy(logits, x[start + 1:end + 1], reduction="none"))
    bpt = -(-table.rows // BLOCK) * table.pool.fmt.bytes_per_block() / table.length
    return torch.cat(nll), bpt


@torch.inference_mode()
def format_nll(model, tokenizer, ids: list[int], name: str, chunk: int) -> torch.Tensor:
    """NLL of each of ids[1:] through a KV format as the Generator builds it (bench/kv.py's
    eval_format: calibrated, newest block and first token exact), uncompressed."""
    from bench import kv

    fmt = kv.eval_format(model, name, tokenizer)
    n_blocks = -(-len(ids) // fmt.block_size)
    store, table, x = fmt.allocate(n_blocks), torch.arange(n_blocks)[None], torch.tensor(ids)
    nll = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        logits = model.forward(x[start:end], kv._step([(start, end - start)], table, fmt.block_size, True), fmt, store)
        nll.append(F.cross_entropy(logits, x[start + 1:end + 1], reduction="none"))
    return torch.cat(nll)


def long_ids(tokenizer, text: str) -> list[int]:
    """8k positions of text: the bench's text four times (the embedded model's context is 8192)."""
    return (tokenizer.encode(text) * 4)[:LONG]


def long_row(name: str) -> tuple[str, float | None]:
    """(method, ratio) of a LONG_ROWS name: a KV_COMPRESS method at a ratio, or (format, None)."""
    if name in FORMATS:
        return name, None
    method, _, ratio = name.partition(":")
    return method, dict(METHODS)[method] if method == "off" else float(ratio)


def long_key(row: dict) -> str:
    """The LONG_ROWS name of a measured row."""
    if row["ratio"] is None or row["method"] == "off":
        return row["method"]
    return f"{row['method']}:{row['ratio']:g}"


def run_long(model, tokenizer, text: str, chunk: int = 64, rows=LONG_ROWS) -> dict:
    """Perplexity at 8k positions, per KV_COMPRESS method and per quantized format (the LONG_ROWS
    named in rows; off always, first: it is the reference): over all positions, and over those past
    the text's first copy (the model can copy them from its context, so they show what a method
    loses of older content)."""
    ids = long_ids(tokenizer, text)
    first = len(tokenizer.encode(text)) - 1  # targets ids[1:first + 1] are the first copy's
    out, t0 = [], time.perf_counter()
    for name, ratio in map(long_row, ["off", *(r for r in LONG_ROWS if r in rows and r != "off")]):
        t = time.perf_counter()
        if ratio is None:
            nll, bpt = format_nll(model, tokenizer, ids, name, chunk), None
        else:
            nll, bpt = token_nll(model, ids, name, ratio, chunk)
        out.append({"method": name, "ratio": ratio, "ppl": math.exp(nll.mean().item()), "bpt": bpt,
                    "ppl_first": math.exp(nll[:first].mean().item()), "ppl_rest": math.exp(nll[first:].mean().item()),
                    "s": time.perf_counter() - t})
        print(out[-1], flush=True)
    return {"rows": out, "tokens": len(ids), "first": first, "chunk": chunk, "seconds": time.perf_counter() - t0}


def long_settings(res: dict) -> dict:
    """What makes two runs' rows comparable: the text's positions, its first copy, chunks, window, blocks."""
    return {"tokens": res["tokens"], "first": res["first"], "chunk": res["chunk"], "window": WINDOW, "block": BLOCK}


def merge_long(old: dict | None, res: dict, when: str) -> tuple[dict, list[str]]:
    """(the sidecar with run_long's result `res`, run at `when`, merged in; the names of its rows dropped).
    The run's rows replace those of the same name; the others stay when they were measured with the
    same settings beside an off equal to this run's (SAME_OFF), else they are dropped (to rerun)."""
    settings = long_settings(res)
    rows = {long_key(r): {**r, "run": when} for r in res["rows"]}
    runs = {when: {"seconds": round(res["seconds"]), "rows": list(rows)}}
    dropped = []
    if old is not None:
        off, old_off = rows["off"], old["rows"].get("off")
        same = old["settings"] == settings and old_off is not None and all(
            abs(off[k] - old_off[k]) <= SAME_OFF for k in ("ppl", "ppl_first", "ppl_rest"))
        for name, r in old["rows"].items():
            if name in rows:
                continue
            if same:
                rows[name] = r
                runs.setdefault(r["run"], old["runs"][r["run"]])
            else:
                dropped.append(name)
    order = {name: i for i, name in enumerate(LONG_ROWS)}
    rows = dict(sorted(rows.items(), key=lambda kv: order.get(kv[0], len(order))))
    return {"settings": settings, "runs": dict(sorted(runs.items())), "rows": rows}, dropped


def greedy(model, prompt: list[int], method: str, ratio: float, new: int, chunk: int) -> tuple[list[int], float]:
    """(greedy continuation, fp32 KV bytes per token held at the end)."""
    table, comp = _table(model, len(prompt) + new), _compressor(method, ratio)
    x = torch.tensor(prompt)
    for start in range(0, len(prompt), chunk):
        logits = _feed(model, table, comp, x[start:start + chunk], False)
    out = [int(logits[-1].argmax())]
    for _ in range(new - 1):
        out.append(int(_feed(model, table, comp, torch.tensor(out[-1:]), False)[-1].argmax()))
    bpt = -(-table.rows // BLOCK) * table.pool.fmt.bytes_per_block() / table.length
    return out, bpt


class Recorder(TorchAttention):
    """The torch attention, which also keeps the last `last` queries' softmax over every key
    (layer -> [heads, keys]): the real scores SnapKV selects by."""

    def __init__(self, last: int):
        self.last, self.scores = last, {}

    def write_and_attend(self, fmt, store, layer, q, k, v, step):
        out = super().write_and_attend(fmt, store, layer, q, k, v, step)
        keys, _ = fmt.read(store, layer, step.block_tables[0])
        n = step.context_lens[0]
        keys = keys.reshape(-1, *keys.shape[2:])[:n].float()  # [n, KVH, D]
        qs = q[-self.last:].float()  # [last, H, D]
        group = qs.shape[1] // keys.shape[1]
        kk = keys.repeat_interleave(group, dim=1)  # [n, H, D]
        s = torch.einsum("qhd,nhd->hqn", qs, kk) / math.sqrt(qs.shape[-1])
        pos = step.positions[-self.last:]
        s = s.masked_fill(torch.arange(n)[None, None, :] > pos[None, :, None], float("-inf"))
        self.scores[layer] = torch.softmax(s, -1).mean(1)  # [H, n]: mean over the observation queries
        return out


def proxy_check(model, ids: list[int]) -> dict:
    """Share of the real attention of the last 32 queries (per layer and query head, grouped to
    KV heads) on the rows sink-heavy keeps of each 64-row chunk before the window, vs the real top
    half and a blind half (every other row)."""
    table = _table(model, len(ids))
    rec = Recorder(32)
    table.reserve(len(ids))
    model.forward(torch.tensor(ids), _step(table, len(ids), False), table.pool.fmt, table.pool.store, rec)
    table.advance(len(ids))
    fmt, chunk = table.pool.fmt, CHUNK_BLOCKS * BLOCK
    end = (len(ids) - WINDOW) // chunk * chunk
    kept = best = blind = 0.0
    total = 0.0
    for layer in range(model.cfg.num_layers):
        k, _ = fmt.read(table.pool.store, layer, torch.tensor(table.blocks))
        k = k.reshape(-1, *k.shape[2:])
        a = rec.scores[layer]  # [H, n]
        kvh = k.shape[1]
        a = a.reshape(kvh, -1, a.shape[-1]).sum(1)  # [KVH, n]: the group's attention per KV head
        for at in range(0, end, chunk):
            part, att = k[at:at + chunk], a[:, at:at + chunk]  # [64, KVH, D], [KVH, 64]
            score = -part.float().norm(dim=-1)
            if at == 0:
                score[:4] = float("inf")
            pick = score.topk(chunk // 2, dim=0).indices  # [32, KVH]
            kept += att.gather(1, pick.T).sum().item()
            best += att.topk(chunk // 2, dim=1).values.sum().item()
            blind += att[:, 1::2].sum().item()
            total += att.sum().item()
    return {"kept": kept / total, "best": best / total, "blind": blind / total, "rows": end, "tokens": len(ids)}


def run(model, tokenizer, text: str, tokens: int | None, new: int, chunk: int, long_new: int) -> dict:
    ids = tokenizer.encode(text)
    ppl_ids = ids[:tokens]
    ids8 = (ids * 4)[:LONG - long_new]
    rows, ref = [], {}
    t0 = time.perf_counter()
    for method, ratio in METHODS:
        t = time.perf_counter()
        ppl, bpt = perplexity(model, ppl_ids, method, ratio, chunk)
        g2, bpt2 = greedy(model, ids[:2048 - new], method, ratio, new, 256)
        g8, bpt8 = greedy(model, ids8, method, ratio, long_new, 512)
        if method == "off":
            ref = {"ppl": ppl, "g2": g2, "g8": g8}
        rows.append({"method": method, "ratio": ratio, "ppl": ppl, "rel": ppl / ref["ppl"] - 1, "bpt": bpt,
                     "bpt2": bpt2, "bpt8": bpt8, "agree2": _agree(g2, ref["g2"]), "agree8": _agree(g8, ref["g8"]),
                     "s": time.perf_counter() - t})
        print(rows[-1], flush=True)
    proxy = proxy_check(model, ids[:2048])
    print(proxy, flush=True)
    return {"rows": rows, "proxy": proxy, "tokens": len(ppl_ids), "new": new, "long_new": long_new,
            "long": len(ids8), "chunk": chunk, "seconds": time.perf_counter() - t0}


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def markdown(res: dict) -> str:
    p = res["proxy"]
    out = [HEADING, "",
           f"`python bench/kv.py --compress`: the embedded SmolLM2-135M, fp32 weights and KV, torch attention "
           f"(Model.forward over a PagedKVCache the engine's KVCompressor compresses after every chunk), "
           f"KV_COMPRESS_WINDOW={WINDOW}, blocks of {BLOCK}, {CHUNK_BLOCKS}-block chunks. Perplexity: "
           f"{res['tokens']} tokens of bench/kv_text.py teacher-forced in chunks of {res['chunk']}. Greedy: "
           f"the longest common prefix with the uncompressed cache's continuation, {res['new']} new tokens "
           f"after a {2048 - res['new']}-token prompt (to 2k positions) and {res['long_new']} after a "
           f"{res['long']}-token one (the text four times, to 8k positions). One run, one prompt each: "
           f"a short run on a shared 2-core machine ({res['seconds']:.0f} s). Bytes per token: fp32 blocks "
           "held at the end / tokens, all layers (the fp32 rows above are per layer: x 30 layers).", "",
           "| method | rows kept | KV bytes/token at 2k | at 8k | vs off (8k) | perplexity | vs off "
           "| greedy prefix at 2k | at 8k |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    off = res["rows"][0]
    for r in res["rows"]:
        kept = "all" if r["method"] == "off" else f"{r['ratio']:g}"
        out.append(f"| {r['method']} | {kept} | {r['bpt2']:,.0f} | {r['bpt8']:,.0f} | {r['bpt8'] / off['bpt8']:.2f}x "
                   f"| {r['ppl']:.4f} | {r['rel']:+.2%} | {r['agree2']} of {res['new']} "
                   f"| {r['agree8']} of {res['long_new']} |")
    out += ["", f"Sink-heavy's proxy against the real scores: of the attention the last 32 queries of a "
                f"{p['tokens']}-token prompt give the {p['rows']} rows before the window (torch path, every "
                f"layer and KV head, per 64-row chunk), the rows it keeps (lowest key norm, plus 4 sinks) hold "
                f"{p['kept']:.1%}; the real top half would hold {p['best']:.1%}, a blind half (every other row) "
                f"{p['blind']:.1%}.", ""]
    return "\n".join(out)


def splice(text: str, section: str) -> str:
    """text with the compressed-KV section replaced (inserted before the speed section when absent)."""
    start = text.find(HEADING)
    if start < 0:
        at = text.find("\n## Decode speed")
        return text + "\n" + section if at < 0 else text[:at + 1] + section + "\n" + text[at + 1:]
    end = text.find("\n## ", start + len(HEADING))
    old = text[start:end] if end >= 0 else text[start:]
    if LONG_HEADING in old and LONG_HEADING not in section:  # the 8k run (--long) is kept until rerun
        section = section.rstrip("\n") + "\n\n" + old[old.find(LONG_HEADING):].rstrip("\n") + "\n"
    return text[:start] + section + (text[end:] if end >= 0 else "")


def markdown_long(data: dict) -> str:
    """The 8k perplexity table, a subsection of the compressed-KV section, from the sidecar (merge_long)."""
    rows, cfg = data["rows"], data["settings"]
    off = rows["off"]
    runs = [f"{when}: {', '.join(run['rows'])} ({run['seconds']} s)" for when, run in data["runs"].items()]
    if len(runs) == 1:
        how = (f"One run on a shared 2-core machine ({next(iter(data['runs'].values()))['seconds']} s; "
               "perplexity is not a timing, noise does not move it).")
    else:
        how = (f"Rows from {len(runs)} runs on a shared 2-core machine (`--rows` reruns some, "
               "bench/results/kv_long.json keeps the others; off, the reference, runs in each and agrees to 4 "
               f"decimals): {'; '.join(runs)}. Perplexity is not a timing, noise does not move it.")
    out = [LONG_HEADING, "",
           f"`python -m bench.kv_compress --long`: {cfg['tokens']} positions, bench/kv_text.py's text four times "
           f"(the first copy: the first {cfg['first']} targets), teacher-forced in chunks of {cfg['chunk']} (each "
           "chunk compressed after it, as the engine compresses after every step); the same model, window and "
           "chunks as above. The quantized formats (uncompressed, as bench/kv.py builds them: calibrated, newest "
           "block and first token exact) go through the same chunks. Past the first copy the model can copy "
           "the text from its context, so that column shows what a cache loses of older content. " + how,
           "",
           "| cache | perplexity at 8k | vs off | first copy (to ~2k) | vs off | past it (~2k to 8k) | vs off |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows.values():
        name = r["method"] if r["ratio"] is None else (
            "off (fp32)" if r["method"] == "off" else f"{r['method']} {r['ratio']:g}")
        out.append(f"| {name} | {r['ppl']:.4f} | {r['ppl'] / off['ppl'] - 1:+.2%} | {r['ppl_first']:.4f} "
                   f"| {r['ppl_first'] / off['ppl_first'] - 1:+.2%} | {r['ppl_rest']:.4f} "
                   f"| {r['ppl_rest'] / off['ppl_rest'] - 1:+.2%} |")
    missing = [name for name in LONG_ROWS if name not in rows]
    if missing:
        out += ["", f"Not measured at 8k: {', '.join(missing)} (to measure: `--rows {','.join(missing)}`)."]
    return "\n".join(out) + "\n"


def splice_long(text: str, sub: str) -> str:
    """text with the 8k perplexity subsection replaced (added at the end of the compressed-KV
    section when absent)."""
    start = text.find(LONG_HEADING)
    if start >= 0:
        end = text.find("\n## ", start)
        nxt = text.find("\n### ", start + len(LONG_HEADING))
        end = min(e for e in (end, nxt, len(text)) if e >= 0)
        return text[:start] + sub + text[end:]
    at = text.find(HEADING)
    end = text.find("\n## ", at + len(HEADING)) if at >= 0 else -1
    if end < 0:
        return text.rstrip("\n") + "\n\n" + sub
    return text[:end + 1] + sub + text[end:]


def main() -> None:
    import argparse
    import json
    import os

    from bench.kv import RESULTS
    from bench.kv_text import EVAL_TEXT
    from kvgen.engine.generator import load_model
    from kvgen.engine.model_files import embedded_model_path

    ap = argparse.ArgumentParser(description="KV_COMPRESS quality at 8k positions (the rest: bench/kv.py --compress)")
    ap.add_argument("--long", action="store_true", help="perplexity at 8k positions, spliced into --out")
    ap.add_argument("--rows", default=",".join(LONG_ROWS),
                    help=f"rows to (re)measure, of {','.join(LONG_ROWS)} (off always runs: the reference); "
                         "--json keeps the others")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--json", type=Path, default=LONG_JSON, help="every measured row, merged run by run")
    args = ap.parse_args()
    if not args.long:
        ap.error("nothing to do: --long (the rest of the section: python bench/kv.py --compress)")
    rows = [r for r in args.rows.split(",") if r]
    if unknown := [r for r in rows if r not in LONG_ROWS]:
        ap.error(f"--rows: unknown {', '.join(unknown)} (of {', '.join(LONG_ROWS)})")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model, tokenizer = load_model(embedded_model_path(), "fp32")
    res = run_long(model, tokenizer, EVAL_TEXT, rows=rows)
    old = json.loads(args.json.read_text()) if args.json.exists() else None
    data, dropped = merge_long(old, res, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    if dropped:
        print(f"dropped (measured beside another off or with other settings): {', '.join(dropped)}", flush=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    sub = markdown_long(data)
    args.out.write_text(splice_long(args.out.read_text() if args.out.exists() else "", sub))
    print(sub)


if __name__ == "__main__":
    main()
