"""CompressedKVCache: full chunks become their mean, the rest stays exact, truncate is lossy."""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.kv.compressed import DEFAULT_CHUNK, CompressedKVCache

L, KVH, HD, C = 2, 3, 8, 16


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, KVH, HD, generator=gen), torch.randn(n, KVH, HD, generator=gen)


def feed(cache: CompressedKVCache, k: torch.Tensor, v: torch.Tensor, splits: list[int]) -> None:
    at = 0
    for n in splits:
        for layer in range(L):
            cache.update(layer, k[at:at + n] * (layer + 1), v[at:at + n] * (layer + 1))
        at += n


def chunk_means(x: torch.Tensor, chunks: int) -> torch.Tensor:
    return torch.stack([x[i * C:(i + 1) * C].mean(0) for i in range(chunks)])


@pytest.mark.parametrize("splits", [[50], [1] * 50, [7, 9, 16, 3, 15]])
def test_pooled_rows_are_chunk_means_and_recent_rows_exact(splits):
    k, v = kv(50)
    cache = CompressedKVCache(L, C)
    feed(cache, k, v, splits)
    assert cache.seq_len == 50
    for layer in range(L):
        gk, gv = cache.get(layer)
        s = layer + 1
        assert gk.shape == (3 + 2, KVH, HD)  # 3 pooled chunks + 2 recent tokens
        torch.testing.assert_close(gk[:3], chunk_means(k * s, 3))
        torch.testing.assert_close(gv[:3], chunk_means(v * s, 3))
        assert torch.equal(gk[3:], k[48:] * s) and torch.equal(gv[3:], v[48:] * s)
    assert cache.positions(0).tolist() == [15, 31, 47, 48, 49]


def test_seq_len_counts_a_step_once_the_last_layer_has_it():
    k, v = kv(5)
    cache = CompressedKVCache(L, C)
    assert cache.get(0) is None and cache.seq_len == 0
    cache.update(0, k, v)
    assert cache.seq_len == 0
    cache.update(1, k, v)
    assert cache.seq_len == 5


def test_truncate_in_the_recent_part_is_exact():
    k, v = kv(40)
    cache = CompressedKVCache(L, C)
    feed(cache, k, v, [40])  # 2 chunks + 8 recent
    assert cache.truncate(36) == 36
    gk, gv = cache.get(0)
    assert gk.shape[0] == 2 + 4 and torch.equal(gk[2:], k[32:36]) and torch.equal(gv[2:], v[32:36])
    assert cache.truncate(32) == 32 and cache.get(1)[0].shape[0] == 2  # a chunk boundary: nothing lost
    assert cache.truncate(100) == 32  # never grows


def test_truncate_inside_a_pooled_chunk_drops_it_and_everything_after():
    k, v = kv(40)
    cache = CompressedKVCache(L, C)
    feed(cache, k, v, [40])
    assert cache.truncate(20) == 16  # chunk 1 (tokens 16..31) cannot be split
    gk, _ = cache.get(0)
    torch.testing.assert_close(gk, chunk_means(k, 1))
    # Recomputing from the returned length continues as if the tail had never been there.
    feed(cache, k[16:], v[16:], [24])
    fresh = CompressedKVCache(L, C)
    feed(fresh, k, v, [40])
    for a, b in zip(cache.get(1), fresh.get(1), strict=True):
        torch.testing.assert_close(a, b)
    assert cache.truncate(0) == 0 and cache.get(0) is None


def test_memory_is_bounded_by_chunks():
    cache = CompressedKVCache(L, C)
    row = 2 * KVH * HD * 4  # one k and one v row, float32
    for step in range(1000):
        k, v = kv(1, seed=step)
        for layer in range(L):
            cache.update(layer, k, v)
        assert cache.nbytes() <= L * row * (cache.seq_len // C + C)
    assert cache.get(0)[0].shape[0] == 1000 // C + 1000 % C
    cache.reset()
    assert cache.seq_len == 0 and cache.nbytes() == 0


def test_bf16_keeps_its_dtype_and_averages_in_float32():
    k = torch.full((C, 1, 4), 1.0, dtype=torch.bfloat16)
    k[0] = 200.0  # in bf16 running sums, the small terms would be lost next to this one
    cache = CompressedKVCache(1, C)
    cache.update(0, k, k)
    gk, _ = cache.get(0)
    assert gk.dtype == torch.bfloat16
    assert gk[0, 0, 0].item() == pytest.approx((200 + 15) / 16, rel=1 / 128)


def test_default_chunk_size():
    assert CompressedKVCache(1, 0).chunk_size == DEFAULT_CHUNK == 64
