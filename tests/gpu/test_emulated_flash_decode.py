"""flash_decode, the real CUDA C split and reduce kernels run on the host (tests/gpu/emulator.py)
through ops.py, against paged_decode_reference for every format, GQA ratio and split count."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import DTYPES, FORMATS, paged


@pytest.mark.parametrize("gqa", (1, 3, 8, 12))
@pytest.mark.parametrize("name", FORMATS)
def test_emulated_flash_decode_matches_reference(emulated, name, gqa):
    from tests.gpu.reference import paged_decode_reference

    ops = emulated
    # (block size, head_dim, kv heads, q dtype) vary with the case; lengths hit block edges,
    # an empty row and odd lengths; 12 query heads per kv head take several head chunks.
    i = FORMATS.index(name) + gqa
    bs, hd, kvh = ((8, 64, 2), (16, 96, 1), (4, 32, 2), (8, 256, 1))[i % 4]
    q_dtype = DTYPES[i % 3]
    lens = [1, bs, bs + 1, 2 * bs - 1, 0, 53]
    fmt, store, tables, _ = paged(name, lens, block_size=bs, hd=hd, kvh=kvh, seed=i)
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(len(lens), kvh * gqa, hd, generator=g) * 2).to(q_dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    # Scores reach ~100 with these magnitudes, so float32 rounding of a dot product moves a
    # softmax weight by ~1e-4 relative: the fp32 tolerance is that, not float32 epsilon.
    tol = {torch.float32: 3e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[q_dtype]
    ref = paged_decode_reference(q, fmt, store, 1, tables, ctx)
    for splits in (None, 1, 4):
        out = ops.flash_decode(q, fmt, store, 1, tables, ctx, num_splits=splits)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=lambda m, s=splits: f"{s}: {m}")
        assert not out[4].any()  # the empty row
    # decode-step form: counters before the new token, len_offset=1
    out = ops.flash_decode(q, fmt, store, 1, tables, (ctx - 1).clamp_min(-1), len_offset=1)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
