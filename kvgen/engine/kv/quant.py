"""Pure torch quantizers for the KV cache: fp8 (E4M3), q4 (4-bit absmax groups), q3 (3-bit codebook).

This file is the reference for the GPU kernels, which must be BIT-EXACT with it. Every step
below is written as the float32 operations it performs; "/" is IEEE true division (not a
multiply by a reciprocal), round() is round-half-to-even (CUDA rintf), casts to float16 and
float8_e4m3fn round to nearest even.

fp8 (E4M3, torch.float8_e4m3fn), FP8_MAX = 448
    quantize(x, scale):  y = x / scale where scale > 0, else 0;  q = fp8(clamp(y, -448, 448))
    dequantize(q, scale): float32(q) * scale
    The scale comes from the caller (formats.Fp8Format: one per block, layer, k|v, KV head;
    fp8_quantize_blocks: absmax / 448 per block and head, for whole blocks at once).

q4, group size G along the last dim (D % G == 0, D even)
    per group:  scale = float16(absmax / 7);  s = float32(scale)
    q = clamp(round(x / s), -8, 7) + 8   (q = 8 where s == 0)          -> 0..15
    packed byte i = q[2i] | (q[2i+1] << 4)   (element 2i in the low nibble)
    dequantize: (q - 8) * s
    packed uint8 [..., D//2], scales float16 [..., D//G]

q3, group size G, codebook c: float32[8] sorted ascending (D % G == 0, D % 8 == 0)
    per group:  scale = float16(absmax);  s = float32(scale)
    y = x / s   (y = 0 where s == 0)
    idx = argmin_j |y - c[j]|, distances in float32, ties -> the lower j
    packing, for every run of 8 indices i0..i7:  bits = sum_j i_j << (3 j)   (24 bits)
        bytes = bits & 0xFF, (bits >> 8) & 0xFF, (bits >> 16) & 0xFF
    dequantize: c[idx] * s
    packed uint8 [..., D*3//8], scales float16 [..., D//G]

Per-channel keys (q4 / q3 key halves of a block, KIVI's layout): the same codes and packing,
but one scale per channel taken over the block's tokens instead of one per token and group:
    q4: scale[c] = float16(absmax over tokens of x[:, c] / 7);  q3: scale[c] = float16(absmax)
    codes as above with s = float32(scale[c]) for every element of channel c.
q4_encode / q4_decode and q3_encode / q3_decode take the scale already broadcast to x.

Scales are float16, so |x| must stay below ~4.5e5 for q4 (65504 * 7) and 65504 for q3, far above
any KV activation; beyond that the scale is inf and dequantizing gives nan. Groups whose
absmax is below 2^-14 get a subnormal float16 scale with less relative precision (errors stay
below ~1e-7 in absolute terms).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def divide(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c rounded as IEEE division on every device. On CUDA, torch turns division by a
    Python number into a multiply by its reciprocal, which can be one ulp off (1/448 and 1/7
    are not exact); the CUDA kernels and the CPU path divide, so the scales must too. A 0-dim
    tensor on x's device takes torch's tensor-by-tensor path (torch.full: no host copy, so
    graph capture is unaffected)."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.float()
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    pos = scale > 0
    # Divide by 1 where the scale is 0 so no inf/nan is ever formed, then zero those.
    y = torch.where(pos, x / torch.where(pos, scale, torch.ones_like(scale)), torch.zeros_like(x))
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def fp8_quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks with one scale per block and head: x [*lead, T, kv_heads, head_dim] ->
    (q, scale [*lead, kv_heads] = absmax over (T, head_dim) / 448). kvgen.gpu.codecs.pack_fp8 is
    the bulk kernel of exactly this."""
    scale = divide(x.float().abs().amax(dim=(-3, -1)), FP8_MAX)
    return fp8_quantize(x, scale[..., None, :, None]), scale


def fp8_dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of fp8_quantize_blocks, float32 (kvgen.gpu.codecs.unpack_fp8)."""
    return fp8_dequantize(q, scale[..., None, :, None])


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    d = x.shape[-1]
    if group <= 0 or d % group:
        raise ValueError(f"group size {group} does not divide the last dim {d}")
    return x.reshape(*x.shape[:-1], d // group, group)


def _safe_div(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x / s where s > 0, else 0 (s broadcast over the last dim of x)."""
    pos = s > 0
    return torch.where(pos, x / torch.where(pos, s, torch.ones_like(s)), torch.zeros_like(x))


def q4_encode(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Packed q4 codes of x with float32 scales s (broadcastable to x)."""
    if x.shape[-1] % 2:
        raise ValueError("q4 needs an even last dim")
    y = _safe_div(x.float(), s.float())
    q = (torch.round(y).clamp(-8, 7) + 8).to(torch.uint8)
    q = q.reshape(*q.shape[:-1], -1, 2)
    return q[..., 0] | (q[..., 1] << 4)


def q4_decode(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q4_unpack(packed).float() - 8) * s.float()


def q4_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError("q4 needs an even last dim")
    xg = _groups(x.float(), group)
    scale = divide(xg.abs().amax(-1), 7.0).to(torch.float16)
    return q4_encode(x, scale.float().repeat_interleave(group, -1)), scale


def q4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The 0..15 codes [..., 2 * packed.shape[-1]] as uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def q4_dequantize(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    return q4_decode(packed, scales.float().repeat_interleave(group, -1))


def q3_pack(idx: torch.Tensor) -> torch.Tensor:
    if idx.shape[-1] % 8:
        raise ValueError("q3 needs a last dim divisible by 8")
    runs = idx.to(torch.int32).reshape(*idx.shape[:-1], -1, 8)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=idx.device)
    bits = (runs << shifts).sum(-1, dtype=torch.int32)  # disjoint bit fields: sum == or
    out = torch.stack((bits & 0xFF, (bits >> 8) & 0xFF, (bits >> 16) & 0xFF), dim=-1)
    return out.to(torch.uint8).flatten(-2)


def q3_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Centroid indices [..., packed.shape[-1] * 8 // 3] as int64."""
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    bits = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    return ((bits.unsqueeze(-1) >> shifts) & 7).flatten(-2).long()


def q3_encode(x: torch.Tensor, s: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Packed q3 codes of x with float32 scales s (broadcastable to x)."""
    y = _safe_div(x.float(), s.float())
    # argmin returns the first minimum, which is the tie rule of the spec.
    return q3_pack((y.unsqueeze(-1) - codebook.float()).abs().argmin(-1))


def q3_decode(packed: torch.Tensor, s: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    return codebook.float()[q3_unpack(packed)] * s.float()


def q3_quantize(x: torch.Tensor, codebook: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _groups(x.float(), group).abs().amax(-1).to(torch.float16)
    return q3_encode(x, scale.float().repeat_interleave(group, -1), codebook), scale


def q3_dequantize(packed: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                  group: int) -> torch.Tensor:
    return q3_decode(packed, scales.float().repeat_interleave(group, -1), codebook)


def normal_codebook() -> torch.Tensor:
    """Quantiles of N(0, 1) at (j + 0.5) / 8, divided by the largest so the ends are exactly -1, +1."""
    p = (torch.arange(8, dtype=torch.float64) + 0.5) / 8
    q = torch.special.ndtri(p)
    return (q / q[-1]).float()


def fit_codebook(samples: torch.Tensor, weights: torch.Tensor | None = None, iters: int = 100,
                 seed: int = 0, max_samples: int = 1 << 18) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd) with 8 centroids over normalised values in [-1, 1].

    KVQuant weights each value by its Fisher information (squared gradient); the caller passes
    whatever sensitivity proxy it has (Q3Format.calibrate explains the one it uses).
    The two ends stay pinned at -1 and +1: every group has its absmax element at y = +-1, so
    pinned ends reproduce each group's largest value exactly (a free outlier guarantee, and
    it keeps the error bound at half the widest centroid gap); the 6 inner centroids are fitted.
    Starts from the normal quantiles; deterministic (seed only picks the subsample when there
    are more than max_samples values).
    """
    y = samples.detach().flatten().double().cpu()
    w = torch.ones_like(y) if weights is None else weights.detach().flatten().double().cpu()
    if y.numel() > max_samples:
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(y.numel(), generator=g)[:max_samples]
        y, w = y[pick], w[pick]
    keep = (w > 0) & torch.isfinite(y) & torch.isfinite(w)
    y, w = y[keep].clamp(-1, 1), w[keep]
    c = normal_codebook().double()
    if y.numel() == 0:
        return c.float()
    idx = None
    for _ in range(iters):
        # Nearest centroid = interval between midpoints (ties go low, as in q3_quantize).
        new_idx = torch.searchsorted((c[1:] + c[:-1]) / 2, y)
        if idx is not None and torch.equal(new_idx, idx):
            break
        idx = new_idx
        wsum = torch.bincount(idx, weights=w, minlength=8)
        wy = torch.bincount(idx, weights=w * y, minlength=8)
        inner = torch.where(wsum > 0, wy / wsum.clamp_min(1e-300), c)  # empty cluster: stays put
        c = torch.cat((c[:1], inner[1:7].sort().values, c[7:]))
    return c.float()
