"""Hot / warm / cold homes for a sequence's KV blocks, so idle sequences need not hold pool blocks.

hot   the block is in the BlockPool, where attention reads it.
warm  the block lives in host memory outside the pool, in the form its WarmCodec gives it.
cold  the warm form written to a file in this TieredKV's own directory.

A demoted block gives its pool block back and leaves a hole (HOLE) in `cache.blocks`; the
block table must not reach a forward pass with holes in it, so `promote(cache)` fills every
hole with a freshly allocated pool block. Block ids change across a round trip; the data does
not (raw codec).

Everything runs on the caller's thread (the engine's): a block copy is a parallel torch op, and
a second thread running them keeps a second OpenMP pool that slows decode from then on.

Cold files: each TieredKV writes into a fresh directory of its own (under `cold_dir` when
given, else the system temp dir) and removes it on close; every file starts with a header
(this instance's random token, the block's fill and payload layout) that is checked before a
block is read back, so a file left by a killed process, or any file not written by this
instance for this block, is never read back as someone's KV.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import os
import secrets
import shutil
import struct
import tempfile
import uuid
import weakref
from dataclasses import dataclass

import torch

from kvgen.engine.kv import quant
from kvgen.engine.kv.formats import PlainFormat
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool

HOLE = -1  # cache.blocks entry of a block that is not in the pool
CODECS = ("raw", "fp8", "q4")
MAGIC = b"KVGCOLD1"


class Tier(enum.IntEnum):
    HOT = 0
    WARM = 1
    COLD = 2


class ColdFileInvalid(RuntimeError):
    """A cold file is not the one this TieredKV wrote for the block (another process's, or
    changed on disk): its block is lost, never read back."""


Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


@dataclass
class _Parked:
    """One block outside the pool."""

    tier: Tier
    fill: int  # tokens written in the block
    tensors: dict[str, torch.Tensor] | None  # warm payload (None once cold)
    layout: Layout  # how the payload is laid out on disk
    path: str | None = None  # cold file

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for _, dt, shape in self.layout)


class WarmCodec:
    """How a block is held outside the pool, chosen once:

    raw  the block's slice of every store tensor (format.take_block): exact, any format.
    fp8  its K/V as E4M3, one scale per layer, k|v and head (quant.fp8_quantize_blocks).
    q4   its K/V as 4-bit codes, float16 scales per token and group of min(32, head_dim)
         (quant.q4_quantize).
    The lossy two read the block through the format and write it back through it; they are
    for plain pools (fp32 / fp16 / bf16), whose raw blocks are large: fp8 holds 2x (fp16) to 4x
    (fp32) more idle tokens in the same host memory, q4 3.5x to 7x. With `kernels` (a CUDA
    pool) they run the Numba bulk kernels (kvgen.gpu.codecs.pack_* / unpack_*, bit-exact with
    quant), so only the small payload crosses to the host.
    """

    def __init__(self, name: str, fmt, kernels: bool = False):
        if name not in CODECS:
            raise ValueError(f"unknown warm codec {name!r}; expected one of {', '.join(CODECS)}")
        if name != "raw" and not isinstance(fmt, PlainFormat):
            raise ValueError(f"the {name} warm codec is for fp32/fp16/bf16 KV pools, not {fmt.name}: "
                             "re-quantizing quantized blocks loses twice and saves little")
        self.name, self.fmt = name, fmt
        group = min(32, fmt.head_dim)
        if kernels and name != "raw":
            from kvgen.gpu import codecs

            lossy = {"fp8": (codecs.pack_fp8, codecs.unpack_fp8),
                     "q4": (functools.partial(codecs.pack_q4, group=group),
                            functools.partial(codecs.unpack_q4, group=group))}
        else:
            lossy = {"fp8": (quant.fp8_quantize_blocks, quant.fp8_dequantize_blocks),
                     "q4": (functools.partial(quant.q4_quantize, group=group),
                            functools.partial(quant.q4_dequantize, group=group))}
        self._pack, self._unpack = lossy.get(name, (None, None))

    def encode(self, store: dict, block: int, fill: int) -> dict[str, torch.Tensor]:
        """The block's payload, in host memory."""
        if self.name == "raw":
            return {n: t.cpu() for n, t in self.fmt.take_block(store, block, fill).items()}
        fmt = self.fmt
        ids = torch.tensor([block], device=next(iter(store.values())).device)
        x = torch.stack([torch.stack(fmt.read(store, layer, ids))[:, 0, :fill]
                         for layer in range(fmt.num_layers)]).float()  # [L, 2, fill, KVH, HD]
        q, scale = self._pack(x)
        return {"q": q.cpu(), "scale": scale.cpu()}

    def decode(self, store: dict, block: int, payload: dict[str, torch.Tensor], fill: int) -> None:
        """Put a payload back into a freshly allocated pool block."""
        if self.name == "raw":
            self.fmt.put_block(store, block, payload, fill)
            return
        dev = next(iter(store.values())).device
        x = self._unpack(payload["q"].to(dev), payload["scale"].to(dev))  # [L, 2, fill, KVH, HD] float32
        blocks, offsets = torch.full((fill,), block, device=dev), torch.arange(fill, device=dev)
        for layer in range(self.fmt.num_layers):  # re-encoded into the pool's own format
            self.fmt.write(store, layer, blocks, offsets, x[layer, 0], x[layer, 1])


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
            written = -(-cache.rows // cache.pool.block_size)
            for i in range(written):
                if cache.blocks[i] != HOLE:
                    last, count = stats.get(i, (0, 0))
                    ranked.append((last, count, i, id(cache), cache))
        ranked.sort(key=lambda r: r[:4])
        return [(r[4], r[2]) for r in ranked[:n]]


class TieredKV:
    """codec: the warm form, "raw" (exact bytes) or "fp8" / "q4" (lossy, smaller; plain pools
    only): see WarmCodec. cold_dir: where this instance makes its own directory (default: the
    system temp dir)."""

    def __init__(self, pool: BlockPool, codec: str = "raw", cold_dir: str | None = None,
                 policy: AccessPolicy | None = None):
        self.pool = pool
        self.fmt = pool.fmt
        self.codec = WarmCodec(codec, pool.fmt, kernels=pool.device.type == "cuda")
        self.policy = policy or AccessPolicy()
        self._parent = cold_dir
        self.cold_dir: str | None = None  # ours, made on the first cold write: most servers never spill
        self._token = secrets.token_bytes(16)  # marks the cold files this instance wrote
        self._parked: dict[PagedKVCache, dict[int, _Parked]] = {}
        self._bytes = {Tier.WARM: 0, Tier.COLD: 0}
        self._closed = False

    # where blocks are

    def tier(self, cache: PagedKVCache, index: int) -> Tier:
        p = self._parked.get(cache, {}).get(index)
        return Tier.HOT if p is None else p.tier

    def parked(self, cache: PagedKVCache) -> int:
        """Blocks of this cache outside the pool."""
        return len(self._parked.get(cache, {}))

    def nbytes(self, tier: Tier) -> int:
        """Payload bytes held in a tier (warm: host memory; cold: disk, headers not counted)."""
        return self._bytes.get(Tier(tier), 0)

    # moving blocks

    def demote(self, cache: PagedKVCache, index: int, tier: Tier = Tier.WARM) -> None:
        """Move block `index` of the cache down to `tier` (hot -> warm | cold, warm -> cold)."""
        tier = Tier(tier)
        if tier == Tier.HOT:
            raise ValueError("use promote() to bring blocks back to the pool")
        p = self._parked.get(cache, {}).get(index)
        if p is None:
            p = self._park(cache, index)
        if p.tier < tier:  # warm -> cold
            self._write_cold(p)

    def _park(self, cache: PagedKVCache, index: int) -> _Parked:
        bs = self.pool.block_size
        if not 0 <= index < -(-cache.rows // bs):
            raise ValueError(f"block {index} of a {cache.rows}-row cache holds no tokens")
        block = cache.blocks[index]
        fill = min(bs, cache.rows - index * bs)
        tensors = self.codec.encode(self.pool.store, block, fill)
        p = _Parked(Tier.WARM, fill, tensors, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
        self._parked.setdefault(cache, {})[index] = p
        self._bytes[Tier.WARM] += p.nbytes
        cache.blocks[index] = HOLE
        self.pool.free([block])
        return p

    def promote(self, cache: PagedKVCache) -> int:
        """Bring every parked block of the cache back into fresh pool blocks. Returns how many
        came back. Changes nothing when it raises: PoolExhausted (the pool is short) or
        ColdFileInvalid (`truncate` keeps what comes before such a block instead)."""
        items = sorted(self._parked.get(cache, {}).items())
        if not items:
            return 0
        payloads = [p.tensors if p.tensors is not None else self._read_cold(p) for _, p in items]
        fresh = self.pool.alloc(len(items))  # all or nothing
        for (index, p), payload, block in zip(items, payloads, fresh, strict=True):
            self.codec.decode(self.pool.store, block, payload, p.fill)
            cache.blocks[index] = block
            self._drop(p)
        del self._parked[cache]
        return len(items)

    # policy

    def touch(self, cache: PagedKVCache, indices=None) -> None:
        """Record that attention read these blocks of the cache (all by default)."""
        self.policy.touch(cache, indices)

    def make_room(self, need: int, tier: Tier = Tier.WARM, exclude=(), only=None) -> bool:
        """Demote the policy's victims until the pool has `need` free blocks; exclude the caches
        that are about to run (or name the idle ones in `only`). Returns whether there is room."""
        short = need - self.pool.available
        if short > 0:
            for cache, index in self.policy.victims(short, exclude, only):
                self.demote(cache, index, tier)
        return self.pool.available >= need

    def spill(self, max_warm_bytes: int) -> int:
        """Write warm blocks to cold files, least recently read first, until the warm tier holds
        at most max_warm_bytes. Returns how many blocks went cold."""
        warm = sorted((*self.policy.rank(c, i), i, id(c), c) for c, blocks in self._parked.items()
                      for i, p in blocks.items() if p.tier == Tier.WARM)
        moved = 0
        for *_, index, _, cache in warm:
            if self._bytes[Tier.WARM] <= max_warm_bytes:
                break
            self._write_cold(self._parked[cache][index])
            moved += 1
        return moved

    # keeping the cache's own verbs working

    def truncate(self, cache: PagedKVCache, new_len: int) -> None:
        """cache.truncate for a cache with parked blocks: parked blocks past new_len are
        dropped, the rest are promoted (the next turn reads them anyway). A cold block whose
        file fails its check is lost: the cache keeps only the tokens before it. Raises
        PoolExhausted (nothing dropped beyond new_len) when the pool is too short."""
        bs = self.pool.block_size
        new_len = max(0, min(new_len, cache.length))
        if new_len < cache.compressed_to:  # cut inside compressed rows (compress.py): from the start
            new_len = 0
        rows = new_len - cache.removed if new_len else 0  # a compressed cache holds fewer rows than tokens
        parked = self._parked.get(cache, {})
        for index in sorted(i for i, p in parked.items() if p.tier == Tier.COLD and i * bs < rows):
            if not self._cold_file_ok(parked[index]):
                rows = index * bs
                new_len = rows + cache.removed if rows >= cache.compressed_to - cache.removed else 0
                rows = rows if new_len else 0
                break
        keep = -(-rows // bs)
        for index in [i for i in parked if i >= keep]:
            self._drop(parked.pop(index))
        if not parked:
            self._parked.pop(cache, None)
        cache.blocks = cache.blocks[:keep] + [b for b in cache.blocks[keep:] if b != HOLE]
        self.promote(cache)
        cache.truncate(new_len)

    def reset(self, cache: PagedKVCache) -> None:
        """cache.reset, dropping its parked blocks (and cold files) and the policy's memory of it."""
        self.truncate(cache, 0)
        self.policy.forget(cache)

    def close(self) -> None:
        """Delete every cold file and our directory."""
        if self._closed:
            return
        self._closed = True
        for blocks in self._parked.values():
            for p in blocks.values():
                self._drop(p)
        self._parked.clear()
        if self.cold_dir:
            shutil.rmtree(self.cold_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # disk

    def _header(self, p: _Parked) -> bytes:
        meta = json.dumps({"fill": p.fill, "layout": [[n, str(dt), list(s)] for n, dt, s in p.layout]}).encode()
        return MAGIC + self._token + struct.pack("<I", len(meta)) + meta

    def _write_cold(self, p: _Parked) -> None:
        if self.cold_dir is None:
            if self._parent:
                os.makedirs(self._parent, exist_ok=True)
            self.cold_dir = tempfile.mkdtemp(prefix="kvgen-cold-", dir=self._parent or None)
        path = os.path.join(self.cold_dir, f"{uuid.uuid4().hex}.kv")
        with open(path, "wb") as f:
            f.write(self._header(p))
            for name, _, _ in p.layout:
                f.write(p.tensors[name].cpu().contiguous().view(torch.uint8).numpy().tobytes())
        self._bytes[Tier.WARM] -= p.nbytes
        self._bytes[Tier.COLD] += p.nbytes
        p.path, p.tensors, p.tier = path, None, Tier.COLD

    def _cold_file_ok(self, p: _Parked) -> bool:
        header = self._header(p)
        try:
            with open(p.path, "rb") as f:
                return f.read(len(header)) == header and os.fstat(f.fileno()).st_size == len(header) + p.nbytes
        except OSError:
            return False

    def _read_cold(self, p: _Parked) -> dict[str, torch.Tensor]:
        header = self._header(p)
        with open(p.path, "rb") as f:
            raw = bytearray(f.read())
        if raw[:len(header)] != header or len(raw) != len(header) + p.nbytes:
            raise ColdFileInvalid(f"{p.path} is not the cold block this process wrote")
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        out, at = {}, len(header)
        for name, dtype, shape in p.layout:
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            # clone: a view as a wider dtype needs an aligned start, which a slice may not have
            out[name] = flat[at:at + n].clone().view(dtype).reshape(shape)
            at += n
        return out

    def _drop(self, p: _Parked) -> None:
        """Forget a parked block: its bytes leave the tier's count, its cold file goes."""
        self._bytes[p.tier] -= p.nbytes
        if p.path is not None:
            try:
                os.remove(p.path)
            except FileNotFoundError:
                pass
            p.path = None
