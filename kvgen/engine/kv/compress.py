"""KV_COMPRESS: a long sequence's older K/V held in fewer rows, so long contexts fit in less memory.

A table's positions split in three (paged.py keeps the books):

    [0, compressed_to)          compressed: held in rows 0 .. compressed_to - removed
    [compressed_to, length - W) exact, old enough to compress next
    [length - W, length)        exact, the recent window W (KV_COMPRESS_WINDOW): never touched

Once CHUNK_BLOCKS whole blocks of exact rows lie before the window (checked after every engine
step, so at block boundaries), they are replaced by `ratio` as many rows (KV_COMPRESS_RATIO),
written into blocks of their own; the exact rows after them stay where they are, so the table
just gets shorter (`removed` grows). Keys keep the rotation of their own positions (H2O keeps
original positions too): nothing is re-rotated and a new token's position is still its index
in the sequence, so the model cannot see past its context length; what compression buys is
memory, more long sequences in the pool.

Methods
    mean        the seeds' CompressedKVCache: each run of 1/ratio consecutive rows becomes their
                mean (keys and values), per layer and KV head.
    sink-heavy  StreamingLLM's attention sinks plus H2O / SnapKV's heavy hitters: the first SINKS
                rows of the sequence are kept, and of the others the `ratio` share most likely to be
                attended to, chosen per layer and KV head (a layer's rows in a block need not be the
                same tokens in every head: attention only reads rows). Neither the torch attention
                (SDPA) nor the fused or CUDA steps expose attention scores, so the score is a proxy
                from the stored K alone: keys of low L2 norm draw the most attention (Devoto et al.
                2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression");
                bench/kv.py measures how much of the real attention (SnapKV's: the last prompt
                queries') the kept rows carry on the torch path.

Where it runs: a compressed table's rows are fewer than its positions (kv_start = removed), which
the torch attention path reads as it reads a sliding window's table; the fused CPU step takes
only tables whose kv_start is 0, so a compressed sequence's steps run through Model.forward; the
CUDA kernels read `length` rows from the block table, so on a GPU too a step with a compressed
table runs Model.forward with torch attention (model_runner sends only kv_start 0 rows to the kernels).
Plain formats only (fp32, fp16, bf16): a quantized format's exact tail (stage.py) keys its slots
by position.

Per request: each table carries its own compressor (PagedKVCache.compressor), the server's by
default; a request (or a session, for all its turns) may choose another method, window or ratio
(KVCompression, `choose`), or none, in a batch with others that choose differently. Where the
server cannot compress (`unsupported`), a request asking for it is refused, naming its field.

The prefix cache never indexes a compressed table (prefix.insert), and a table is compressed only
into blocks it allocates, so a block the index shares keeps its exact rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.engine.kv.paged import PagedKVCache
from kvgen.errors import InvalidRequest

METHODS = ("off", "mean", "sink-heavy")
PLAIN = ("fp32", "fp16", "bf16")
CHUNK_BLOCKS = 4  # blocks compressed at once: with ratio 1/2 or 1/4, a whole number of blocks comes out
SINKS = 4  # rows of the sequence's start kept by sink-heavy (StreamingLLM keeps 4)


class KVCompressor:
    def __init__(self, method: str, window: int = 256, ratio: float = 0.5):
        if method not in METHODS or method == "off":
            raise ValueError(f"KV_COMPRESS={method!r}: expected one of {', '.join(METHODS)}")
        if ratio not in (0.5, 0.25):
            raise ValueError(f"KV_COMPRESS_RATIO={ratio}: expected 0.5 or 0.25 (whole blocks out of "
                             f"{CHUNK_BLOCKS}-block chunks)")
        self.method, self.window, self.ratio = method, window, ratio
        self.group = round(1 / ratio)  # rows in, per row out

    @property
    def key(self) -> tuple[str, int, float]:
        """What makes two compressors give the same rows (a session's turns must agree on it)."""
        return self.method, self.window, self.ratio

    def due(self, table: PagedKVCache) -> bool:
        """Whether a chunk of exact rows lies wholly before the recent window."""
        bs = table.pool.block_size
        return not table.first and table.length - self.window - table.compressed_to >= CHUNK_BLOCKS * bs

    def compress(self, table: PagedKVCache) -> list[int] | None:
        """Compress every due chunk of the table. Returns the blocks it gave back (None: nothing
        was due, or the pool had no block to write into)."""
        freed: list[int] = []
        while self.due(table):
            got = self._chunk(table)
            if got is None:
                break
            freed += got
        return freed or None

    def _chunk(self, table: PagedKVCache) -> list[int] | None:
        pool, fmt = table.pool, table.pool.fmt
        bs = pool.block_size
        at = (table.compressed_to - table.removed) // bs  # the chunk's first block in the table
        chunk = table.blocks[at:at + CHUNK_BLOCKS]
        n_out = CHUNK_BLOCKS // self.group
        if pool.available < n_out:
            return None
        out = pool.alloc(n_out)  # never in place: the prefix cache may share the chunk's exact blocks
        ids = torch.tensor(chunk, device=pool.device)
        where = torch.tensor(out, device=pool.device).repeat_interleave(bs)
        offsets = torch.arange(bs, device=pool.device).repeat(n_out)
        first = table.compressed_to == 0  # the sequence's start: sink-heavy keeps its first rows
        for layer in range(fmt.num_layers):
            k, v = fmt.read(pool.store, layer, ids)  # [blocks, BS, KVH, HD]
            k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
            k, v = self.rows(k, v, first)
            fmt.write(pool.store, layer, where, offsets, k, v)
        table.blocks[at:at + CHUNK_BLOCKS] = out
        table.compressed_to += CHUNK_BLOCKS * bs
        table.removed += (CHUNK_BLOCKS - n_out) * bs
        pool.free(chunk)
        return chunk

    def rows(self, k: torch.Tensor, v: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's rows [n, KVH, HD] -> [n * ratio, KVH, HD] (first: it starts the sequence)."""
        n = k.shape[0]
        if self.method == "mean":
            # the mean in float32 whatever the storage, written back in the storage's dtype
            kf = k.float().reshape(n // self.group, self.group, *k.shape[1:]).mean(1)
            vf = v.float().reshape(n // self.group, self.group, *v.shape[1:]).mean(1)
            return kf.to(k.dtype), vf.to(v.dtype)
        keep = n // self.group
        score = -k.float().norm(dim=-1)  # [n, KVH]: low key norm, high expected attention
        if first:
            score[:SINKS] = float("inf")  # attention sinks
        picked = score.topk(keep, dim=0).indices.sort(dim=0).values  # [keep, KVH], in sequence order
        idx = picked[:, :, None].expand(-1, -1, k.shape[-1])
        return k.gather(0, idx), v.gather(0, idx)


@dataclass(frozen=True, slots=True)
class KVCompression:
    """A request's (or a session's) choice of KV compression; a field left unset ("" / None) takes
    the server's KV_COMPRESS setting of the same name."""

    method: str = ""  # off, mean or sink-heavy
    window: int | None = None
    ratio: float | None = None


def unsupported(fmt_name: str, attention_span: int = 0) -> str:
    """Why this server cannot compress a table (a quantized format, a sliding window or chunked
    attention); "" where it can."""
    if fmt_name not in PLAIN:
        return f"needs KV_DTYPE fp32, fp16 or bf16 (not {fmt_name})"
    if attention_span:
        return "does not combine with a sliding window or chunked attention"
    return ""


def make_compressor(method: str, window: int, ratio: float, fmt_name: str, *,
                    attention_span: int = 0) -> KVCompressor | None:
    """The KVCompressor of the KV_COMPRESS settings (None: off). Refuses what it cannot serve:
    a quantized format, a sliding window or chunked attention."""
    if method == "off":
        return None
    why = unsupported(fmt_name, attention_span)
    if why:
        raise ValueError(f"KV_COMPRESS={method} {why}")
    return KVCompressor(method, window, ratio)


def choose(choice: KVCompression | None, method: str, window: int, ratio: float, why_not: str
           ) -> KVCompressor | None:
    """The KVCompressor of a request's choice, its unset fields the server's settings (method,
    window, ratio). why_not: unsupported()'s answer for this server. Raises InvalidRequest naming
    the request's fields: an unknown method, a window or ratio out of range, or compression asked
    of a server that cannot do it."""
    choice = choice or KVCompression()
    method = choice.method or method
    window = window if choice.window is None else choice.window
    ratio = ratio if choice.ratio is None else choice.ratio
    bad = []
    if method not in METHODS:
        bad.append(("kv_compress", f"{method[:32]!r} is not a method: expected one of {', '.join(METHODS)}"))
    if window < 0:
        bad.append(("kv_compress_window", f"is {window}; must be >= 0"))
    if ratio not in (0.5, 0.25):
        bad.append(("kv_compress_ratio", f"is {ratio:g}; expected 0.5 or 0.25"))
    if not bad and method != "off" and why_not:  # only a request's own method can get here
        bad.append(("kv_compress", f"{method} is not available on this server: it {why_not}"))
    if bad:
        raise InvalidRequest(bad)
    return None if method == "off" else KVCompressor(method, window, ratio)
