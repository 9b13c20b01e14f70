"""Paged attention against a contiguous reference, and the pool's bookkeeping under random use."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def reference(q, k, v, causal_offset):
    """Plain attention on contiguous tensors: q [n, H, D], k/v [L, KVH, D]."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(q.shape[-1])
    n, L = q.shape[0], k.shape[0]
    mask = torch.arange(L)[None, :] > (torch.arange(n)[:, None] + causal_offset)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_paged_attention_equals_contiguous(seed, heads, kv_heads):
    rng = random.Random(seed)
    D, bs = 16, rng.choice([4, 16])
    fmt = make_format("fp32", 1, bs, kv_heads, D)
    pool = BlockPool(fmt, 256)
    free = list(range(256))
    rng.shuffle(free)  # blocks scattered through the pool
    B = rng.randint(1, 5)
    decode = rng.random() < 0.5
    ctx = [rng.randint(1, 70) for _ in range(B)]
    qlens = [1 if decode else rng.randint(1, c) for c in ctx]
    tables, ks, vs = [], [], []
    for c in ctx:
        blocks = [free.pop() for _ in range(-(-c // bs))]
        tables.append(blocks)
        k, v = torch.randn(c, kv_heads, D), torch.randn(c, kv_heads, D)
        pos = torch.arange(c)
        fmt.write(pool.store, 0, torch.tensor(blocks)[pos // bs], pos % bs, k, v)
        ks.append(k)
        vs.append(v)
    width = max(len(t) for t in tables)
    step = Step(positions=torch.zeros(sum(qlens), dtype=torch.long), write_blocks=torch.zeros(0),
                write_offsets=torch.zeros(0),
                query_lens=qlens, context_lens=ctx,
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                logits_rows=torch.zeros(B, dtype=torch.long), is_decode=decode)
    q = torch.randn(sum(qlens), heads, D)
    out = attend(q, fmt, pool.store, 0, step)
    start = 0
    for n, c, k, v in zip(qlens, ctx, ks, vs, strict=True):
        ref = reference(q[start:start + n], k, v, c - n)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n


def append(cache: PagedKVCache, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write one K, V [n, kv_heads, head_dim] per layer after what the cache holds, as a forward
    pass does: reserve, write every layer through the slots, advance."""
    n = kvs[0][0].shape[0]
    cache.reserve(n)
    blocks, offsets = cache.slots(cache.length, n)
    positions = torch.arange(cache.length, cache.length + n)
    for layer, (k, v) in enumerate(kvs):
        cache.pool.fmt.write(cache.pool.store, layer, blocks, offsets, k, v, positions)
    cache.advance(n)


def gather(cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [length - kv_start, kv_heads, head_dim] of one layer, read back from the blocks."""
    fmt = cache.pool.fmt
    live = torch.tensor(cache.blocks[cache.first:-(-cache.length // fmt.block_size)], dtype=torch.long)
    k, v = fmt.read(cache.pool.store, layer, live)
    shape, n = (-1, fmt.num_kv_heads, fmt.head_dim), cache.length - cache.kv_start
    return k.reshape(shape)[:n], v.reshape(shape)[:n]


def test_cache_verbs():
    """reserve / slots / advance / truncate / reset on one sequence's paged cache."""
    fmt = make_format("fp32", 2, 4, 2, 8)
    pool = BlockPool(fmt, 8)
    cache = PagedKVCache(pool)
    ks = [torch.randn(10, 2, 8) for _ in range(2)]
    append(cache, [(k, -k) for k in ks])
    assert cache.length == 10 and pool.used == 3 and cache.blocks_needed(2) == 0 and cache.blocks_needed(3) == 1
    k, v = gather(cache, 1)
    torch.testing.assert_close(k, ks[1])
    torch.testing.assert_close(v, -ks[1])
    assert len(cache.truncate(5)) == 1 and pool.used == 2
    k, _ = gather(cache, 0)
    torch.testing.assert_close(k, ks[0][:5])
    first = cache.blocks[0]
    assert cache.drop_before(4) == [first] and cache.blocks[0] == -1 and cache.kv_start == 4 and pool.used == 1
    assert cache.live_blocks == cache.blocks[1:]
    k, _ = gather(cache, 0)
    torch.testing.assert_close(k, ks[0][4:5])
    cache.reset()
    assert pool.used == 0 and cache.length == 0 and cache.blocks == []


# Property test: a tiny model through the real scheduler and engine, driven step by step.

@pytest.fixture(scope="module")
def tiny_model():
    cfg = tiny_config(layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=49152)
    return Model(cfg, tiny_weights(cfg))


ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 40), st.integers(1, 30)),  # prompt len, max new
    st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 50), st.integers(0, 60)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, blocks=st.integers(3, 24), budget=st.integers(4, 64))
def test_random_traffic_never_leaks_or_double_frees(tiny_model, embedded, ops, blocks, budget):
    _, tok = embedded
    cfg = tiny_model.cfg
    fmt = make_format("fp32", cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, blocks)
    sched = Scheduler(KVManager(pool, TieredKV(pool), warm_bytes=0), token_budget=budget, max_running=8)
    engine = Engine(tiny_model, pool, sched, max_waiting=1000)  # not started: steps are run here
    seqs, finished = [], []
    for op, a, b in ops:
        if op == "submit":
            if -(-(a + b) // 4) > blocks:
                continue  # would never fit; the generator rejects these up front
            s = Sequence(list(range(10, 10 + a)), SamplingParams(temperature=0, max_new_tokens=b, ignore_eos=True),
                         tok, [2], lambda ev, out=finished: ev.finish_reason and out.append(ev),
                         PagedKVCache(pool))
            engine.submit(s)
            seqs.append(s)
        elif op == "cancel" and seqs:
            engine.cancel(seqs[a % len(seqs)])  # takes effect at the next step
        elif op == "truncate" and seqs:
            s = seqs[a % len(seqs)]
            if s.finished or s not in sched.running:
                continue
            s.cache.truncate(min(b, s.cache.length))  # recompute from there
        else:
            for _ in range(a):
                engine.step()
        used = sum(len(s.cache.blocks) for s in seqs if not s.finished)
        assert pool.used == used  # every allocated block belongs to exactly one live sequence
    for _ in range(2000):
        engine.step()
        if engine.idle and not engine._cancelled:
            break
    assert engine.idle
    assert all(s.finished for s in seqs) and len(finished) == len(seqs)
    assert pool.available == pool.capacity
