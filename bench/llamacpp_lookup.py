"""llama.cpp's prompt-lookup decoding, the peer of bench/speculative.py; run by the
llama-cpp-python venv's python (bench/setup_llamacpp.sh), never by `make test`:

    bench/.cache/llamacpp-venv/bin/python bench/llamacpp_lookup.py < request.json

Request: {"model", "prompts" (texts), "new_tokens", "threads", "draft_tokens", "banned" (token ids
never sampled: the EOS ids, so every completion runs to new_tokens)}. Prints one JSON
object (last line): per prompt, decode tokens/s (streamed greedy completion: tokens after the
first / the time after the first) without and with LlamaPromptLookupDecoding, and both texts.
"""

from __future__ import annotations

import json
import os
import sys
import time


def decode_rate(llm, prompt: str, new_tokens: int, banned: list[int]) -> tuple[float, str]:
    first, n, text = None, 0, ""
    for chunk in llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, stream=True,
                                       logit_bias={t: -100.0 for t in banned}):
        n += 1
        text += chunk["choices"][0]["text"]
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return (n - 1) / (end - first) if n > 1 else 0.0, text


def main() -> None:
    req = json.load(sys.stdin)
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = int(req.get("threads") or os.cpu_count() or 1)
    out = {}
    for name, draft in (("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=req["draft_tokens"]))):
        llm = llama_cpp.Llama(model_path=req["model"], n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                              draft_model=draft, verbose=False)
        decode_rate(llm, "Hello", 4, [])  # warm-up
        out[name] = [decode_rate(llm, p, req["new_tokens"], req.get("banned", [])) for p in req["prompts"]]
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main()
