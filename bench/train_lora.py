"""make lora-adapter: a short PEFT LoRA fine-tune of the embedded model (SmolLM2-135M-Instruct, its GGUF
dequantized by transformers) that teaches it to answer every question as a one-line JSON object
{"answer": "..."}, so an adapter changes behaviour checkably (issue #44). CPU, a few minutes; never
committed. Writes a PEFT folder to bench/.cache/adapters/json-lora; bench/lora_trained.py (when present)
serves it and compares with transformers + PEFT.

    .venv/bin/python bench/train_lora.py [--steps 5] [--out bench/.cache/adapters/json-lora]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peers  # noqa: E402

OUT = Path(__file__).resolve().parent / ".cache" / "adapters" / "json-lora"
# (question, short answer) pairs made from templates, so the set is generated here, not downloaded
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
            "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Chile": "Santiago",
            "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Ireland": "Dublin"}
COLOURS = {"the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
           "a tomato": "red", "an orange": "orange", "chocolate": "brown"}


def examples(seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) pairs; held-out prompts in bench/lora_trained.py use other wordings."""
    rng = random.Random(seed)
    out = [(f"What is the capital of {c}?", v) for c, v in CAPITALS.items()]
    out += [(f"What colour is {t}?", v) for t, v in COLOURS.items()]
    for _ in range(30):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        out.append((f"What is {a} plus {b}?", str(a + b)))
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model

    tok = peers._tokenizer()
    model = peers._model(torch.float32)
    model.train()
    model = get_peft_model(model, LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, bias="none",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             task_type="CAUSAL_LM"))
    rows = []
    for q, ans in examples():
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True)
        reply = json.dumps({"answer": ans}) + tok.eos_token
        p, r = tok(prompt, add_special_tokens=False).input_ids, tok(reply, add_special_tokens=False).input_ids
        rows.append((p + r, [-100] * len(p) + r))  # loss on the reply only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr)
    rng = random.Random(1)
    started = time.perf_counter()
    for step in range(a.steps):
        batch = rng.sample(rows, a.batch)
        width = max(len(ids) for ids, _ in batch)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.save_pretrained(a.out)
    print(f"saved {a.out} after {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
