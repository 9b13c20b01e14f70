"""llama.cpp peer measurement, run by the llama-cpp-python venv's python (no torch there).

bench/peers.py:llamacpp_prefill_decode runs it as
    bench/.cache/llamacpp-venv/bin/python bench/llamacpp_worker.py < request.json
with a JSON request on stdin:
    {"model": path, "prompt": [512 ids], "decode_prompt": [short ids],
     "new_tokens": 128, "repeats": 3, "threads": n, "n_ctx": 2048}
and prints one JSON object on stdout (the last line; llama.cpp's own logs go to stderr).

What is measured, with the low-level API of llama_cpp.Llama (n_threads = n_threads_batch =
core count, n_ctx 2048, n_batch 512, verbose False):
- prefill_tps: len(prompt) / wall time of one `llm.eval(prompt)` on an empty KV cache (one
  llama_decode of the whole 512-token batch); best of `repeats`, after one untimed warm-up.
- decode_tps: batch 1, greedy, no early stop. `llm.eval(decode_prompt)` (untimed), then the
  first token is the argmax of the prompt's last logits; then `new_tokens` single-token
  `llm.eval([tok])` calls, each followed by an argmax over llama_get_logits_ith(ctx, -1)
  (what llama.cpp's greedy sampler does; Llama.sample would rebuild a sampler chain per
  call). decode_tps = new_tokens / wall time of that loop: every timed step is one decode
  forward plus the per-token Python/ctypes overhead a llama-cpp-python user pays. Best of
  `repeats`. EOS is ignored, so exactly new_tokens steps run.
- greedy (when the request has "greedy": [[ids], ...] and "greedy_tokens"): each prompt's greedy
  continuation, the decode loop above without timing (for the fidelity column).
- decode_tps_engine: the same steps counted by llama.cpp's own timer (llama_perf_context
  t_eval_ms / n_eval, i.e. the time inside llama_decode), for reference.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _argmax_last(llm, np, llama_cpp) -> int:
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).argmax())


def main() -> None:
    req = json.load(sys.stdin)
    import llama_cpp
    import numpy as np

    threads = int(req.get("threads") or os.cpu_count() or 1)
    prompt = [int(t) for t in req["prompt"]]
    decode_prompt = [int(t) for t in req.get("decode_prompt") or prompt[:16]]
    new_tokens = int(req.get("new_tokens", 128))
    repeats = max(1, int(req.get("repeats", 3)))
    n_ctx = int(req.get("n_ctx", 2048))
    if len(prompt) > n_ctx or len(decode_prompt) + new_tokens + 1 > n_ctx:
        raise SystemExit(f"prompt/decode length exceeds n_ctx={n_ctx}")

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=req["model"],
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=512,
        verbose=False,
    )
    load_s = time.perf_counter() - t0

    # Prefill: the whole prompt on an empty cache. reset() sets n_tokens = 0 and eval()
    # removes the cache entries from n_tokens on, so each repeat starts from scratch.
    llm.reset()
    llm.eval(prompt)  # warm-up (page-in of the mmapped weights, thread pool start)
    prefill_s = []
    for _ in range(repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill_s.append(time.perf_counter() - t)

    # Decode: batch 1, greedy, exactly new_tokens single-token forwards.
    def decode_once() -> tuple[float, float, list[int]]:
        llm.reset()
        llm.eval(decode_prompt)
        tok = _argmax_last(llm, np, llama_cpp)
        out = [tok]
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        t = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([tok])
            tok = _argmax_last(llm, np, llama_cpp)
            out.append(tok)
        wall = time.perf_counter() - t
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        engine = perf.t_eval_ms / 1e3 if perf.n_eval >= new_tokens else float("nan")
        return wall, engine, out

    decode_once()  # warm-up
    runs = [decode_once() for _ in range(repeats)]
    best_wall = min(r[0] for r in runs)
    best_engine = min(r[1] for r in runs)

    result = {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "threads": threads,
        "n_ctx": n_ctx,
        "load_s": round(load_s, 3),
        "prompt_tokens": len(prompt),
        "prefill_tps": len(prompt) / min(prefill_s),
        "prefill_s": [round(s, 4) for s in prefill_s],
        "decode_prompt_tokens": len(decode_prompt),
        "new_tokens": new_tokens,
        "decode_tps": new_tokens / best_wall,
        "decode_tps_engine": new_tokens / best_engine if best_engine == best_engine else None,
        "decode_s": [round(r[0], 4) for r in runs],
        "first_tokens": runs[0][2][:16],
    }
    if req.get("greedy"):  # fidelity: greedy continuations of token-id prompts, same loop as decode
        n = int(req.get("greedy_tokens", 24))
        outs = []
        for ids in req["greedy"]:
            llm.reset()
            llm.eval([int(t) for t in ids])
            out = [_argmax_last(llm, np, llama_cpp)]
            while len(out) < n:
                llm.eval([out[-1]])
                out.append(_argmax_last(llm, np, llama_cpp))
            outs.append(out)
        result["greedy"] = outs
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
