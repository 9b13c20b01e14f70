"""kv_append and increment, the real CUDA C kernels run on the host (tests/gpu/emulator.py)
through ops.py: append must be byte-identical to KVFormat.write (kv_append_reference)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import DTYPES, FORMATS, assert_same_store, paged


@pytest.mark.parametrize("name", FORMATS)
def test_emulated_kv_append_matches_format_write(emulated, name):
    from tests.gpu.reference import kv_append_reference

    ops = emulated
    bs, hd = 8, 64
    # New tokens at block starts / ends / odd places, then padding: -1, past the table, a -1 entry.
    pos = [0, bs - 1, bs, 2 * bs - 1, 2 * bs + 3, 21, -1, 0, 0]
    fmt, store, tables, spare = paged(name, [max(p, 0) for p in pos], block_size=bs, hd=hd, kvh=3)
    for b, p in enumerate(pos[:6]):
        if tables[b, p // bs] < 0:
            tables[b, p // bs] = spare.pop()
    pos[7] = tables.shape[1] * bs
    tables[8] = -1
    seq_lens = torch.tensor(pos, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    mag = torch.tensor([1.0, 4.0, 0.5, 8.0, 0.1, 3.0, 1.0, 1.0, 1.0])[:, None, None]  # fp8 scales grow
    for dt in DTYPES:
        k = (torch.randn(len(pos), 3, hd, generator=g) * mag).to(dt)
        v = (torch.randn(len(pos), 3, hd, generator=g) * mag).to(dt)
        got, ref = {n: t.clone() for n, t in store.items()}, {n: t.clone() for n, t in store.items()}
        for layer in (0, 1):
            ops.kv_append(fmt, got, layer, k, v, tables, seq_lens)
            kv_append_reference(fmt, ref, layer, k, v, tables, seq_lens)
        assert_same_store(got, ref)
        assert seq_lens.tolist() == pos
        if name in ("fp8", "q4"):  # the re-encoding path ran: a part-filled block's scale grew
            key = "scale" if name == "fp8" else "kscale"
            grown = got[key].float() > store[key].float()
            assert any(grown[tables[b, p // bs]].any() for b, p in enumerate(pos[:6]) if p % bs), "no growth"
    # every row padding: nothing at all changes
    got = {n: t.clone() for n, t in store.items()}
    ops.kv_append(fmt, got, 0, k * 100, v * 100, tables, torch.tensor([-1, -3] + [-1] * 7, dtype=torch.int32))
    assert_same_store(got, store)


def test_emulated_increment(emulated):
    lens = torch.tensor([0, 5, -1, 7, 300] * 30, dtype=torch.int32)  # 150 rows: two thread blocks
    emulated.increment(lens)
    assert lens.tolist() == [1, 6, -1, 8, 301] * 30
    valid = torch.tensor([True, False, True, True, False] * 30)
    emulated.increment(lens, valid, n=2)
    assert lens.tolist() == [3, 6, -1, 10, 301] * 30
