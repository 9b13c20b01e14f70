"""Tiered KV store: blocks leave the pool (warm: host memory, cold: disk) and come back intact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvgen.engine.attention import Step
from kvgen.engine.kv.formats import KV_DTYPES, make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.tiers import HOLE, AccessPolicy, ColdFileInvalid, Tier, TieredKV
from kvgen.errors import PoolExhausted

L, BS, KVH, HD = 2, 4, 2, 16


def filled_cache(pool: BlockPool, n: int, seed: int = 0) -> PagedKVCache:
    """A cache holding n random tokens, written as a forward pass writes them."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(pool)
    cache.reserve(n)
    blocks, offsets = cache.slots(0, n)
    for layer in range(L):
        k, v = torch.randn(2, n, KVH, HD, generator=gen) * 3
        pool.fmt.write(pool.store, layer, blocks, offsets, k, v, torch.arange(n))
    cache.advance(n)
    return cache


def snapshot(cache: PagedKVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K, V [length, kv_heads, head_dim], read back from the blocks."""
    fmt, out = cache.pool.fmt, []
    live = torch.tensor(cache.blocks[: -(-cache.length // fmt.block_size)])
    for layer in range(L):
        k, v = fmt.read(cache.pool.store, layer, live)
        out.append((k.reshape(-1, KVH, HD)[: cache.length], v.reshape(-1, KVH, HD)[: cache.length]))
    return out


def cold_files(tiers: TieredKV) -> list[str]:
    return sorted(os.listdir(tiers.cold_dir)) if tiers.cold_dir and os.path.isdir(tiers.cold_dir) else []


@pytest.mark.parametrize(("name", "recent"), [(n, 0) for n in KV_DTYPES] + [(n, 2) for n in ("fp8", "q4", "q3")])
def test_lossless_round_trip_is_bit_exact(name, recent):
    pool = BlockPool(make_format(name, L, BS, KVH, HD, recent_slots=recent or None), 8)
    cache = filled_cache(pool, 10)  # 3 blocks, the last one half full (kept exact with recent slots)
    staged = L * 2 * BS * KVH * HD * 4 if recent else 0  # the exact rows travel with the block
    if recent:
        assert list(pool.fmt.recent.held) == [cache.blocks[2]] and pool.exact_blocks_used == 1
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
        assert pool.exact_blocks_used == (1 if recent else 0)  # the half-full block is exact again


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
    with pytest.raises(ValueError):  # lossy codecs are for plain pools
        TieredKV(BlockPool(make_format("q4", L, BS, KVH, HD), 2), codec=codec)


# On a CUDA pool the lossy codecs run the Numba bulk kernels (kvgen.gpu.codecs.pack_* / unpack_*).
# Numba's CUDA simulator runs those kernels on CPU tensors; it must be switched on before numba
# is imported, hence a subprocess.
KERNEL_CODEC_CHECK = """
import torch
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv.tiers import Tier, TieredKV, WarmCodec
from kvgen.gpu import codecs

assert codecs.numba_simulated()
L, BS, KVH, HD = 2, 4, 2, 16


def bits(t):
    return t.contiguous().view(torch.uint8)


gen = torch.Generator().manual_seed(0)
for name in ("fp32", "fp16", "bf16"):
    for codec in ("fp8", "q4"):
        pool = BlockPool(make_format(name, L, BS, KVH, HD), 6)
        assert pool.alloc(6) == list(range(6))
        fills = (BS, 3)
        for b, fill in enumerate(fills):
            x = torch.randn(2, fill, KVH, HD, generator=gen)
            x = x * 10.0 ** torch.randint(-2, 3, (1, fill, KVH, 1), generator=gen)  # heads of every size
            for layer in range(L):
                pool.fmt.write(pool.store, layer, torch.full((fill,), b), torch.arange(fill), x[0] * (layer + 1), x[1])
        kern, ref = WarmCodec(codec, pool.fmt, kernels=True), WarmCodec(codec, pool.fmt, kernels=False)
        for b, fill in enumerate(fills):
            pk, pr = kern.encode(pool.store, b, fill), ref.encode(pool.store, b, fill)
            assert pk.keys() == pr.keys() and all(torch.equal(bits(pk[n]), bits(pr[n])) for n in pk), (name, codec)
            kern.decode(pool.store, 2 + 2 * b, pk, fill)
            ref.decode(pool.store, 3 + 2 * b, pr, fill)
            for n, t in pool.store.items():
                assert torch.equal(bits(t[2 + 2 * b]), bits(t[3 + 2 * b])), (name, codec, n)
        # and through TieredKV: demote and promote with the kernel codec
        tiers = TieredKV(pool, codec=codec)
        tiers.codec = kern
        from kvgen.engine.kv.paged import PagedKVCache
        cache = PagedKVCache(pool)
        cache.blocks, cache.length = [2, 4], BS + 3
        tiers.demote(cache, 0, Tier.WARM)
        tiers.demote(cache, 1, Tier.COLD)
        assert tiers.promote(cache) == 2
        for i, b in enumerate(cache.blocks):
            for n, t in pool.store.items():
                assert torch.equal(bits(t[b]), bits(t[3 + 2 * i])), (name, codec, "tiers", n)
        tiers.close()
print("kernel codecs ok")
"""


@pytest.mark.heavy
@pytest.mark.slow  # ~50 s in Numba's CUDA simulator: run by `make test-slow`, for CI's time
def test_warm_codecs_on_the_numba_kernels_match_torch_bit_exactly(tmp_path):
    pytest.importorskip("numba")
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(KERNEL_CODEC_CHECK))
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0 and "kernel codecs ok" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]


def test_cold_files_live_in_a_directory_of_their_own(tmp_path):
    pool = BlockPool(make_format("fp32", L, BS, KVH, HD), 8)
    cache = filled_cache(pool, 8)
    tiers = TieredKV(pool)  # under the system temp dir
    tiers.demote(cache, 0, Tier.COLD)
    tiers.demote(cache, 1, Tier.COLD)
    own = tiers.cold_dir
    assert len(os.listdir(own)) == 2
    tiers.close()
    assert not os.path.exists(own)

    given = tmp_path / "cold"  # made if missing; each instance gets a fresh directory inside it
    a, b = TieredKV(pool, cold_dir=str(given)), TieredKV(pool, cold_dir=str(given))
    cache.reset()
    ca, cb = filled_cache(pool, 4), filled_cache(pool, 4, seed=1)
    a.demote(ca, 0, Tier.COLD)
    b.demote(cb, 0, Tier.COLD)
    assert Path(a.cold_dir).parent == Path(b.cold_dir).parent == given and a.cold_dir != b.cold_dir
    a.close()
    assert os.listdir(given) == [os.path.basename(b.cold_dir)]  # b's files are b's
    b.close()
    assert given.is_dir() and os.listdir(given) == []  # a given directory stays, our files go


def test_a_cold_file_not_written_by_this_instance_is_never_read_back(tmp_path):
    """A file left by a killed process (or any file at a block's path that this instance did
    not write for that block) fails its header check: promote refuses it, changing nothing, and
    truncate keeps only the tokens before the lost block."""
    pool = BlockPool(make_format("fp32", L, BS, KVH, HD), 12)
    mine, theirs = filled_cache(pool, 12), filled_cache(pool, 12, seed=1)
    before = snapshot(mine)
    killed = TieredKV(pool, cold_dir=str(tmp_path))  # never closed, as if its process died
    for i in range(3):
        killed.demote(theirs, i, Tier.COLD)
    with TieredKV(pool, cold_dir=str(tmp_path)) as tiers:
        for i in range(3):
            tiers.demote(mine, i, Tier.COLD)
        theirs_files = sorted(Path(killed.cold_dir).iterdir())
        mine_files = {tiers._parked[mine][i].path: i for i in range(3)}
        victim = next(p for p, i in mine_files.items() if i == 1)
        shutil.copyfile(theirs_files[0], victim)  # same layout and fill, another instance's token
        free = pool.available
        with pytest.raises(ColdFileInvalid):
            tiers.promote(mine)
        assert pool.available == free and tiers.parked(mine) == 3 and mine.blocks == [HOLE] * 3
        tiers.truncate(mine, 12)  # block 1 is lost: only block 0's tokens survive
        assert mine.length == BS and tiers.parked(mine) == 0 and os.listdir(tiers.cold_dir) == []
        for (k0, v0), (k1, v1) in zip(before, snapshot(mine), strict=True):
            assert torch.equal(k0[:BS], k1) and torch.equal(v0[:BS], v1)


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
        tiers.promote(cold)
        assert pool.available == pool.capacity - len(hot.blocks) - held
        assert _continue(model, fmt, pool, cold, first, 8) == _continue(model, fmt, pool, hot, first, 8)
