"""Hot / warm / cold homes for a sequence's KV blocks, so idle sequences need not hold pool blocks.

hot   the block is in the BlockPool, where attention reads it.
warm  the block lives in host memory outside the pool: its slice of every store tensor
      (codec "raw": the exact bytes, lossless), or its K/V re-quantized to fp8 / q4 (lossy,
      smaller; meant for fp32/fp16/bf16 pools, where raw blocks are large).
cold  the warm form written to a file under the cold directory (KV_COLD_DIR, else a temp dir).

A demoted block gives its pool block back and leaves a hole (HOLE) in `cache.blocks`; the
block table must not reach a forward pass with holes in it, so `promote(cache)` (or an earlier
`prefetch(cache)`, which does the same on a background thread) fills every hole with a freshly
allocated pool block. Block ids change across a round trip; the data does not (raw codec).

The tier store only touches a cache through its block table, its length and the pool, and the
caller serialises work on one cache: no forward pass, truncate or demote on a cache while a
prefetch of it may run; `promote` waits for that prefetch first.
"""

from __future__ import annotations

import enum
import math
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvgen.engine.kv import quant
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool

HOLE = -1  # cache.blocks entry of a block that is not in the pool
CODECS = ("raw", "fp8", "q4")


class Tier(enum.IntEnum):
    HOT = 0
    WARM = 1
    COLD = 2


@dataclass
class _Parked:
    """One block outside the pool."""

    tier: Tier
    fill: int  # tokens written in the block
    tensors: dict[str, torch.Tensor] | None  # warm payload
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]]  # how the payload is laid out on disk
    path: str | None = None  # cold file

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for _, dt, shape in self.layout)


class AccessPolicy:
    """Picks the hot blocks to demote: least recently read first, then the least read, then
    the oldest tokens. The engine reports reads with `touch`; per-block counts matter when
    attention skips blocks (a sliding window never reads old blocks again)."""

    def __init__(self):
        self._tick = 0
        # cache -> index -> [last tick, count]; weak, so finished sequences drop out by themselves
        self._seen: weakref.WeakKeyDictionary[PagedKVCache, dict[int, list[int]]] = weakref.WeakKeyDictionary()

    def touch(self, cache: PagedKVCache, indices=None) -> None:
        self._tick += 1
        stats = self._seen.setdefault(cache, {})
        for i in range(len(cache.blocks)) if indices is None else indices:
            s = stats.setdefault(i, [0, 0])
            s[0], s[1] = self._tick, s[1] + 1

    def forget(self, cache: PagedKVCache) -> None:
        self._seen.pop(cache, None)

    def rank(self, cache: PagedKVCache, index: int) -> tuple[int, int]:
        """(last read tick, read count) of a block: lower goes down first."""
        return tuple(self._seen.get(cache, {}).get(index, (0, 0)))

    def victims(self, n: int, exclude=(), only=None) -> list[tuple[PagedKVCache, int]]:
        """Up to n (cache, block index) pairs of written hot blocks, best to demote first,
        among the caches seen (or `only` these), never from the `exclude`d ones."""
        skip = {id(c) for c in exclude}
        ranked = []
        for cache in list(self._seen) if only is None else only:
            stats = self._seen.get(cache, {})
            if id(cache) in skip:
                continue
            written = -(-cache.length // cache.pool.block_size)
            for i in range(written):
                if cache.blocks[i] != HOLE:
                    last, count = stats.get(i, (0, 0))
                    ranked.append((last, count, i, id(cache), cache))
        ranked.sort(key=lambda r: r[:4])
        return [(r[4], r[2]) for r in ranked[:n]]


class TieredKV:
    def __init__(self, pool: BlockPool, codec: str = "raw", cold_dir: str | None = None,
                 policy: AccessPolicy | None = None):
        if codec not in CODECS:
            raise ValueError(f"unknown tier codec {codec!r}; expected one of {', '.join(CODECS)}")
        self.pool = pool
        self.fmt = pool.fmt
        self.codec = codec
        self.policy = policy or AccessPolicy()
        cold_dir = cold_dir or os.environ.get("KV_COLD_DIR") or None
        # A directory we created is ours to delete; a given one outlives us (only our files go).
        # Made on the first cold write: most servers never spill to disk.
        self._own_dir = cold_dir is None
        self.cold_dir = cold_dir
        self._parked: dict[PagedKVCache, dict[int, _Parked]] = {}
        self._inflight: dict[PagedKVCache, Future] = {}
        self._lock = threading.RLock()
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgen-prefetch")
        self._closed = False

    # where blocks are

    def tier(self, cache: PagedKVCache, index: int) -> Tier:
        with self._lock:
            p = self._parked.get(cache, {}).get(index)
        return Tier.HOT if p is None else p.tier

    def parked(self, cache: PagedKVCache) -> int:
        """Blocks of this cache outside the pool."""
        with self._lock:
            return len(self._parked.get(cache, {}))

    def nbytes(self, tier: Tier) -> int:
        with self._lock:
            return sum(p.nbytes for blocks in self._parked.values() for p in blocks.values() if p.tier == tier)

    # moving blocks

    def demote(self, cache: PagedKVCache, index: int, tier: Tier = Tier.WARM) -> None:
        """Move block `index` of the cache down to `tier` (hot -> warm | cold, warm -> cold)."""
        tier = Tier(tier)
        if tier == Tier.HOT:
            raise ValueError("use promote() to bring blocks back to the pool")
        with self._lock:
            p = self._parked.get(cache, {}).get(index)
            if p is None:
                p = self._park(cache, index)
            if p.tier < tier:  # warm -> cold
                self._write_cold(p)

    def _park(self, cache: PagedKVCache, index: int) -> _Parked:
        bs = self.pool.block_size
        if not 0 <= index < -(-cache.length // bs):
            raise ValueError(f"block {index} of a {cache.length}-token cache holds no tokens")
        block = cache.blocks[index]
        fill = min(bs, cache.length - index * bs)
        tensors = self._encode(block, fill)
        p = _Parked(Tier.WARM, fill, tensors, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
        self._parked.setdefault(cache, {})[index] = p
        cache.blocks[index] = HOLE
        self.pool.free([block])
        return p

    def promote(self, cache: PagedKVCache) -> int:
        """Bring every parked block of the cache back into fresh pool blocks (waiting for a
        prefetch of it first). Returns how many blocks came back; raises PoolExhausted,
        changing nothing, when the pool is short."""
        with self._lock:
            fut = self._inflight.pop(cache, None)
        if fut is not None:
            fut.result()
        return self._promote_now(cache)

    def prefetch(self, cache: PagedKVCache) -> Future:
        """Start promoting the cache on the background thread; the next promote() waits for it.
        A prefetch that fails (pool short) is forgotten: promote() then tries again itself."""
        with self._lock:
            fut = self._inflight.get(cache)
            if fut is None:
                fut = self._inflight[cache] = self._prefetcher.submit(self._promote_now, cache)
                fut.add_done_callback(lambda f, c=cache: self._settled(c, f))
        return fut

    def _settled(self, cache: PagedKVCache, fut: Future) -> None:
        with self._lock:
            if self._inflight.get(cache) is fut:
                del self._inflight[cache]

    def _promote_now(self, cache: PagedKVCache) -> int:
        with self._lock:
            items = sorted(self._parked.get(cache, {}).items())
            if not items:
                return 0
            fresh = self.pool.alloc(len(items))  # all or nothing
        # Copying happens outside the lock: the pool blocks are ours and no one else
        # touches this cache meanwhile (the caller's contract).
        for (index, p), block in zip(items, fresh, strict=True):
            self._restore(p, block)
            with self._lock:
                cache.blocks[index] = block
                self.pool.set_fill(block, p.fill)
                del self._parked[cache][index]
            self._unlink(p)
        with self._lock:
            if not self._parked.get(cache):
                self._parked.pop(cache, None)
        return len(items)

    # policy

    def touch(self, cache: PagedKVCache, indices=None) -> None:
        """Record that attention read these blocks of the cache (all by default)."""
        with self._lock:
            self.policy.touch(cache, indices)

    def make_room(self, need: int, tier: Tier = Tier.WARM, exclude=(), only=None) -> bool:
        """Demote the policy's victims until the pool has `need` free blocks; exclude the caches
        that are about to run (or name the idle ones in `only`). Returns whether there is room."""
        with self._lock:
            short = need - self.pool.available
            if short > 0:
                for cache, index in self.policy.victims(short, exclude, only):
                    self.demote(cache, index, tier)
            return self.pool.available >= need

    def spill(self, max_warm_bytes: int) -> int:
        """Write warm blocks to cold files, least recently read first, until the warm tier holds
        at most max_warm_bytes. Returns how many blocks went cold."""
        with self._lock:
            warm = sorted((*self.policy.rank(c, i), i, id(c), c) for c, blocks in self._parked.items()
                          for i, p in blocks.items() if p.tier == Tier.WARM)
            total, moved = self.nbytes(Tier.WARM), 0
            for *_, index, _, cache in warm:
                if total <= max_warm_bytes:
                    break
                p = self._parked[cache][index]
                total -= p.nbytes
                self._write_cold(p)
                moved += 1
            return moved

    # keeping the cache's own verbs working

    def truncate(self, cache: PagedKVCache, new_len: int) -> None:
        """cache.truncate for a cache with parked blocks: parked blocks past new_len are
        dropped, the rest are promoted (the next turn reads them anyway)."""
        self.promote_wait(cache)
        keep = -(-max(0, min(new_len, cache.length)) // self.pool.block_size)
        with self._lock:
            for index in [i for i in self._parked.get(cache, {}) if i >= keep]:
                self._unlink(self._parked[cache].pop(index))
            cache.blocks = cache.blocks[:keep] + [b for b in cache.blocks[keep:] if b != HOLE]
        self.promote(cache)
        cache.truncate(new_len)

    def reset(self, cache: PagedKVCache) -> None:
        """cache.reset, dropping its parked blocks (and cold files) and the policy's memory of it."""
        self.truncate(cache, 0)
        with self._lock:
            self.policy.forget(cache)

    def promote_wait(self, cache: PagedKVCache) -> None:
        """Wait for an in-flight prefetch of the cache, if any, without promoting anything."""
        with self._lock:
            fut = self._inflight.pop(cache, None)
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Stop the prefetch thread and delete every cold file (and the directory, if ours)."""
        if self._closed:
            return
        self._closed = True
        self._prefetcher.shutdown(wait=True)
        with self._lock:
            for blocks in self._parked.values():
                for p in blocks.values():
                    self._unlink(p)
            self._parked.clear()
        if self._own_dir and self.cold_dir:
            shutil.rmtree(self.cold_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # payloads

    def _encode(self, block: int, fill: int) -> dict[str, torch.Tensor]:
        if self.codec == "raw":
            return self.fmt.take_block(self.pool.store, block, fill)
        x = self._read_block(block)[:, :, :fill]  # [L, 2, fill, KVH, HD] float32
        if self.codec == "fp8":
            # One scale per layer, k|v and head, as Fp8Format keeps per block.
            scale = x.abs().amax(dim=(2, 4)) / quant.FP8_MAX
            return {"q": quant.fp8_quantize(x, scale[:, :, None, :, None]), "scale": scale}
        q, s = quant.q4_quantize(x, min(32, self.fmt.head_dim))
        return {"q": q, "scale": s}

    def _decode(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.codec == "fp8":
            return quant.fp8_dequantize(t["q"], t["scale"][:, :, None, :, None])
        return quant.q4_dequantize(t["q"], t["scale"], min(32, self.fmt.head_dim))

    def _read_block(self, block: int) -> torch.Tensor:
        ids = torch.tensor([block])
        return torch.stack([torch.stack(self.fmt.read(self.pool.store, layer, ids))[:, 0]
                            for layer in range(self.fmt.num_layers)]).float()

    def _restore(self, p: _Parked, block: int) -> None:
        t = p.tensors if p.tensors is not None else self._read_cold(p)
        if self.codec == "raw":
            self.fmt.put_block(self.pool.store, block, t, p.fill)
            return
        x = self._decode(t)
        blocks, offsets = torch.full((p.fill,), block), torch.arange(p.fill)
        for layer in range(self.fmt.num_layers):  # re-encoded into the pool's own format
            self.fmt.write(self.pool.store, layer, blocks, offsets, x[layer, 0], x[layer, 1])

    # disk

    def _write_cold(self, p: _Parked) -> None:
        if self.cold_dir is None:
            self.cold_dir = tempfile.mkdtemp(prefix="kvgen-cold-")
        os.makedirs(self.cold_dir, exist_ok=True)
        path = os.path.join(self.cold_dir, f"{uuid.uuid4().hex}.kv")
        with open(path, "wb") as f:
            for name, _, _ in p.layout:
                f.write(p.tensors[name].cpu().contiguous().view(torch.uint8).numpy().tobytes())
        p.path, p.tensors, p.tier = path, None, Tier.COLD

    def _read_cold(self, p: _Parked) -> dict[str, torch.Tensor]:
        with open(p.path, "rb") as f:
            raw = bytearray(f.read())
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out, at = {}, 0
        for name, dtype, shape in p.layout:
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            # clone: a view as a wider dtype needs an aligned start, which a slice may not have
            out[name] = flat[at:at + n].clone().view(dtype).reshape(shape)
            at += n
        return out

    @staticmethod
    def _unlink(p: _Parked) -> None:
        if p.path is not None:
            try:
                os.remove(p.path)
            except FileNotFoundError:
                pass
            p.path = None
