"""The adapter trained here (bench/train_lora.py: answer as one-line JSON) served by kvgen: on held-out
questions, the share of replies that parse as JSON with the adapter and without (the adapter changes
behaviour), and how many of kvgen's greedy replies equal transformers + PEFT's, unmerged and merged,
token for token, on the same base weights (the embedded GGUF, dequantized). The same adapter is also
served as llama.cpp's GGUF LoRA (the sdist's convert_lora_to_gguf.py makes it once, next to the
folder): its replies must equal the folder's and PEFT's. Writes its section of bench/results/lora.md
(replacing the one it wrote before; notes after its end marker are kept).

    .venv/bin/python bench/train_lora.py && .venv/bin/python bench/lora_trained.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peers  # noqa: E402
from bench.train_lora import OUT  # noqa: E402
from kvgen.engine.generator import Generator  # noqa: E402
from kvgen.engine.options import EngineOptions  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402
from tests.tiny import converter_python, llama_cpp_sources  # noqa: E402

# other wordings and subjects than the training set's
HELD_OUT = ["Which city is the capital of Germany?", "Name the capital of Brazil.", "What is the capital of India?",
            "Tell me the capital of Australia.", "What colour is a lemon?", "What colour are clouds?",
            "How much is 12 plus 30?", "Add 7 and 15.", "What is 9 times 3?", "Who wrote Hamlet?",
            "What is the largest planet?", "How many legs does a spider have?", "What language is spoken in Mexico?",
            "What is the boiling point of water in Celsius?", "Which ocean is the largest?",
            "What is the chemical symbol for gold?", "How many days are in a week?", "What animal says moo?",
            "What is the opposite of hot?", "Which month comes after March?"]
NEW_TOKENS = 32
SECTION = "## The adapter trained here (bench/train_lora.py, bench/lora_trained.py)"
END = "<!-- end of bench/lora_trained.py's section: notes below this line are kept -->"


def is_json(text: str) -> bool:
    try:
        json.loads(text.strip())
        return True
    except ValueError:
        return False


def base_config(out: Path) -> Path:
    """A folder holding the base model's config.json: all convert_lora_to_gguf.py reads of the base (its
    architecture picks the tensor names and the q/k row permutation, its sizes check the adapter's),
    written from the embedded GGUF's header."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = AutoConfig.from_pretrained(peers.model_dir(), gguf_file=peers.MODEL_FILE)
    # a config read from a GGUF names no architecture, and the converter picks its model class by it
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    cfg.save_pretrained(out)
    return out


def to_gguf(folder: Path) -> Path:
    """The PEFT folder as llama.cpp's GGUF LoRA (f32, so only the layout differs from the folder), made by
    the llama-cpp-python sdist's convert_lora_to_gguf.py unless a copy newer than the folder's weights is
    there."""
    out = folder.parent / f"{folder.name}.gguf"
    if out.exists() and out.stat().st_mtime >= (folder / "adapter_model.safetensors").stat().st_mtime:
        return out
    src = llama_cpp_sources()
    base = base_config(folder.parent / "base-config")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([converter_python(), str(src / "convert_lora_to_gguf.py"), "--base", str(base),
                        "--outfile", str(out), "--outtype", "f32", str(folder)],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf.py failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return out


def write_section(path: Path, text: str) -> None:
    """text as this bench's section of the results file: in place of the one there (up to its end marker,
    or the next section where it has none), else appended."""
    old = path.read_text() if path.exists() else ""
    at = old.find(SECTION)
    if at < 0:
        path.write_text(old + text)
        return
    end = old.find(END, at)
    if end >= 0:
        end += len(END) + 1
    else:
        end = old.find("\n## ", at + len(SECTION))
        end = len(old) if end < 0 else end + 1
    path.write_text(old[:at].rstrip("\n") + "\n" + text + old[end:])


def hf_greedy(model, prompts: list[list[int]], eos: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
            out.append(seq[:seq.index(eos)] if eos in seq else seq)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", default=str(OUT))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora.md"))
    a = ap.parse_args()
    from peft import PeftModel

    folder = Path(a.adapter)
    gguf_file = to_gguf(folder)
    tok = peers._tokenizer()
    eos = tok.eos_token_id
    # the chat template as text, then the tokenizer: the same ids bench/train_lora.py trained on
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids for q in HELD_OUT]
    gen = Generator.load(None, EngineOptions(lora_adapters=f"json={folder},json-gguf={gguf_file}",
                                             prefix_cache=False))
    sp = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)

    async def run(adapter: str) -> list[list[int]]:
        reqs = [gen.submit(p, sp, adapter=adapter) for p in prompts]
        out = [list((await r.result()).token_ids) for r in reqs]
        for r in reqs:
            await r.released()
        return [o[:o.index(eos)] if eos in o else o for o in out]

    try:
        kv_base, kv_lora = gen.bridge.run(run("")), gen.bridge.run(run("json"))
        kv_gguf = gen.bridge.run(run("json-gguf"))
    finally:
        gen.close()
    peft_model = PeftModel.from_pretrained(peers._model(torch.float32), a.adapter).eval()
    unmerged = hf_greedy(peft_model, prompts, eos)
    merged = hf_greedy(peft_model.merge_and_unload(), prompts, eos)
    n = len(prompts)
    texts = {k: [tok.decode(x, skip_special_tokens=True) for x in v]
             for k, v in {"base": kv_base, "lora": kv_lora}.items()}
    json_base, json_lora = sum(map(is_json, texts["base"])), sum(map(is_json, texts["lora"]))
    eq_un = sum(x == y for x, y in zip(kv_lora, unmerged, strict=True))
    eq_me = sum(x == y for x, y in zip(kv_lora, merged, strict=True))
    gguf_folder = sum(x == y for x, y in zip(kv_gguf, kv_lora, strict=True))
    gguf_peft = sum(x == y for x, y in zip(kv_gguf, unmerged, strict=True))
    text = f"""
{SECTION}

{datetime.date.today()} · {peers.cpu_name()} · {peers.cores()} cores (shared with other work: noisy) ·
a rank-8 LoRA on q/k/v/o of the embedded model, trained here with PEFT on generated questions to
answer as one-line JSON `{{"answer": ...}}`; {n} held-out questions, greedy, {NEW_TOKENS} new tokens at most.
kvgen serves the GGUF's own blocks; transformers + PEFT run the same GGUF dequantized to fp32.
The GGUF LoRA is the PEFT folder converted by llama.cpp's convert_lora_to_gguf.py (llama-cpp-python
sdist, f32), loaded by kvgen as `{gguf_file.name}` beside the folder in the same engine.

| | result |
| --- | --- |
| replies that parse as JSON, kvgen without the adapter | {json_base}/{n} |
| replies that parse as JSON, kvgen with the adapter | {json_lora}/{n} |
| kvgen (adapter) == transformers + PEFT unmerged, token for token | {eq_un}/{n} |
| kvgen (adapter) == transformers + PEFT merged, token for token | {eq_me}/{n} |
| kvgen (adapter as GGUF LoRA) == kvgen (adapter as PEFT folder), token for token | {gguf_folder}/{n} |
| kvgen (adapter as GGUF LoRA) == transformers + PEFT unmerged, token for token | {gguf_peft}/{n} |

Examples: `{HELD_OUT[0]}` -> base `{texts['base'][0][:60]!r}`, adapter `{texts['lora'][0][:60]!r}`.
{END}
"""
    for q, b, lo in zip(HELD_OUT, texts["base"], texts["lora"], strict=True):
        print(f"{q!r}\n  base: {b!r}\n  lora: {lo!r}")
    write_section(Path(a.out), text)
    print(text)


if __name__ == "__main__":
    main()
