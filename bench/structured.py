"""Constrained decoding's cost: decode tokens/s with a JSON-schema constraint against the same
run unconstrained, at batch 1 and at 16 concurrent streams (half constrained), the time to
compile a schema cold and cached, and llama.cpp's grammar sampling on the same schema and GGUF
(bench/llamacpp_grammar.py) as the peer. Writes bench/results/structured.md.

    make bench-structured        (also part of `make bench`)

The engine runs in process (no gRPC): what is compared is the step, mask work included.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peers import cores, cpu_name, model_path, run_llamacpp  # noqa: E402
from kvgen.engine.constraint import Constraint, Grammars  # noqa: E402
from kvgen.engine.generator import Generator  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

OUT = Path(__file__).parent / "results" / "structured.md"
NEW_TOKENS = 128
# long enough that 128 tokens end inside it: both runs decode exactly NEW_TOKENS tokens
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "price": {"type": "number"},
                                         "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "in_stock"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 20, "maxItems": 20}},
          "required": ["items"], "additionalProperties": False}
PROMPT = "A shop's inventory as JSON:"
BIG = {"type": "object", "properties": {f"field_{i}": {"anyOf": [{"type": "string", "format": "date-time"},
                                                                  {"type": "integer", "minimum": i},
                                                                  {"enum": ["a", "b", str(i)]}]}
                                        for i in range(40)}, "required": [f"field_{i}" for i in range(0, 40, 3)]}


def decode_tps(ev) -> float:
    t = ev.timings
    return (len(ev.token_ids) - 1) / ((t["total_ms"] - t["time_to_first_token_ms"]) / 1e3)


def batch1(gen: Generator, constrained: bool, repeats: int = 5) -> float:
    c = Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    p = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=not constrained, constraint=c)
    gen.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=4, constraint=c))  # warm-up
    runs = [gen.generate(PROMPT, p) for _ in range(repeats)]
    assert all(len(r.token_ids) == NEW_TOKENS for r in runs), [len(r.token_ids) for r in runs]
    return max(decode_tps(r) for r in runs)


def streams(gen: Generator, n: int, constrained: int) -> float:
    """Aggregate decode tokens/s of n requests run together, `constrained` of them with the schema."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=NEW_TOKENS, ignore_eos=i >= constrained,
                             constraint=c if i < constrained else None) for i in range(n)]
    t = time.perf_counter()
    out = gen.batch_generate([f"{PROMPT} ({i})" for i in range(n)], params)
    wall = time.perf_counter() - t
    assert all(len(r.token_ids) == NEW_TOKENS for r in out), [len(r.token_ids) for r in out]
    return sum(len(r.token_ids) for r in out) / wall


def compile_times(gen: Generator) -> dict:
    g = Grammars(gen.tokenizer.tok, gen.cfg.vocab_size, gen.cfg.eos_token_ids)
    t = time.perf_counter()
    assert g.tokenizer is not None  # built here, on first use
    out = {"tokenizer_ms": (time.perf_counter() - t) * 1e3}
    for name, schema in (("inventory", SCHEMA), ("40 anyOf fields", BIG)):
        c = Constraint("json_schema", json.dumps(schema))
        t = time.perf_counter()
        g.matcher(c)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(100):
            g.matcher(c)
        out[name] = (cold * 1e3, (time.perf_counter() - t) / 100 * 1e3)
    return out


def llamacpp() -> dict | None:
    return run_llamacpp("llamacpp_grammar.py", {"model": model_path(), "prompt": PROMPT, "schema": SCHEMA,
                                                "new_tokens": NEW_TOKENS, "repeats": 3, "threads": cores()})


def main() -> None:
    print(f"{cpu_name()}, {cores()} cores, loadavg {os.getloadavg()}", flush=True)
    gen = Generator.load()  # the default settings (WEIGHT_DTYPE=auto)
    weights = gen.model.weight_dtype
    try:
        # each pair measured back to back, twice, the better of each kept: a neighbour's burst of
        # load on 2 cores would otherwise decide the ratio
        pairs = [(batch1(gen, False), batch1(gen, True)) for _ in range(2)]
        free1, cons1 = max(p[0] for p in pairs), max(p[1] for p in pairs)
        print(f"batch 1: free {free1:.1f} tok/s, constrained {cons1:.1f} tok/s", flush=True)
        pairs = [(streams(gen, 16, 0), streams(gen, 16, 8)) for _ in range(2)]
        free16, half16 = max(p[0] for p in pairs), max(p[1] for p in pairs)
        print(f"16 streams: free {free16:.1f} tok/s, half constrained {half16:.1f} tok/s", flush=True)
        comp = compile_times(gen)
        print(f"compile: {comp}", flush=True)
    finally:
        gen.close()
    lc = llamacpp()
    print(f"llama.cpp: {lc and {k: v for k, v in lc.items() if not k.endswith('_text')}}", flush=True)
    rows = [
        "| workload | unconstrained tok/s | constrained tok/s | constrained / unconstrained |",
        "|---|---|---|---|",
        f"| kvgen {weights}, batch 1 | {free1:.1f} | {cons1:.1f} | {cons1 / free1:.3f} |",
        f"| kvgen {weights}, 16 streams (8 constrained) | {free16:.1f} | {half16:.1f} | {half16 / free16:.3f} |",
    ]
    if lc:
        rows.append(f"| llama.cpp Q4_1 (llama-cpp-python, LlamaGrammar), batch 1 | {lc['free_tps']:.1f} | "
                    f"{lc['constrained_tps']:.1f} | {lc['constrained_tps'] / lc['free_tps']:.3f} |")
    text = [
        "# Structured output: constrained vs unconstrained decode (`make bench-structured`)",
        "",
        f"{cpu_name()}, {cores()} cores, one run. {NEW_TOKENS} tokens per request; the constraint is a JSON schema "
        "(an object holding an array of 20 {name, price, in_stock} objects) long enough that every constrained "
        "request decodes all of them; unconstrained requests ignore EOS. Decode tok/s at batch 1 = tokens after "
        "the first / time after the first (best of 5, twice); 16 streams = all tokens / wall time of one "
        "BatchGenerate-like run at temperature 0.8 (best of 2).",
        "",
        *rows,
        "",
        "Compile (llguidance, cold = first compile of the schema; cached = a copy of the compiled matcher):",
        "",
        "| schema | cold ms | cached ms |",
        "|---|---|---|",
        *[f"| {k} | {v[0]:.2f} | {v[1]:.3f} |" for k, v in comp.items() if k != "tokenizer_ms"],
        "",
        f"llguidance's tokenizer for the model is built once per server, on first use: {comp['tokenizer_ms']:.0f} ms.",
    ]
    if lc:
        text += ["", f"llama.cpp's `LlamaGrammar.from_json_schema` on the same schema: {lc['compile_ms']:.1f} ms. "
                 f"kvgen constrained batch 1 over llama.cpp constrained: {cons1 / lc['constrained_tps']:.2f}x."]
    OUT.write_text("\n".join(text) + "\n")
    print(OUT.read_text())


if __name__ == "__main__":
    main()
