"""Fit a format's calibrated parts from the model's own K/V, once, before any request is served:
key channel scales for fp8 (formats.KVFormat), and the q3 codebooks.

Q3Format starts from a generic normal-quantile codebook; the distribution of normalised K/V
values differs per layer and between keys (post-RoPE, a few large channels) and values, so
each (layer, k|v) gets a codebook fitted on what this model actually produces. The samples
come from a short built-in text run through an fp32 cache: exact K/V, and no dependency on
request traffic (a refit after serving starts would change how cached blocks decode).
"""

from __future__ import annotations

import torch

from kvgen.engine.attention import Step
from kvgen.engine.kv.formats import KVFormat, make_format

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


# Start-up cost vs fit: on SmolLM2-135M's K/V (352 tokens, ~68K values per layer and k|v), a
# 16K-value subsample and 30 Lloyd rounds cost ~20x less than the defaults (all values, 100
# rounds) and lose 1.2 points of the 14.5% weighted-error reduction over the normal codebook.
FIT_OPTS = {"max_samples": 1 << 14, "iters": 30}


def collect_kv(model, ids: list[int], block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ids through the model in one prefill over an fp32 cache; K, V [tokens, kvh, hd] per
    layer, float32 on the CPU."""
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
    model.forward(torch.tensor(ids, device=dev), step, fmt, store)
    shape = (-1, cfg.num_kv_heads, cfg.head_dim)
    out = []
    for layer in range(cfg.num_layers):
        k, v = fmt.read(store, layer, torch.arange(n_blocks, device=dev))
        out.append((k.reshape(shape)[:n].float().cpu(), v.reshape(shape)[:n].float().cpu()))
    return out


def key_scales(k: torch.Tensor) -> torch.Tensor:
    """Per (kv head, channel) scale [kvh, hd] that brings every key channel to the same absmax,
    normalised to a geometric mean of 1 per head (so q and k keep their overall size).
    (One scale per RoPE pair, from the pair's norm, was tried: worse at every length measured.)"""
    s = k.abs().amax(0).clamp_min(1e-6)
    return s / s.log().mean(-1, keepdim=True).exp()


def calibrate_format(model, fmt: KVFormat, tokenizer=None, ids: list[int] | None = None) -> bool:
    """Fit the key channel scales (formats with equalize_keys) and the codebooks (q3); other
    formats are left alone.

    ids default to the tokenized CALIBRATION_TEXT (then a tokenizer is needed). Returns whether
    anything was fitted. Call it before the format's store holds any block.
    """
    codebooks = hasattr(fmt, "calibrate")
    if not (fmt.equalize_keys or codebooks):
        return False
    if ids is None:
        ids = tokenizer.encode(CALIBRATION_TEXT)
    kv = collect_kv(model, ids, fmt.block_size)
    group = model.cfg.num_heads // model.cfg.num_kv_heads
    scales = []
    for layer, (k, v) in enumerate(kv):
        if fmt.equalize_keys:
            s = key_scales(k)
            scales.append(torch.cat([s.repeat_interleave(group, 0), 1 / s]))  # q heads get s, k heads 1/s
            k = k / s  # keys as the cache will hold them
        if codebooks:
            fmt.calibrate(layer, 0, k, **FIT_OPTS)
            fmt.calibrate(layer, 1, v, **FIT_OPTS)
    if fmt.equalize_keys:
        fmt.qk_scale = torch.stack(scales).to(device=model.device, dtype=model.act_dtype)
    return True
