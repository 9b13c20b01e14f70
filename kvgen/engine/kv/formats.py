"""How KV blocks are stored: one class per KV_DTYPE, all behind the same four calls.

A format owns a dict of tensors ("the store") whose leading dims are
[num_blocks, num_layers, 2 (k, v), block_size, ...], so a block is one contiguous slice of
every tensor: tiers move it with `store[name][block]` and GPU kernels index it with a
block table and a block stride.

Quantized layouts (the GPU kernels are bit-exact with these; the quantizers are in quant.py):

fp8  kv    [NB, L, 2, BS, KVH, HD] float8_e4m3fn
     scale [NB, L, 2, KVH] float32: one per block, layer, k|v and KV head.
     On write, per touched (block, k|v, head):
         old = 0 if the write covers offset 0 of the block (fresh or reused block), else scale
         new = max(old, amax over the new rows and head_dim of |x| / 448)   (float32 "/")
     If new > old, the rows already in the block are requantised first:
         q = fp8_quantize(fp8_dequantize(q, old), new); then the new rows are written with `new`.
     read: float32(q) * scale.
q4   q [NB, L, 2, BS, KVH, HD//2] uint8, scale [NB, L, 2, BS, KVH, HD//G] float16 (q4_quantize
     per token and head; G = group size, default min(32, HD)).
q3   q [NB, L, 2, BS, KVH, HD*3//8] uint8, scale [NB, L, 2, BS, KVH, HD//G] float16 (q3_quantize
     per token and head); codebook [L, 2, 8] float32 lives on the format object, not in the store.
"""

from __future__ import annotations

import torch

from kvgen.engine.kv import quant


class KVFormat:
    """Key channel equalisation (quantized formats): post-RoPE keys have a few channels far
    larger than the rest, and one scale per group of a token stretches to fit them, which
    crushes the small channels (on SmolLM2, q4 keys alone cost +23% perplexity). Scores only
    need q.k, and q.k = (q * s).(k / s) for any per-channel s, so the model hands these formats
    keys divided by s and queries multiplied by it (`qk_scale`, [layers, q heads + kv heads,
    head_dim], set by calibrate.calibrate_format from the model's own keys): the cache holds
    keys whose channels are all of one size, and attention reads them back unchanged.
    """

    name: str = ""
    equalize_keys = False  # calibrate_format fits qk_scale for this format

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 compute_dtype: torch.dtype = torch.float32):
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype
        self.qk_scale: torch.Tensor | None = None

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def write(self, store: dict[str, torch.Tensor], layer: int, blocks: torch.Tensor,
              offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at (blocks[i], offsets[i]) for one layer."""
        raise NotImplementedError

    def read(self, store: dict[str, torch.Tensor], layer: int,
             block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks for one layer: [M, block_size, kv_heads, head_dim] each."""
        raise NotImplementedError

    def bytes_per_block(self) -> int:
        store = self.allocate(1, "meta")
        return sum(t.numel() * t.element_size() for t in store.values())

    def bytes_per_token_per_layer(self) -> float:
        return self.bytes_per_block() / (self.block_size * self.num_layers)


class PlainFormat(KVFormat):
    """fp32 / fp16 / bf16: values stored as they are (cast)."""

    def __init__(self, *args, dtype: torch.dtype, **kwargs):
        super().__init__(*args, **kwargs)
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def allocate(self, num_blocks, device="cpu"):
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return {"kv": torch.zeros(shape, dtype=self.dtype, device=device)}

    def _layer_views(self, store):
        # Per-layer K and V views [NB, block, kvh, hd], made once per store: a decode step
        # calls write and read for every layer, and each indexing op costs dispatch time.
        kv = store["kv"]
        if getattr(self, "_views_of", None) is not kv:
            self._views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(self.num_layers)]
            self._views_of = kv
        return self._views

    def write(self, store, layer, blocks, offsets, k, v):
        kl, vl = self._layer_views(store)[layer]
        kl.index_put_((blocks, offsets), k if k.dtype == self.dtype else k.to(self.dtype))
        vl.index_put_((blocks, offsets), v if v.dtype == self.dtype else v.to(self.dtype))

    def read(self, store, layer, block_ids):
        kl, vl = self._layer_views(store)[layer]
        k, v = kl.index_select(0, block_ids), vl.index_select(0, block_ids)  # 3x faster than kl[ids]
        if self.dtype != self.compute_dtype:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v


class Fp8Format(KVFormat):
    """E4M3 with a float32 scale per block, layer, k|v and KV head (layout in the module doc).

    The scale only grows while a block fills, so a token with a new largest value requantises
    that block's older rows once; a write at offset 0 starts the block over.
    """

    name = "fp8"
    equalize_keys = True

    def allocate(self, num_blocks, device="cpu"):
        lead = (num_blocks, self.num_layers, 2)
        return {
            "kv": torch.zeros(*lead, self.block_size, self.num_kv_heads, self.head_dim,
                              dtype=torch.float8_e4m3fn, device=device),
            "scale": torch.zeros(*lead, self.num_kv_heads, dtype=torch.float32, device=device),
        }

    def write(self, store, layer, blocks, offsets, k, v):
        kv, scale = store["kv"][:, layer], store["scale"][:, layer]  # views: [NB, 2, ...]
        x = torch.stack((k, v), dim=1).float()  # [N, 2, KVH, HD]
        ub, inv = torch.unique(blocks, return_inverse=True)
        n_u = ub.numel()
        # Per touched block: absmax of the new rows, and whether the write starts it over.
        row_max = x.abs().amax(-1)  # [N, 2, KVH]
        new_max = torch.zeros(n_u, *row_max.shape[1:], dtype=torch.float32, device=x.device)
        new_max.scatter_reduce_(0, inv.view(-1, 1, 1).expand_as(row_max), row_max, "amax")
        fresh = torch.zeros(n_u, dtype=torch.bool, device=x.device)
        fresh[inv[offsets == 0]] = True
        old = torch.where(fresh.view(-1, 1, 1), 0.0, scale[ub])
        new = torch.maximum(old, new_max / quant.FP8_MAX)

        grow = (new > old) & ~fresh.view(-1, 1, 1)  # fresh blocks hold nothing worth keeping
        sel = grow.flatten(1).any(1)
        if sel.any():
            gb = ub[sel]
            g, o, n = grow[sel], old[sel], new[sel]
            cur = kv[gb]  # [G, 2, BS, KVH, HD]
            per_row = (slice(None), slice(None), None, slice(None), None)  # [G, 2, 1, KVH, 1]
            req = quant.fp8_quantize(quant.fp8_dequantize(cur, o[per_row]), n[per_row])
            # Bytes, not fp8 values, go through where(): only grown (k|v, head) pairs change.
            kv[gb] = torch.where(g[per_row], req.view(torch.uint8), cur.view(torch.uint8)).view(kv.dtype)

        scale[ub] = new
        q = quant.fp8_quantize(x, new[inv].unsqueeze(-1))  # [N, 2, KVH, HD]
        kv[blocks, :, offsets] = q

    def read(self, store, layer, block_ids):
        kv = store["kv"][block_ids, layer]  # [M, 2, BS, KVH, HD]
        s = store["scale"][block_ids, layer]  # [M, 2, KVH]
        x = quant.fp8_dequantize(kv, s[:, :, None, :, None]).to(self.compute_dtype)
        return x[:, 0], x[:, 1]


class _GroupFormat(KVFormat):
    """Shared by q4 / q3: per token and head, packed codes plus float16 scales per group."""

    equalize_keys = True

    def __init__(self, *args, group_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_size = group_size or min(32, self.head_dim)
        if self.head_dim % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide head_dim {self.head_dim}")

    def _packed_dim(self) -> int:
        raise NotImplementedError

    def _quantize(self, layer: int, kv_index: int, x: torch.Tensor):
        raise NotImplementedError

    def _dequantize(self, layer: int, kv_index: int, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def allocate(self, num_blocks, device="cpu"):
        lead = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads)
        return {
            "q": torch.zeros(*lead, self._packed_dim(), dtype=torch.uint8, device=device),
            "scale": torch.zeros(*lead, self.head_dim // self.group_size, dtype=torch.float16,
                                 device=device),
        }

    def write(self, store, layer, blocks, offsets, k, v):
        qs, ss = store["q"][:, layer], store["scale"][:, layer]
        for i, x in enumerate((k, v)):
            q, s = self._quantize(layer, i, x.float())
            qs[blocks, i, offsets] = q
            ss[blocks, i, offsets] = s

    def read(self, store, layer, block_ids):
        q, s = store["q"][block_ids, layer], store["scale"][block_ids, layer]
        return tuple(self._dequantize(layer, i, q[:, i], s[:, i]).to(self.compute_dtype)
                     for i in range(2))


class Q4Format(_GroupFormat):
    """4-bit symmetric absmax groups along head_dim, two codes per byte (quant.q4_quantize)."""

    name = "q4"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.head_dim % 2:
            raise ValueError("q4 needs an even head_dim")

    def _packed_dim(self):
        return self.head_dim // 2

    def _quantize(self, layer, kv_index, x):
        return quant.q4_quantize(x, self.group_size)

    def _dequantize(self, layer, kv_index, q, s):
        return quant.q4_dequantize(q, s, self.group_size)


class Q3Format(_GroupFormat):
    """3-bit non-uniform codebook (8 centroids) per layer and k|v, float16 absmax per group.

    Keys are quantized after RoPE, as they arrive: paged attention (and the GPU kernels) read
    post-RoPE keys straight from the cache, and keys stored before RoPE would need RoPE applied
    to every cached key on every decode step. KVQuant quantizes pre-RoPE keys per channel to
    contain a few outlier channels; here every group of head_dim has its own absmax scale, so an
    outlier channel only stretches the scale of its own group of one token, and the codebook
    ends are pinned at +-1 so each group's largest value is kept exactly.

    `codebook` starts as the normal quantiles scaled into [-1, 1]; `calibrate` refits it. Blocks
    written before a refit would decode with the new codebook, so calibrate before serving.
    """

    name = "q3"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.head_dim % 8:
            raise ValueError("q3 needs head_dim divisible by 8")
        self.codebook = quant.normal_codebook().repeat(self.num_layers, 2, 1)  # [L, 2, 8]

    def _packed_dim(self):
        return self.head_dim * 3 // 8

    def _quantize(self, layer, kv_index, x):
        cb = self.codebook[layer, kv_index].to(x.device)
        return quant.q3_quantize(x, cb, self.group_size)

    def _dequantize(self, layer, kv_index, q, s):
        cb = self.codebook[layer, kv_index].to(q.device)
        return quant.q3_dequantize(q, s, cb, self.group_size)

    def calibrate(self, layer: int, kv_index: int, x: torch.Tensor, **fit_opts) -> torch.Tensor:
        """Fit the codebook of (layer, k=0|v=1) on samples x [tokens, ..., head_dim] (keys post-RoPE).

        Sensitivity proxy (we have no gradients at serving time, so no Fisher information):
        the error of a value in the original domain is s * (error of y), so every normalised y is
        weighted by s^2, which makes k-means minimise the real squared error. Keys also get the
        mean square of their channel over the samples: a logit q.k weighs k's error in channel d
        by q_d, and the large-magnitude key channels are the ones queries line up with, so this
        stands in for E[q_d^2]. (Weighting each element by its own x^2 was tried: it gave up the
        small values and tripled the error on Gaussian data. With keys equalised by qk_scale,
        weighing by their original channel sizes instead was tried too: +42% perplexity against
        +31% on SmolLM2.)
        """
        x = x.detach().float().cpu()
        g = self.group_size
        xg = x.reshape(*x.shape[:-1], -1, g)
        s = xg.abs().amax(-1, keepdim=True).to(torch.float16).float()
        y = torch.where(s > 0, xg / torch.where(s > 0, s, 1.0), 0.0)
        w = (s * s).expand_as(y)
        if kv_index == 0:
            chan = x.pow(2).mean(0, keepdim=True)  # per channel (head, dim) over the tokens
            w = w * chan.reshape(1, *xg.shape[1:])
        self.codebook[layer, kv_index] = quant.fit_codebook(y, w, **fit_opts)
        return self.codebook[layer, kv_index]


KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "q4", "q3")  # auto: plain, in the activations' dtype


def make_format(name: str, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                compute_dtype: torch.dtype = torch.float32, **opts) -> KVFormat:
    """opts: group_size (q4, q3); group_size=None is accepted by every format."""
    args = (num_layers, block_size, num_kv_heads, head_dim)
    plain = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "auto": compute_dtype}
    grouped = {"q4": Q4Format, "q3": Q3Format}
    allowed = {"group_size"} if name in grouped else set()
    extra = {k for k, val in opts.items() if k not in allowed and val is not None}
    if extra:
        raise TypeError(f"KV dtype {name!r} takes no option(s) {', '.join(sorted(extra))}")
    if name in plain:
        return PlainFormat(*args, dtype=plain[name], compute_dtype=compute_dtype)
    if name == "fp8":
        return Fp8Format(*args, compute_dtype=compute_dtype)
    if name in grouped:
        return grouped[name](*args, compute_dtype=compute_dtype, **opts)
    raise ValueError(f"unknown KV dtype {name!r}; expected one of {', '.join(KV_DTYPES)}")
