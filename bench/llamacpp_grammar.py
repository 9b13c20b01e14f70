"""llama.cpp's grammar-constrained decoding, the peer of bench/structured.py; run by the
llama-cpp-python venv's python (bench/setup_llamacpp.sh), never by `make test`:

    bench/.cache/llamacpp-venv/bin/python bench/llamacpp_grammar.py < request.json

Request: {"model", "prompt" (text), "schema" (a JSON Schema), "new_tokens", "repeats", "threads"}.
Prints one JSON object (last line): the time LlamaGrammar.from_json_schema takes, and decode
tokens/s (completion tokens after the first / the time after the first) of streamed greedy
completions with and without the grammar (best of `repeats`, after a warm-up).
"""

from __future__ import annotations

import json
import os
import sys
import time


def decode_rate(llm, prompt: str, new_tokens: int, grammar) -> tuple[float, int, str]:
    first = None
    n, text = 0, ""
    for chunk in llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, grammar=grammar,
                                       stream=True):
        n += 1
        text += chunk["choices"][0]["text"]
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return (n - 1) / (end - first), n, text


def main() -> None:
    req = json.load(sys.stdin)
    import llama_cpp

    threads = int(req.get("threads") or os.cpu_count() or 1)
    llm = llama_cpp.Llama(model_path=req["model"], n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                          verbose=False)
    t = time.perf_counter()
    grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(req["schema"]), verbose=False)
    compile_s = time.perf_counter() - t
    out = {"compile_ms": compile_s * 1e3}
    for name, g in (("free", None), ("constrained", grammar)):
        decode_rate(llm, req["prompt"], 8, g)  # warm-up
        best = max((decode_rate(llm, req["prompt"], req["new_tokens"], g) for _ in range(req["repeats"])),
                   key=lambda r: r[0])
        out[f"{name}_tps"], out[f"{name}_tokens"], out[f"{name}_text"] = best
    print(json.dumps(out))


if __name__ == "__main__":
    main()
