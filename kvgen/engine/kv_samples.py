"""Calibrate a KV format on the model's own K/V at start-up: run a short built-in text through
the model over an exact fp32 cache, then let kv/calibrate.py fit the format (fp8 key channel
scales, q3 codebooks) from those samples.

The text is built in, not taken from request traffic: a refit after serving starts would change
how cached blocks decode, and this way start-up needs nothing but the model.
"""

from __future__ import annotations

import torch

from kvgen.engine.attention import Step
from kvgen.engine.kv.calibrate import fit_format, needs_fit
from kvgen.engine.kv.formats import make_format

# A few hundred tokens of mixed material (prose, dialogue, numbers, code, a list), so the
# codebooks see the kinds of activations requests produce, not just one register of English.
CALIBRATION_TEXT = """\
The lighthouse keeper wrote the same three lines in his log every evening: the wind, the
state of the sea, and the number of ships that passed before dark. On the night of the storm
he wrote a fourth line, which nobody could read afterwards because the ink had run.

"Do you think the bridge will hold?" asked Maria, watching the river rise.
"It held in 1962," her grandfather said, "and the water was higher then."

Recipe for a simple bread: mix 500 g of flour, 10 g of salt, 7 g of dried yeast and 320 ml
of warm water. Knead for ten minutes, let it rise for an hour, shape it, bake at 220 C for
35 minutes.

def moving_average(values, window):
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out

Things to check before a long walk in the hills:
1. the weather forecast for the afternoon, not only the morning;
2. water, food, and a layer that keeps the rain out;
3. a map, because phones lose signal in the valleys.

In economics, a price ceiling set below the market price tends to create shortages, while a
floor set above it tends to create surpluses. The size of the effect depends on how strongly
buyers and sellers respond to the price, which economists call elasticity.
"""


def prefill(model, ids: list[int], block_size: int = 16, features: list | None = None):
    """Run ids through the model in one prefill over a fresh fp32 cache of their own (with
    features, Model.forward appends the final hidden states there); returns (format, store)."""
    cfg = model.cfg
    n = len(ids)
    dev = model.device
    fmt = make_format("fp32", cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim,
                      compute_dtype=model.act_dtype)
    n_blocks = -(-n // block_size)
    store = fmt.allocate(n_blocks, dev)
    pos = torch.arange(n, device=dev)
    step = Step(positions=pos, write_blocks=pos // block_size, write_offsets=pos % block_size,
                query_lens=[n], context_lens=[n], block_tables=torch.arange(n_blocks, device=dev)[None],
                logits_rows=torch.tensor([n - 1], device=dev), is_decode=n == 1)
    model.forward(torch.tensor(ids, device=dev), step, fmt, store, features=features)
    return fmt, store


def collect_kv(model, ids: list[int], block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ids through the model in one prefill over an fp32 cache; K, V [tokens, kvh, hd] per
    layer, float32 on the CPU."""
    cfg, n = model.cfg, len(ids)
    fmt, store = prefill(model, ids, block_size)
    blocks = torch.arange(-(-n // block_size), device=model.device)
    shape = (-1, cfg.num_kv_heads, cfg.head_dim)
    out = []
    for layer in range(cfg.num_layers):
        k, v = fmt.read(store, layer, blocks)
        out.append((k.reshape(shape)[:n].float().cpu(), v.reshape(shape)[:n].float().cpu()))
    return out


def calibrate_format(model, fmt, tokenizer=None, ids: list[int] | None = None) -> bool:
    """Fit fmt on the model's K/V of ids (default: the tokenized CALIBRATION_TEXT, which needs a
    tokenizer); the model only runs when the format has something to fit. Returns whether
    anything was fitted. Call it before the format's store holds any block."""
    if not needs_fit(fmt):
        return False
    if ids is None:
        ids = tokenizer.encode(CALIBRATION_TEXT)
    samples = collect_kv(model, ids, fmt.block_size)
    return fit_format(fmt, samples, model.cfg.num_heads, model.device, model.act_dtype)
