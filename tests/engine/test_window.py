"""Sliding-window and chunked attention: same answers as a full cache with the mask, bounded memory."""

from __future__ import annotations

import random

import pytest
import torch

from kvgen.engine.attention import Step, attend
from kvgen.engine.engine import Engine
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.manager import KVManager
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.tiers import TieredKV
from kvgen.engine.model import Model
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.sequence import Sequence
from tests.tiny import tiny_config, tiny_weights


def masked_reference(q, k, v, q_pos, window, chunk):
    H, KVH = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    kp, qp = torch.arange(k.shape[0])[None, :], q_pos[:, None]
    keep = kp <= qp
    if window:
        keep &= kp > qp - window
    if chunk:
        keep &= kp >= qp - qp % chunk
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~keep, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("seed", range(8))
def test_window_and_chunk_masks_match_reference(seed):
    rng = random.Random(seed)
    window, chunk = rng.choice([(5, 0), (16, 0), (0, 8), (0, 16), (12, 8)])
    bs, D, H, KVH = 4, 8, 6, 2
    fmt = make_format("fp32", 1, bs, KVH, D)
    pool = BlockPool(fmt, 64)
    ctx = rng.randint(2, 60)
    n = 1 if rng.random() < 0.5 else rng.randint(1, ctx)
    k, v = torch.randn(ctx, KVH, D), torch.randn(ctx, KVH, D)
    # pretend the blocks wholly before the oldest visible key were already freed
    oldest = max(0, (ctx - n) - (window - 1 if window else 0)) if window else 0
    if chunk:
        qp0 = ctx - n
        oldest = max(oldest, qp0 - qp0 % chunk)
    first = oldest // bs
    blocks = list(range(first, -(-ctx // bs)))
    pos = torch.arange(first * bs, ctx)
    fmt.write(pool.store, 0, torch.tensor(blocks)[pos // bs - first], pos % bs, k[first * bs:], v[first * bs:])
    q = torch.randn(n, H, D)
    step = Step(positions=torch.arange(ctx - n, ctx), write_blocks=torch.zeros(0), write_offsets=torch.zeros(0),
                query_lens=[n], context_lens=[ctx], block_tables=torch.tensor([blocks]),
                logits_rows=torch.tensor([n - 1]), is_decode=n == 1, kv_starts=[first * bs],
                window=window, chunk=chunk)
    out = attend(q, fmt, pool.store, 0, step)
    ref = masked_reference(q, k, v, torch.arange(ctx - n, ctx), window, chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64)
    return Model(cfg, tiny_weights(cfg, seed=3))


def greedy_reference(model, prompt, n_new, window, chunk):
    """Greedy decoding with a full cache (nothing freed) and the window/chunk mask."""
    cfg = model.cfg
    fmt = make_format("fp32", cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 256)
    cache = PagedKVCache(pool)
    ids, out = list(prompt), []
    feed = list(prompt)
    for _ in range(n_new):
        start, n = cache.length, len(feed)
        cache.reserve(n)
        b, o = cache.slots(start, n)
        step = Step(positions=torch.arange(start, start + n), write_blocks=b, write_offsets=o, query_lens=[n],
                    context_lens=[start + n], block_tables=torch.tensor([cache.blocks]),
                    logits_rows=torch.tensor([n - 1]), is_decode=n == 1, window=window, chunk=chunk)
        tok = int(model.forward(torch.tensor(feed), step, fmt, pool.store)[0].argmax())
        cache.advance(n)
        out.append(tok)
        ids.append(tok)
        feed = [tok]
    return out


@pytest.mark.parametrize("window, chunk", [(24, 0), (0, 32)])
def test_endless_stream_keeps_memory_bounded(tiny, embedded, window, chunk):
    _, tok = embedded
    cfg = tiny.cfg
    fmt = make_format("fp32", cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 64)
    engine = Engine(tiny, pool, Scheduler(KVManager(pool, TieredKV(pool), warm_bytes=0), token_budget=16),
                    window=window, chunk=chunk)  # not started: steps are run here
    prompt, n_new = list(range(300, 340)), 260  # 300 tokens: 75 blocks of 4 without freeing
    seq = Sequence(prompt, SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True), tok, [2],
                   lambda ev: None, PagedKVCache(pool))
    engine.submit(seq)
    engine.step()  # takes seq from the inbox: the engine is busy from here on
    peak = pool.used
    while not engine.idle:
        engine.step()
        peak = max(peak, pool.used)
    bound = -(-(window or chunk) // 4) + 2
    assert peak <= bound, (peak, bound)
    assert pool.used == 0
    assert seq.output_ids == greedy_reference(tiny, prompt, n_new, window, chunk)
