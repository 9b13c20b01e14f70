"""ops.py's Python launch code, run on CPU tensors with the launches recorded instead of made:
the arguments match the parameters each CUDA entry point declares in its PTX, grids and block
sizes are legal, bad inputs are refused before any launch, and the split heuristic's bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.gpu.helpers import DTYPES, FORMATS, NVCC, empty_store, ptx_params, run


@pytest.fixture(scope="module")
def ptx_entries(tmp_path_factory) -> dict[str, list[str]]:
    """{"module:entry": PTX parameter types} of every kernel, as nvcc compiles ops' sources."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    from kvgen.gpu import ops

    tmp = tmp_path_factory.mktemp("ptx")
    entries = {}
    for name in ops.KERNEL_FILES:
        src = tmp / f"{name}.cu"
        src.write_text(ops.kernel_source(name))
        r = run([NVCC, "-std=c++17", "-arch=sm_80", "--ptx", str(src), "-o", str(tmp / f"{name}.ptx")])
        assert r.returncode == 0, r.stderr
        entries.update({f"{name}:{k}": v for k, v in ptx_params((tmp / f"{name}.ptx").read_text()).items()})
    return entries


class _Arr:
    """Stands for a CuPy array in the recorded launches."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self.shape = tuple(t.shape)


@pytest.fixture
def launches(monkeypatch):
    """Run ops' Python side on CPU tensors and record (module, kernel, grid, block, args)."""
    from kvgen.gpu import ops

    calls = []
    monkeypatch.setattr(ops, "device_index", lambda t: 0)
    monkeypatch.setattr(ops, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(ops, "_ptr", lambda t: _Arr(ops.raw(t)))
    monkeypatch.setattr(ops, "_launch", lambda mod, fn, dev, grid, block, args:
                        calls.append((mod, fn, grid, block, args)))
    return calls


def test_launch_args_match_kernel_params(ptx_entries, launches):
    from kvgen.gpu import ops

    b, kvh = 3, 2
    bt = torch.zeros((b, 4), dtype=torch.int32)
    lens = torch.tensor([0, 5, -1], dtype=torch.int32)
    for name in FORMATS:
        for hd in (64, 256):
            fmt, store = empty_store(name, kvh=kvh, hd=hd)
            for dt in DTYPES:
                k = torch.zeros((b, kvh, hd), dtype=dt)
                ops.kv_append(fmt, store, 1, k, k, bt, lens)
                for heads in (kvh, 3 * kvh, 8 * kvh, 12 * kvh):
                    q = torch.zeros((b, heads, hd), dtype=dt)
                    out = ops.flash_decode(q, fmt, store, 1, bt, lens, len_offset=1)
                    assert out.shape == q.shape and out.dtype == dt
    ops.increment(lens)
    ops.increment(lens, torch.ones(b, dtype=torch.bool))

    names = {fn for _, fn, *_ in launches}
    assert len(names) == 15 + 1 + 30 + 3  # every append, increment, split and reduce entry
    ptx_kind = {np.int32: ("u32", "s32"), np.float32: ("f32",)}
    for mod, fn, grid, block, args in launches:
        params = ptx_entries.get(f"{mod}:{fn}")
        assert params is not None, f"{fn} is not an entry point of {mod}.cu"
        assert len(params) == len(args), (fn, params, args)
        for p, a in zip(params, args, strict=True):
            if isinstance(a, _Arr):
                assert p == "u64", (fn, p)
            else:
                assert p in ptx_kind[type(a)], (fn, p, type(a))  # np.int32 / np.float32 only
        assert len(block) == 1 and block[0] == 128
        assert 1 <= len(grid) <= 3 and all(1 <= g for g in grid) and all(g <= 65535 for g in grid[1:])


def test_flash_decode_grid(launches):
    from kvgen.gpu import ops

    fmt, store = empty_store("fp16", kvh=2, hd=64)
    bt = torch.zeros((5, 4), dtype=torch.int32)
    lens = torch.ones(5, dtype=torch.int32)
    q = torch.zeros((5, 2 * 12, 64), dtype=torch.float16)  # 12 query heads per kv head
    ops.flash_decode(q, fmt, store, 0, bt, lens, num_splits=3)
    (_, split_fn, split_grid, _, split_args), (_, red_fn, red_grid, _, red_args) = launches
    chunks = -(-12 // ops.MAX_HEADS_PER_CTA)  # 3 of 4 heads
    assert chunks > 1 and split_fn == "flash_decode_split_fp16_f16_hd128" and split_grid == (3, 2 * chunks, 5)
    assert red_fn == "flash_decode_reduce_f16" and red_grid == (24, 5)
    assert split_args[10].shape == (5, 24, 3, 64) and split_args[11].shape == (5, 24, 3, 2)
    assert math.isclose(float(split_args[-1]), math.log2(math.e) / 8, rel_tol=1e-6)
    assert split_args[-2] == -1  # no exact tail


@pytest.mark.parametrize("name", ("fp8", "q4"))
def test_exact_tail_args(ptx_entries, launches, name):
    """An ExactTail format (recent_slots) passes its exact rows, recent slot map, sink and
    first-token slot map where kv_append / flash_decode_split declare them (the parameters
    named exact_rows .. first_of, exact_dt in kv_append.cu / flash_decode.cu), with the rows'
    dtype id; a plain store of the same format passes -1 there."""
    from kvgen.engine.kv.formats import make_format
    from kvgen.gpu import ops

    b, kvh, hd, bs = 3, 2, 64, 16
    bt = torch.zeros((b, 4), dtype=torch.int32)
    lens = torch.tensor([0, 5, -1], dtype=torch.int32)
    for dt, dt_id in ((torch.float32, 0), (torch.float16, 1), (torch.bfloat16, 2)):
        fmt = make_format(name, 2, bs, kvh, hd, compute_dtype=dt, recent_slots=2)
        store = fmt.allocate(6)
        k = torch.zeros((b, kvh, hd), dtype=torch.float16)
        ops.kv_append(fmt, store, 1, k, k, bt, lens)
        ops.flash_decode(torch.zeros((b, 3 * kvh, hd), dtype=torch.float16), fmt, store, 1, bt, lens, len_offset=1)
        (amod, afn, _, _, aargs), (smod, sfn, _, _, sargs), _ = launches[-3:]
        assert (afn, sfn) == (f"kv_append_{name}_f16", f"flash_decode_split_{name}_f16_hd128")
        raw = ops.raw(torch.empty(0, dtype=dt)).dtype  # as passed: f16 / bf16 as int16 bits
        for args in (aargs[7:11], sargs[6:10]):
            assert [(a.shape, a.dtype) for a in args] == [
                ((2, 2, 2, bs, kvh, hd), raw), ((6,), torch.int64), ((8, 2, 2, kvh, hd), raw), ((6,), torch.int64)]
        assert aargs[-1] == dt_id and sargs[-2] == dt_id
        assert len(ptx_entries[f"{amod}:{afn}"]) == len(aargs) and len(ptx_entries[f"{smod}:{sfn}"]) == len(sargs)
    plain, store = empty_store(name, kvh=kvh, hd=hd)
    ops.kv_append(plain, store, 1, k, k, bt, lens)
    assert launches[-1][4][-1] == -1
    with pytest.raises(ValueError, match="ExactTail serves the store"):  # a store it did not allocate
        ops.kv_append(fmt, store, 1, k, k, bt, lens)


def test_ops_validation(launches):
    from kvgen.gpu import ops

    fmt, store = empty_store("fp16", kvh=2, hd=64)
    k = torch.zeros((2, 2, 64), dtype=torch.float16)
    bt = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables"):
        ops.kv_append(fmt, store, 0, k, k, bt.long(), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.kv_append(fmt, store, 0, k, k, bt, lens[:1])
    with pytest.raises(ValueError, match="kv_heads"):
        ops.kv_append(fmt, store, 0, k[:, :1], k[:, :1], bt, lens)
    with pytest.raises(ValueError, match="layer"):
        ops.kv_append(fmt, store, 2, k, k, bt, lens)
    with pytest.raises(ValueError, match="query heads"):
        ops.flash_decode(torch.zeros((2, 3, 64), dtype=torch.float16), fmt, store, 0, bt, lens)
    q3, q3store = empty_store("q3", kvh=2, hd=64)
    with pytest.raises(ValueError, match="no GPU kernels"):
        ops.kv_append(q3, q3store, 0, k, k, bt, lens)
    assert launches == []


def test_num_splits_heuristic():
    from kvgen.gpu import ops

    # A full GPU: no split. One sequence, long context: many splits, never more chunks than exist.
    assert ops.choose_num_splits(64, 8, 32, 32768, 16, 132) == 1
    s = ops.choose_num_splits(1, 8, 32, 32768, 16, 132)
    assert 8 <= s <= 128
    assert ops.choose_num_splits(1, 8, 32, 256, 16, 132) <= 2
    assert ops.choose_num_splits(1, 1, 1, 16, 16, 132) == 1
    for ctas in range(1, 700, 37):
        for nb in (1, 3, 64, 1000):
            s = ops.num_splits_heuristic(ctas, 528, nb)
            assert 1 <= s <= max(1, min(nb, 128))
