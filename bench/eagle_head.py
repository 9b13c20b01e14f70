"""Train an EAGLE-1 draft head (kvgen/engine/speculative/eagle.py) for the embedded SmolLM2-135M
on the CPU, within a wall-clock budget, from the model's own generations (no downloads).

Data: the target answers a few hundred varied prompts written below (chat questions, code, lists,
stories, raw text), sampled at temperature 0.7-1.0 through Generator.batch_generate; then one
forward pass per sequence collects its final-norm hidden states (the features the engine hands
an EAGLE head). Both on the served default weights (WEIGHT_DTYPE=auto: the GGUF's own Q4_1 blocks):
the features the head will be served are exactly these, and on 2 cores they decode ~3x and prefill
~1.5x faster than fp32 (bench/results/cpu.md), whose features they match to ~1e-4 anyway (fp32 is
the same Q4_1 values dequantized). The frozen LM head in the loss is the tied embedding, fp32.

Training is EAGLE-1's: teacher forcing (the head reads the target's true features, with a little
uniform noise), loss = smooth-L1(guessed feature j+1, true feature j+1) + 0.1 * cross-entropy of
the frozen LM head on the guess against the target's own next-token distribution (on a random
subset of positions: the 49152-row LM head costs ~7x the rest of the head).

    make eagle-head   (or .venv/bin/python bench/eagle_head.py [--minutes 25] [--out PATH])
    SPECULATIVE=eagle EAGLE_HEAD=bench/.cache/eagle/smollm2-135m-eagle.safetensors make serve
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from kvgen.cpu.threads import in_fresh_thread  # noqa: E402
from kvgen.engine.generator import EngineOptions, Generator, load_model  # noqa: E402
from kvgen.engine.kv_samples import prefill  # noqa: E402
from kvgen.engine.model import Model, apply_rope, interleave  # noqa: E402
from kvgen.engine.model_files import embedded_model_path  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

OUT = Path(__file__).resolve().parent / ".cache" / "eagle" / "smollm2-135m-eagle.safetensors"
P = "layers.0."
ATTN, MLP = P + "self_attn.", P + "mlp."

TOPICS = ("photosynthesis", "the French Revolution", "black holes", "compound interest", "the immune system",
          "volcanoes", "machine learning", "the water cycle", "ancient Rome", "climate change", "jazz music",
          "the stock market", "vaccines", "the Moon landing", "plate tectonics", "renewable energy", "chess",
          "the printing press", "honey bees", "inflation", "the human heart", "coffee", "the Internet",
          "earthquakes", "Shakespeare", "DNA", "gravity", "the Great Wall of China", "sleep", "electric cars",
          "rainbows", "the Olympic Games", "recycling", "dinosaurs", "the Pyramids", "meditation", "tides",
          "bread baking", "airplanes", "the periodic table", "democracy", "coral reefs", "exercise",
          "the Renaissance", "solar panels", "friendship", "time management", "the Amazon rainforest",
          "prime numbers", "public speaking", "cats", "gardening", "the Silk Road", "antibiotics")
ASKS = ("Explain {} in simple terms.", "What are three interesting facts about {}?", "Why does {} matter?",
        "Write a short paragraph about {} for a ten-year-old.", "Give me a list of five key points about {}.",
        "What is the history of {}?", "Write a haiku about {}.", "What are common misconceptions about {}?",
        "Summarize the pros and cons of {}.", "How would you teach {} to a beginner?")
CODE = ("Write a Python function that reverses a string.", "Write a Python function to check if a number is prime.",
        "How do I read a file line by line in Python?", "Write a JavaScript function that sums an array.",
        "Explain what a for loop does, with an example in Python.", "Write a SQL query that counts users by country.",
        "Write a Python class for a simple bank account.", "What is the difference between a list and a tuple?",
        "Write a function that returns the Fibonacci numbers up to n.", "How do I sort a dictionary by value?",
        "Write a bash command that counts the lines in every .txt file.", "Explain recursion with a Python example.",
        "Write a Python function that merges two sorted lists.", "What does `git rebase` do?",
        "Write a C function that computes the length of a string.", "Write a regular expression for an email.",
        "Write a Python script that prints the multiplication table of 7.", "What is a hash map?",
        "Write a function to find the largest element in a list without using max().",
        "Write a Python generator that yields the squares of numbers.")
LISTS = ("List ten fruits.", "List the planets of the solar system in order.", "Name seven countries in Africa.",
         "Give me a packing list for a weekend camping trip.", "List five tips for writing a good essay.",
         "Give me a shopping list for a pancake breakfast.", "List the days of the week in French.",
         "Name eight famous painters.", "List six healthy snacks.", "Give a step-by-step recipe for an omelette.",
         "List the first ten prime numbers.", "Name five programming languages and what they are used for.")
STORIES = ("Write a short story about a robot who learns to paint.", "Tell me a bedtime story about a brave mouse.",
           "Write a story that begins: The door had been locked for a hundred years.",
           "Write a fable about a fox and a crow.", "Write a short story about two friends lost in a city.",
           "Tell a story about a dragon who is afraid of fire.", "Write a mystery story set on a train.",
           "Write a letter from a sailor to his family.", "Write a poem about the sea.",
           "Write a dialogue between a teacher and a curious student.")
RAW = ("Once upon a time, in a small village by the sea,", "The capital of France is", "def quicksort(items):\n",
       "The three laws of thermodynamics are", "Here is a recipe for chocolate cake:\n", "In 1492, Columbus",
       "Dear Sir or Madam,\n\nI am writing to", "import numpy as np\n\n", "The best way to learn a language is",
       "Q: What is the boiling point of water?\nA:", "Chapter 1\n\nIt was a cold morning when", "1. Apples\n2.")


def prompts(seed: int = 0) -> list:
    """~700 prompts: chat messages (the served default) and some raw text, in a seeded order."""
    chat = [a.format(t) for t in TOPICS for a in ASKS] + list(CODE) * 2 + list(LISTS) * 2 + list(STORIES) * 2
    out: list = [[{"role": "user", "content": c}] for c in chat] + list(RAW) * 2
    random.Random(seed).shuffle(out)
    return out


def features(model: Model, ids: list[int]) -> torch.Tensor:
    """The target's final-norm hidden states [n, H] of ids, from one prefill over an fp32 cache
    (calibration.prefill; Model.forward hands them out with features=)."""
    out: list = []
    with torch.inference_mode():
        prefill(model, ids, features=out)
    return out[0].float().clone()


def collect(gen: Generator, model: Model, prompt_list: list, max_new_tokens: int = 192, batch: int = 32,
            deadline: float = math.inf, temperature: tuple[float, float] = (0.7, 1.0), seed: int = 0,
            log=print) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids [n], features [n, H]) of prompt + sampled answer, for prompts in batches until
    the list or the time runs out (a batch is not started when the last one would not fit)."""
    rng = random.Random(seed)
    data: list[tuple[torch.Tensor, torch.Tensor]] = []
    t0, took = time.monotonic(), 0.0
    for i in range(0, len(prompt_list), batch):
        if time.monotonic() + took > deadline:
            break
        start = time.monotonic()
        chunk = prompt_list[i:i + batch]
        params = [SamplingParams(temperature=rng.uniform(*temperature), top_p=0.95, seed=rng.randrange(2**31),
                                 max_new_tokens=max_new_tokens) for _ in chunk]
        seqs = [gen.tokenize(p) + r.token_ids for p, r in zip(chunk, gen.batch_generate(chunk, params), strict=True)
                if not isinstance(r, Exception)]
        # A thread that exits: its OpenMP pool goes with it, so the engine thread's stays the only
        # one (kvgen/cpu/threads.py: two pools make every parallel op ~2.5x slower on 2 cores).
        data += in_fresh_thread(_with_features, model, seqs)
        took = time.monotonic() - start
        log(f"data: {len(data)} sequences, {sum(len(s) for s, _ in data)} tokens, {time.monotonic() - t0:.0f} s")
    return data


def _with_features(model: Model, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.tensor(s), features(model, s)) for s in seqs]


def lm_weight(model: Model) -> torch.Tensor:
    """The LM head as an fp32 matrix [vocab, H]: the embeddings when tied (SmolLM2; with gguf
    weights the LM head runs on their blocks, whose dequantized values these are)."""
    if model.cfg.tie_word_embeddings:
        return model.embed.to(torch.device("cpu"), torch.float32).table
    return model.lm_head.w.float()


def init_head(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh weights in the saved layout (HF's rotate-half q/k rows; eagle.py interleaves them on
    load). fc starts as "pass the feature through" and o/down at zero, so the untrained head
    guesses feature j+1 = feature j and every step of training starts from a working residual."""
    g = torch.Generator().manual_seed(seed)
    h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02
    return {"fc.weight": torch.cat([rand(h, h), torch.eye(h)], 1), "fc.bias": torch.zeros(h),
            ATTN + "q_proj.weight": rand(nq, h), ATTN + "k_proj.weight": rand(nkv, h),
            ATTN + "v_proj.weight": rand(nkv, h), ATTN + "o_proj.weight": torch.zeros(h, nq),
            MLP + "gate_proj.weight": rand(ffn, h), MLP + "up_proj.weight": rand(ffn, h),
            MLP + "down_proj.weight": torch.zeros(h, ffn), P + "post_attention_layernorm.weight": torch.ones(h)}


def head_forward(w: dict, model: Model, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """EagleHead.forward, differentiable and batched: ids [B, T] (token j+1), feats [B, T, H]
    (feature j) at positions 0..T-1 -> guessed features j+1 [B, T, H]. Same math op for op:
    q/k rows interleaved as Layer does on load, the model's RoPE table, causal GQA attention."""
    cfg = model.cfg
    B, T = ids.shape
    nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = F.linear(torch.cat([model.embed[ids].float(), feats], -1), w["fc.weight"], w.get("fc.bias"))
    rot = model.rot[:T].unsqueeze(1)  # [T, 1, hd/2]
    q = apply_rope(F.linear(x, interleave(w[ATTN + "q_proj.weight"], nq)).view(B, T, nq, hd), rot)
    k = apply_rope(F.linear(x, interleave(w[ATTN + "k_proj.weight"], nkv)).view(B, T, nkv, hd), rot)
    v = F.linear(x, w[ATTN + "v_proj.weight"]).view(B, T, nkv, hd)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)
    h = x + F.linear(a.transpose(1, 2).reshape(B, T, nq * hd), w[ATTN + "o_proj.weight"])
    m = F.rms_norm(h, (h.shape[-1],), w[P + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    return h + F.linear(F.silu(F.linear(m, w[MLP + "gate_proj.weight"])) * F.linear(m, w[MLP + "up_proj.weight"]),
                        w[MLP + "down_proj.weight"])


def _batch(seqs: list, max_len: int):
    """Right-padded ids [B, T], features [B, T, H] and lengths: padding after a sequence's end is
    invisible to it under causal attention, so only the loss needs masking."""
    seqs = [(s[:max_len], f[:max_len]) for s, f in seqs]
    T = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    feats = torch.zeros(len(seqs), T, seqs[0][1].shape[1])
    for i, (s, f) in enumerate(seqs):
        ids[i, :len(s)], feats[i, :len(s)] = s, f
    return ids, feats, torch.tensor([len(s) for s, _ in seqs])


def evaluate(w: dict, model: Model, held: list, max_len: int = 512) -> dict:
    """Teacher-forced top-1 on held-out sequences: argmax LM head(guessed feature j+1) against the
    token that actually came next (j+2), and against the target's own argmax there (what a greedy
    request accepts as the first drafted token)."""
    lm = lm_weight(model)
    hits = agree = n_tok = n_arg = 0
    with torch.no_grad():
        for s, f in held:
            ids, feats, _ = _batch([(s, f)], max_len)
            guess = head_forward(w, model, ids[:, 1:], feats[:, :-1])[0]  # guess j for j = 0..T-2
            top = (guess @ lm.t()).argmax(-1)
            want = (feats[0, 1:] @ lm.t()).argmax(-1)
            hits += (top[:-1] == ids[0, 2:]).sum().item()
            agree += (top == want).sum().item()
            n_tok, n_arg = n_tok + len(top) - 1, n_arg + len(top)
    return {"top1": hits / max(n_tok, 1), "agree": agree / max(n_arg, 1)}


def train(model: Model, data: list, held: list | None = None, deadline: float = math.inf, steps: int | None = None,
          lr: float = 1e-3, batch: int = 4, max_len: int = 320, ce_frac: float = 0.25, ce_weight: float = 0.1,
          noise: float = 0.1, seed: int = 0, w: dict | None = None, log=print, eval_every_s: float = 120.0
          ) -> tuple[dict, list[float]]:
    """AdamW on EAGLE-1's loss until deadline or steps; returns (weights, per-step losses)."""
    rng = torch.Generator().manual_seed(seed)
    w = {k: v.detach().clone().float().requires_grad_(True) for k, v in (w or init_head(model.cfg, seed)).items()}
    decay = [v for k, v in w.items() if v.dim() == 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": [v for v in w.values() if v.dim() == 1], "weight_decay": 0.0}], lr=lr)
    lm = lm_weight(model)  # frozen
    # EAGLE-1's noise is U(-0.1, 0.1) on features of its models' scale; here relative to ours.
    scale = noise * torch.cat([f for _, f in data[:64]]).pow(2).mean().sqrt().item()
    t0, last_eval, losses, warm = time.monotonic(), time.monotonic(), [], 20
    step = 0
    while (steps is None or step < steps) and time.monotonic() < deadline:
        # the schedule runs on whichever budget ends first: warm-up, then cosine down to 10%
        frac = max(step / steps if steps else 0.0,
                   (time.monotonic() - t0) / (deadline - t0) if deadline < math.inf else 0.0)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))
        pick = torch.randint(len(data), (batch,), generator=rng).tolist()
        ids, feats, lens = _batch([data[i] for i in pick], max_len)
        T = ids.shape[1]
        inp = feats[:, :-1] + (torch.rand(feats[:, :-1].shape, generator=rng) * 2 - 1) * scale
        guess = head_forward(w, model, ids[:, 1:], inp)  # [B, T-1, H]: guess of feature j+1
        valid = torch.arange(T - 1)[None] < (lens[:, None] - 1)
        target = feats[:, 1:][valid]
        guessed = guess[valid]
        reg = F.smooth_l1_loss(guessed, target, reduction="none").mean(-1).mean()
        rows = torch.randperm(len(guessed), generator=rng)[:max(1, int(len(guessed) * ce_frac))]
        with torch.no_grad():  # soft labels, as EAGLE-1: the target's whole next-token distribution
            p = F.softmax(target[rows] @ lm.t(), -1)
        ce = -(p * F.log_softmax(guessed[rows] @ lm.t(), -1)).sum(-1).mean()
        loss = reg + ce_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), 0.5)  # EAGLE-1's clip
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 10 == 0:
            log(f"step {step}  {time.monotonic() - t0:.0f} s  loss {sum(losses[-10:]) / 10:.4f}  "
                f"(feature {reg.item():.4f}, ce {ce.item():.3f})")
        if held and time.monotonic() - last_eval > eval_every_s:
            last_eval = time.monotonic()
            log(f"held-out: {evaluate(w, model, held)}")
    return {k: v.detach() for k, v in w.items()}, losses


def save(w: dict, path: str | Path) -> Path:
    """The head as eagle.py's load_head reads it (EAGLE-1's names, fp32, rotate-half q/k)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in w.items()}, str(path))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=24.0, help="wall-clock budget for the whole run")
    ap.add_argument("--data-share", type=float, default=0.45, help="share of the budget for making data")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    t0 = time.monotonic()
    end = t0 + args.minutes * 60 - 20  # leave time to evaluate and save
    torch.set_num_threads(2)
    model, tokenizer = load_model(embedded_model_path())  # auto: what `make serve` runs
    gen = Generator(model, tokenizer, EngineOptions(max_running=32))
    try:
        data = collect(gen, model, prompts(), args.new_tokens, deadline=t0 + (end - t0) * args.data_share)
    finally:
        gen.close()  # its engine thread (and OpenMP pool) goes before training runs on this one
    held, data = data[::20][:8], [d for i, d in enumerate(data) if i % 20 or i // 20 >= 8]
    print(f"train {len(data)} sequences, held out {len(held)}; "
          f"untrained: {evaluate(init_head(model.cfg), model, held)}")
    w, _ = train(model, data, held, deadline=end - 15)
    print(f"trained: {evaluate(w, model, held)}  ({time.monotonic() - t0:.0f} s in all)")
    print(f"wrote {save(w, args.out)}")


if __name__ == "__main__":
    main()
