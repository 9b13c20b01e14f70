"""Tiered KV store: blocks leave the pool (warm: host memory, cold: disk) and come back intact."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvgen.engine.attention import Step
from kvgen.engine.kv.formats import KV_DTYPES, make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.errors import PoolExhausted
from kvgen.engine.kv.tiers import HOLE, AccessPolicy, Tier, TieredKV

L, BS, KVH, HD = 2, 4, 2, 16


def filled_cache(pool: BlockPool, n: int, seed: int = 0) -> PagedKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(pool)
    for layer in range(L):
        k, v = torch.randn(2, n, KVH, HD, generator=gen) * 3
        cache.update(layer, k, v)
    return cache


def snapshot(cache: PagedKVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [cache.get(layer) for layer in range(L)]


def cold_files(tiers: TieredKV) -> list[str]:
    return sorted(os.listdir(tiers.cold_dir)) if tiers.cold_dir and os.path.isdir(tiers.cold_dir) else []


@pytest.mark.parametrize(("name", "recent"), [(n, 0) for n in KV_DTYPES] + [(n, 2) for n in ("fp8", "q4", "q3")])
def test_lossless_round_trip_is_bit_exact(name, recent):
    pool = BlockPool(make_format(name, L, BS, KVH, HD, recent_slots=recent or None), 8)
    cache = filled_cache(pool, 10)  # 3 blocks, the last one half full (kept exact with recent slots)
    staged = L * 2 * BS * KVH * HD * 4 if recent else 0  # the exact rows travel with the block
    if recent:
        assert list(pool.store["stage"].recent.held) == [cache.blocks[2]]
    before = snapshot(cache)
    with TieredKV(pool) as tiers:
        free0 = pool.available
        tiers.demote(cache, 0, Tier.WARM)
        tiers.demote(cache, 2, Tier.COLD)
        tiers.demote(cache, 1, Tier.WARM)
        tiers.demote(cache, 1, Tier.COLD)  # warm -> cold
        assert cache.blocks == [HOLE] * 3 and pool.available == free0 + 3
        assert [tiers.tier(cache, i) for i in range(3)] == [Tier.WARM, Tier.COLD, Tier.COLD]
        assert len(cold_files(tiers)) == 2 and tiers.nbytes(Tier.COLD) == 2 * pool.fmt.bytes_per_block() + staged
        assert tiers.promote(cache) == 3
        assert HOLE not in cache.blocks and pool.available == free0
        assert cold_files(tiers) == [] and tiers.parked(cache) == 0
        for (k0, v0), (k1, v1) in zip(before, snapshot(cache), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        # the fill of the refilled last block is tracked again: 2 of its 4 slots unused
        assert pool.fragmentation_ratio() == pytest.approx(2 / 12)


@pytest.mark.parametrize("codec, size, tol", [("fp8", 0.6, 0.07), ("q4", 0.4, 0.15)])
def test_lossy_warm_codecs_round_trip_closely(codec, size, tol):
    pool = BlockPool(make_format("fp16", L, BS, KVH, HD), 8)
    cache = filled_cache(pool, 7)
    before = snapshot(cache)
    with TieredKV(pool, codec=codec) as tiers:
        tiers.demote(cache, 0, Tier.WARM)
        tiers.demote(cache, 1, Tier.COLD)
        assert tiers.nbytes(Tier.WARM) < size * pool.fmt.bytes_per_block()  # vs the raw fp16 block
        tiers.promote(cache)
    for (k0, v0), (k1, v1) in zip(before, snapshot(cache), strict=True):
        for a, b in ((k0, k1), (v0, v1)):
            err = (a.float() - b.float()).abs().max() / a.float().abs().max()
            assert 0 < err < tol, f"{codec}: relative error {err:.3f}"


def test_cold_files_removed_on_close(monkeypatch, tmp_path):
    pool = BlockPool(make_format("fp32", L, BS, KVH, HD), 8)
    cache = filled_cache(pool, 8)
    tiers = TieredKV(pool)  # its own temp dir
    tiers.demote(cache, 0, Tier.COLD)
    tiers.demote(cache, 1, Tier.COLD)
    own = tiers.cold_dir
    assert len(os.listdir(own)) == 2
    tiers.close()
    assert not os.path.exists(own)

    given = tmp_path / "cold"
    monkeypatch.setenv("KV_COLD_DIR", str(given))
    cache = filled_cache(pool, 4)
    tiers = TieredKV(pool)
    tiers.demote(cache, 0, Tier.COLD)
    assert tiers.cold_dir == str(given) and len(os.listdir(given)) == 1
    tiers.close()
    assert given.is_dir() and os.listdir(given) == []  # a given directory stays, our files go


def test_promote_all_or_nothing_when_the_pool_is_short():
    pool = BlockPool(make_format("fp32", L, BS, KVH, HD), 3)
    cache = filled_cache(pool, 12)
    with TieredKV(pool) as tiers:
        tiers.demote(cache, 0)
        tiers.demote(cache, 1)
        other = PagedKVCache(pool)
        other.reserve(2 * BS)  # takes the two freed blocks
        with pytest.raises(PoolExhausted):
            tiers.promote(cache)
        assert cache.blocks.count(HOLE) == 2 and tiers.parked(cache) == 2
        other.reset()
        assert tiers.promote(cache) == 2


def test_prefetch_promotes_in_the_background_and_promote_waits():
    pool = BlockPool(make_format("q4", L, BS, KVH, HD), 8)
    cache = filled_cache(pool, 12)
    before = snapshot(cache)
    with TieredKV(pool) as tiers:
        for i in range(3):
            tiers.demote(cache, i, Tier.COLD)
        gate = threading.Event()
        tiers._prefetcher.submit(gate.wait)  # hold the prefetch thread so the prefetch queues
        fut = tiers.prefetch(cache)
        assert tiers.prefetch(cache) is fut and not fut.done()  # one in flight per cache
        assert cache.blocks == [HOLE] * 3
        threading.Timer(0.05, gate.set).start()
        assert tiers.promote(cache) == 0  # waited: the prefetch brought all 3 back
        assert fut.result() == 3 and HOLE not in cache.blocks
        for (k0, v0), (k1, v1) in zip(before, snapshot(cache), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_policy_demotes_least_recently_used_then_least_read():
    pool = BlockPool(make_format("fp32", L, BS, KVH, HD), 6)
    a, b = filled_cache(pool, 8), filled_cache(pool, 8, seed=1)  # 2 blocks each
    with TieredKV(pool) as tiers:
        tiers.touch(a)
        tiers.touch(b, [1])  # b's block 0 is never read (out of a sliding window, say)
        tiers.touch(b, [1])
        assert tiers.policy.victims(3) == [(b, 0), (a, 0), (a, 1)]
        assert tiers.policy.victims(2, exclude=[b]) == [(a, 0), (a, 1)]
        assert tiers.policy.victims(9, only=[b]) == [(b, 0), (b, 1)]
        assert pool.available == 2
        assert tiers.make_room(4, Tier.COLD, exclude=[a])  # b is idle: its blocks go
        assert b.blocks == [HOLE, HOLE] and a.blocks.count(HOLE) == 0 and pool.available == 4
        assert isinstance(tiers.policy, AccessPolicy)


def test_truncate_and_reset_with_parked_blocks_keep_the_pool_consistent():
    pool = BlockPool(make_format("fp16", L, BS, KVH, HD), 8)
    cache = filled_cache(pool, 14)  # 4 blocks
    before = snapshot(cache)
    with TieredKV(pool) as tiers:
        for i in range(4):
            tiers.demote(cache, i, Tier.COLD if i % 2 else Tier.WARM)
        tiers.truncate(cache, 6)  # blocks 2, 3 dropped unread; 0, 1 promoted
        assert cache.length == 6 and len(cache.blocks) == 2 and HOLE not in cache.blocks
        assert cold_files(tiers) == [] and pool.available == 6
        for (k0, v0), (k1, v1) in zip(before, snapshot(cache), strict=True):
            assert torch.equal(k0[:6], k1) and torch.equal(v0[:6], v1)
        tiers.demote(cache, 1, Tier.COLD)
        tiers.reset(cache)
        assert cache.blocks == [] and pool.available == pool.capacity and cold_files(tiers) == []


# The real model: a session whose blocks went cold continues exactly as one that stayed hot.

def _forward(model, fmt, pool, cache, ids: list[int]) -> int:
    """Feed ids after what the cache holds; the greedy next token."""
    pos, n = cache.length, len(ids)
    cache.reserve(n)
    blocks, offsets = cache.slots(pos, n)
    step = Step(positions=torch.arange(pos, pos + n), write_blocks=blocks, write_offsets=offsets,
                query_lens=[n], context_lens=[pos + n], block_tables=torch.tensor([cache.blocks]),
                logits_rows=torch.tensor([n - 1]), is_decode=n == 1)
    logits = model.forward(torch.tensor(ids), step, fmt, pool.store)
    cache.advance(n)
    return int(logits[0].argmax())


def _continue(model, fmt, pool, cache, first: int, n: int) -> list[int]:
    out = [first]
    for _ in range(n - 1):
        out.append(_forward(model, fmt, pool, cache, [out[-1]]))
    return out


def test_cold_session_continues_like_a_hot_one(embedded):
    model, tok = embedded
    cfg = model.cfg
    fmt = make_format("fp16", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 16)
    ids = tok.encode("The lighthouse keeper climbed the stairs every evening at dusk, lit the lamp, "
                     "and wrote three lines in his log: the wind, the sea, and the ships that passed before dark. "
                     "One night in the winter")
    assert len(ids) > 32  # at least two full blocks and a partial one
    hot, cold = PagedKVCache(pool), PagedKVCache(pool)
    first = _forward(model, fmt, pool, hot, ids)
    assert _forward(model, fmt, pool, cold, ids) == first
    with TieredKV(pool) as tiers:
        # Between turns the session's blocks leave the pool, then come back before the next step.
        held = len(cold.blocks)
        for i in range(held):
            tiers.demote(cold, i, Tier.COLD if i % 2 == 0 else Tier.WARM)
        assert pool.available == pool.capacity - len(hot.blocks)
        tiers.prefetch(cold)
        tiers.promote(cold)
        assert pool.available == pool.capacity - len(hot.blocks) - held
        assert _continue(model, fmt, pool, cold, first, 8) == _continue(model, fmt, pool, hot, first, 8)
