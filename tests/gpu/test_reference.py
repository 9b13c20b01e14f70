"""The torch references the kernels are compared with: kv_append_reference then
paged_decode_reference over scattered blocks equals dense scaled-dot-product attention."""

from __future__ import annotations

import torch


def test_paged_decode_reference_matches_dense_attention():
    from kvgen.engine.kv.formats import make_format
    from tests.gpu.reference import kv_append_reference, paged_decode_reference

    g = torch.Generator().manual_seed(4)
    fmt = make_format("fp32", 1, 4, 2, 8)
    store = fmt.allocate(12)
    lens = [5, 0, 9]
    tables = torch.tensor([[3, 7, -1, -1], [-1, -1, -1, -1], [0, 11, 2, -1]], dtype=torch.int32)
    ks = [torch.randn(n, 2, 8, generator=g) for n in lens]
    vs = [torch.randn(n, 2, 8, generator=g) for n in lens]
    for pos in range(max(lens)):
        seq = torch.tensor([pos if pos < n else -1 for n in lens], dtype=torch.int32)
        k = torch.stack([ks[b][min(pos, n - 1)] if n else torch.zeros(2, 8) for b, n in enumerate(lens)])
        v = torch.stack([vs[b][min(pos, n - 1)] if n else torch.zeros(2, 8) for b, n in enumerate(lens)])
        kv_append_reference(fmt, store, 0, k, v, tables, seq)
    q = torch.randn(3, 6, 8, generator=g)  # GQA 3
    out = paged_decode_reference(q, fmt, store, 0, tables, torch.tensor(lens, dtype=torch.int32))
    for b, n in enumerate(lens):
        if n == 0:
            assert not out[b].any()
            continue
        k = ks[b].repeat_interleave(3, dim=1)
        v = vs[b].repeat_interleave(3, dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], k.transpose(0, 1), v.transpose(0, 1))[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
