"""ExactTail (kv/stage.py): the newest block of each sequence, and its first token, kept exact
beside a quantized format (recent_slots), until the sequence moves on; slots come back with
freed blocks and run out gracefully; a block moved or cut carries its exact rows."""

import pytest
import torch

from kvgen.engine.kv.formats import make_format
from tests.kv.test_formats import L, rows_like


def _write_rows(fmt, store, block, offsets, x):
    """Rows x [n, kvh, hd] at `offsets` of `block`, every layer (as a forward pass does)."""
    for layer in range(L):
        fmt.write(store, layer, torch.full((len(offsets),), block), torch.tensor(offsets), x * (layer + 1), -x)


@pytest.mark.parametrize("name", ["fp8", "q4", "q3"])
def test_recent_block_is_exact_until_its_sequence_moves_on(name):
    bs, kvh, hd = 8, 2, 16
    fmt = make_format(name, L, bs, kvh, hd, recent_slots=2)
    direct = make_format(name, L, bs, kvh, hd)
    if name == "q3":
        direct.codebook = fmt.codebook
    store, ref = fmt.allocate(4), direct.allocate(4)
    x = rows_like(torch.Generator().manual_seed(3), bs + 1, kvh, hd)
    _write_rows(fmt, store, 1, range(5), x[:5])
    stage = fmt  # the ExactTail make_format returns with recent_slots
    assert list(stage.recent.held) == [1]
    for layer in range(L):
        K, V = fmt.read(store, layer, torch.tensor([1]))
        assert torch.equal(K[0, :5], x[:5] * (layer + 1)) and torch.equal(V[0, :5], -x[:5])
    _write_rows(fmt, store, 1, range(5, bs), x[5:bs])  # full: still exact until a write goes elsewhere
    assert torch.equal(fmt.read(store, 0, torch.tensor([1]))[0][0], x[:bs])
    _write_rows(fmt, store, 2, [0], x[bs:])  # the sequence moves on: block 1 is quantized whole
    assert list(stage.recent.held) == [2] and len(stage.recent.free) == 1
    _write_rows(direct, ref, 1, range(bs), x[:bs])  # what quantizing all 8 rows at once stores
    for n in ref:
        assert torch.equal(store[n][1].view(torch.uint8), ref[n][1].view(torch.uint8)), n
    for layer in range(L):
        K, _ = fmt.read(store, layer, torch.tensor([2]))
        assert torch.equal(K[0, 0], x[bs] * (layer + 1))  # the new block is exact


def test_recent_slots_come_back_with_freed_blocks_and_run_out_gracefully():
    from kvgen.engine.kv.pool import BlockPool

    bs, kvh, hd = 4, 1, 8
    pool = BlockPool(make_format("q4", L, bs, kvh, hd, recent_slots=1), 4)
    fmt, store = pool.fmt, pool.store
    assert (pool.exact_blocks_used, pool.exact_blocks_total) == (0, 1)
    a, b = pool.alloc(2)
    x = rows_like(torch.Generator().manual_seed(0), 2, kvh, hd)
    _write_rows(fmt, store, a, [0, 1], x)
    _write_rows(fmt, store, b, [0, 1], x)  # no slot left: straight to the quantized store
    assert list(fmt.recent.held) == [a] and pool.exact_blocks_used == 1
    ka, kb = fmt.read(store, 0, torch.tensor([a]))[0][0, :2], fmt.read(store, 0, torch.tensor([b]))[0][0, :2]
    assert torch.equal(ka, x) and not torch.equal(kb, x)
    assert ((kb - x).abs() <= x.abs().amax(0) / 14 * (1 + 2**-10) + 1e-6).all()
    pool.free([a])
    assert fmt.recent.held == {} and fmt.recent.free == [0] and pool.exact_blocks_used == 0
    assert (fmt.recent.of == -1).all()
    (c,) = pool.alloc(1)
    _write_rows(fmt, store, c, [0], x[:1])
    assert list(fmt.recent.held) == [c]


@pytest.mark.parametrize("name", ["fp8", "q4"])
def test_a_block_cut_by_truncate_is_staged_again_with_its_rows(name):
    """A full (quantized) block cut back to 3 rows and written on gets a slot holding its old
    rows as stored and the new rows exact."""
    bs, kvh, hd = 4, 1, 8
    fmt = make_format(name, L, bs, kvh, hd, recent_slots=1)
    store = fmt.allocate(2)
    x = rows_like(torch.Generator().manual_seed(1), bs + 1, kvh, hd)
    _write_rows(fmt, store, 0, range(bs), x[:bs])  # written whole: quantized at once
    assert not fmt.recent.held
    before = [fmt.read(store, layer, torch.tensor([0])) for layer in range(L)]
    _write_rows(fmt, store, 0, [3], x[bs:])  # truncated to 3 rows, then one more token
    assert list(fmt.recent.held) == [0]
    for layer in range(L):
        K, V = fmt.read(store, layer, torch.tensor([0]))
        assert torch.equal(K[0, :3], before[layer][0][0, :3]) and torch.equal(V[0, :3], before[layer][1][0, :3])
        assert torch.equal(K[0, 3], x[bs] * (layer + 1))


def test_take_and_put_block_carry_the_exact_rows():
    bs, kvh, hd = 4, 1, 8
    fmt = make_format("q4", L, bs, kvh, hd, recent_slots=1)
    store = fmt.allocate(3)
    x = rows_like(torch.Generator().manual_seed(2), 2, kvh, hd)
    _write_rows(fmt, store, 0, [0, 1], x)
    before = [fmt.read(store, layer, torch.tensor([0])) for layer in range(L)]
    data = fmt.take_block(store, 0, fill=2)
    assert "stage" in data and not data["stage"][:, :, 2:].any()
    fmt.release(store, [0])
    fmt.put_block(store, 2, data, fill=2)  # a slot is free again: exact
    assert list(fmt.recent.held) == [2]
    for layer in range(L):
        for a, b in zip(before[layer], fmt.read(store, layer, torch.tensor([2])), strict=True):
            assert torch.equal(a[0, :2], b[0, :2])
    _write_rows(fmt, store, 1, [0], x[:1])  # slot taken by another block...
    fmt.release(store, [2])
    fmt.recent.acquire(1)
    fmt.put_block(store, 0, data, fill=2)  # ...so the rows are quantized into the block
    assert 0 not in fmt.recent.held
    K, _ = fmt.read(store, 0, torch.tensor([0]))
    assert ((K[0, :2] - x).abs() <= x.abs().amax(0) / 14 * (1 + 2**-10) + 1e-6).all()


@pytest.mark.parametrize("name", ["fp8", "q4", "q3"])
def test_first_token_of_a_sequence_stays_exact(name):
    """The attention sink: the row written at position 0 reads back exact after its block is
    quantized, moves with the block (take / put) and is forgotten when the block is freed."""
    bs, kvh, hd = 4, 1, 8
    fmt = make_format(name, L, bs, kvh, hd, recent_slots=1)
    store = fmt.allocate(3)
    x = rows_like(torch.Generator().manual_seed(4), bs, kvh, hd)
    for layer in range(L):  # a whole block at once: quantized at once, but for its first token
        fmt.write(store, layer, torch.zeros(bs, dtype=torch.long), torch.arange(bs), x, -x, torch.arange(bs))
    K, V = fmt.read(store, 1, torch.tensor([0]))
    assert torch.equal(K[0, 0], x[0]) and torch.equal(V[0, 0], -x[0])
    assert not torch.equal(K[0, 1:], x[1:])
    data = fmt.take_block(store, 0, fill=bs)
    fmt.release(store, [0])
    assert not fmt.first.held
    assert not torch.equal(fmt.read(store, 1, torch.tensor([0]))[0][0, 0], x[0])
    fmt.put_block(store, 2, data, fill=bs)
    K2, _ = fmt.read(store, 1, torch.tensor([2]))
    assert torch.equal(K2, K)
    # a first block filled token by token: staged, then quantized once the sequence moves on
    store = fmt.allocate(3)
    for pos in range(bs + 1):
        for layer in range(L):
            fmt.write(store, layer, torch.tensor([pos // bs]), torch.tensor([pos % bs]), x[pos % bs:pos % bs + 1],
                      -x[pos % bs:pos % bs + 1], torch.tensor([pos]))
    assert list(fmt.recent.held) == [1] and list(fmt.first.held) == [0]
    K, _ = fmt.read(store, 1, torch.tensor([0]))
    assert torch.equal(K[0, 0], x[0]) and not torch.equal(K[0, 1:], x[1:])


@pytest.mark.parametrize("name", ["fp8", "q4", "q3"])
def test_exact_tail_wraps_a_format_and_keeps_the_store_plain(name):
    """The stage is a wrapper: its store is exactly the inner format's tensors (what a GPU kernel
    reads), the inner format's parameters read through, and a store it did not allocate is refused."""
    from kvgen.engine.kv.pool import BlockPool
    from kvgen.engine.kv.stage import ExactTail

    fmt = make_format(name, L, 4, 2, 16, recent_slots=2)
    plain = make_format(name, L, 4, 2, 16)
    assert isinstance(fmt, ExactTail) and type(fmt.inner) is type(plain)
    assert (fmt.name, fmt.block_size, fmt.head_dim, fmt.recent_slots) == (name, 4, 16, 2) and plain.recent_slots == 0
    assert fmt.bytes_per_block() == plain.bytes_per_block() and fmt.stage_bytes() > 0 == plain.stage_bytes()
    store = fmt.allocate(3)
    assert store.keys() == plain.allocate(3).keys() and all(isinstance(t, torch.Tensor) for t in store.values())
    fmt.qk_scale = torch.ones(1)
    assert fmt.inner.qk_scale is fmt.qk_scale  # one value, wherever it is read
    with pytest.raises(ValueError):
        fmt.read(plain.allocate(3), 0, torch.tensor([0]))
    assert (BlockPool(plain, 2).exact_blocks_used, BlockPool(plain, 2).exact_blocks_total) == (0, 0)
