"""kvgen.gpu kernels on a real GPU against the torch references (`make test-gpu`).

Skipped without a CUDA device, CuPy or Numba. Stores are compared byte for byte after
kv_append (it must do exactly what KVFormat.write does), the pack kernels bit-exactly, and
flash_decode within float tolerance of tests.gpu.reference.paged_decode_reference (which reads
the same dequantised values through KVFormat.read, so only the summation order differs).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu.helpers import DTYPES, FORMATS, raw_bits


def _ready() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return False
    import kvgen.gpu

    return kvgen.gpu.available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ready(), reason="needs a CUDA device, CuPy and Numba")]

DEV = "cuda"


def _assert_same_store(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = raw_bits(a[key]), raw_bits(b[key])
        if not torch.equal(x, y):
            diff = (x != y).nonzero()
            raise AssertionError(f"store[{key!r}] differs at {diff.shape[0]} places, "
                                 f"first {diff[:5].tolist()}")


def _clone(store):
    return {k: v.clone() for k, v in store.items()}


def _format(name, layers, block_size, kvh, hd):
    from kvgen.engine.kv.formats import make_format

    return make_format(name, layers, block_size, kvh, hd)


class Paged:
    """Sequences of given lengths in a store on the GPU, blocks scattered at random, every
    layer's K/V written through the format itself."""

    def __init__(self, name, lens, *, layers=2, block_size=16, kvh=2, hd=64, spare_blocks=3,
                 extra_table=1, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.fmt = _format(name, layers, block_size, kvh, hd)
        self.lens = list(lens)
        need = [-(-max(n, 0) // block_size) for n in self.lens]
        total = sum(need) + spare_blocks
        self.store = self.fmt.allocate(total, DEV)
        perm = torch.randperm(total, generator=g).tolist()
        width = max(need) + extra_table
        self.tables = torch.full((len(self.lens), width), -1, dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            self.tables[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
            at += n
        self.spare = perm[at:]
        self.tables = self.tables.to(DEV)
        for layer in range(layers):
            for b, n in enumerate(self.lens):
                if n <= 0:
                    continue
                pos = torch.arange(n)
                blocks = self.tables[b].cpu()[pos // block_size].long()
                # Magnitudes vary per token so fp8 block scales come from different rows.
                scale = torch.exp(torch.randn(n, 1, 1, generator=g))
                k = torch.randn(n, kvh, hd, generator=g) * scale
                v = torch.randn(n, kvh, hd, generator=g) * scale
                self.fmt.write(self.store, layer, blocks.to(DEV), (pos % block_size).to(DEV),
                               k.to(DEV), v.to(DEV))


# ---- kv_append -------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("block_size,hd", [(16, 64), (8, 96), (4, 256)])
def test_kv_append_matches_format_write(name, in_dtype, block_size, hd):
    from kvgen.gpu import ops
    from tests.gpu.reference import kv_append_reference

    bs = block_size
    # New token positions: block starts and ends, odd ones, a padding row (-1), a position past
    # the block table and one whose table entry is -1.
    pos = [0, bs - 1, bs, 2 * bs - 1, 2 * bs + 3, 37, -1, 0, 0]
    paged = Paged(name, [max(p, 0) for p in pos], block_size=bs, hd=hd, kvh=3)
    tables = paged.tables.clone()
    # Rows 0..5 need a block for the new token (a fresh one when it starts a block).
    for b, p in enumerate(pos[:6]):
        if tables[b, p // bs] < 0:
            tables[b, p // bs] = paged.spare.pop()
    pos[7] = tables.shape[1] * bs  # past the table
    tables[8] = -1
    seq_lens = torch.tensor(pos, dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(1)
    # Some rows much larger than what the block holds (fp8: the scale grows, rows requantise).
    mag = torch.tensor([1.0, 4.0, 0.5, 8.0, 0.1, 3.0, 1.0, 1.0, 1.0])[:, None, None]
    k = (torch.randn(len(pos), 3, hd, generator=g) * mag).to(in_dtype).to(DEV)
    v = (torch.randn(len(pos), 3, hd, generator=g) * mag).to(in_dtype).to(DEV)

    ref = _clone(paged.store)
    for layer in (0, 1):
        ops.kv_append(paged.fmt, paged.store, layer, k, v, tables, seq_lens)
        kv_append_reference(paged.fmt, ref, layer, k, v, tables, seq_lens)
    torch.cuda.synchronize()
    _assert_same_store(paged.store, ref)
    assert seq_lens.tolist() == pos  # append does not move the counters


@pytest.mark.parametrize("name", FORMATS)
def test_kv_append_padding_rows_write_nothing(name):
    from kvgen.gpu import ops

    paged = Paged(name, [5, 20, 0])
    before = _clone(paged.store)
    tables = paged.tables.clone()
    tables[1, 1] = -1
    seq_lens = torch.tensor([-1, 16, -5], dtype=torch.int32, device=DEV)  # 16: table entry -1
    k = torch.randn(3, 2, 64, device=DEV) * 100
    ops.kv_append(paged.fmt, paged.store, 0, k, k, tables, seq_lens)
    torch.cuda.synchronize()
    _assert_same_store(paged.store, before)


def test_increment():
    from kvgen.gpu import ops

    lens = torch.tensor([0, 5, -1, 7, 300], dtype=torch.int32, device=DEV)
    ops.increment(lens)
    assert lens.tolist() == [1, 6, -1, 8, 301]
    ops.increment(lens, torch.tensor([True, False, True, True, False], device=DEV), n=2)
    assert lens.tolist() == [3, 6, -1, 10, 301]
    big = torch.arange(-3, 1000, dtype=torch.int32, device=DEV)
    ops.increment(big)
    torch.testing.assert_close(big.cpu(), torch.where(torch.arange(-3, 1000) >= 0, torch.arange(-3, 1000) + 1,
                                                      torch.arange(-3, 1000)).int())


# ---- flash_decode ----------------------------------------------------------------------------

# Scores reach ~100 with the magnitudes Paged writes, so float32 rounding in a dot product moves
# a softmax weight by ~1e-4 relative: that, not float32 epsilon, bounds the fp32 difference.
TOL = {torch.float32: dict(atol=3e-4, rtol=3e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("q_dtype", DTYPES)
@pytest.mark.parametrize("gqa", (1, 3, 8))
@pytest.mark.parametrize("name", FORMATS)
def test_flash_decode_matches_reference(name, gqa, q_dtype):
    from kvgen.gpu import ops
    from tests.gpu.reference import paged_decode_reference

    for block_size, hd, kvh in ((16, 128, 2), (8, 64, 1), (16, 96, 2), (4, 256, 1), (16, 32, 3)):
        lens = [1, block_size, block_size + 1, 2 * block_size - 1, 1001, 0, 333]
        paged = Paged(name, lens, block_size=block_size, hd=hd, kvh=kvh, seed=hd)
        h = kvh * gqa
        g = torch.Generator().manual_seed(7)
        q = (torch.randn(len(lens), h, hd, generator=g) * 2).to(q_dtype).to(DEV)
        ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
        for layer in (0, 1):
            ref = paged_decode_reference(q, paged.fmt, paged.store, layer, paged.tables, ctx)
            for splits in (None, 1, 2, 7, 64):
                out = ops.flash_decode(q, paged.fmt, paged.store, layer, paged.tables, ctx, num_splits=splits)
                assert out.dtype == q_dtype and out.shape == q.shape
                where = f"bs {block_size} hd {hd} splits {splits}"
                torch.testing.assert_close(out.float(), ref, **TOL[q_dtype],
                                           msg=lambda m, w=where: f"{w}: {m}")
            # the decode-step form: counters before the new token plus len_offset=1
            out = ops.flash_decode(q, paged.fmt, paged.store, layer, paged.tables, (ctx - 1).clamp_min(-1),
                                   len_offset=1)
            torch.testing.assert_close(out.float(), ref, **TOL[q_dtype])


def test_flash_decode_many_heads_per_kv_head_and_big_batch():
    """12 query heads per kv head (several head chunks) and a batch that needs no split."""
    from kvgen.gpu import ops
    from tests.gpu.reference import paged_decode_reference

    lens = [(i * 37) % 300 + 1 for i in range(70)]
    paged = Paged("fp16", lens, block_size=16, hd=128, kvh=2, layers=1)
    q = torch.randn(len(lens), 24, 128, device=DEV, dtype=torch.float16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = ops.flash_decode(q, paged.fmt, paged.store, 0, paged.tables, ctx)
    ref = paged_decode_reference(q, paged.fmt, paged.store, 0, paged.tables, ctx)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float16])


def test_kernels_run_on_torch_current_stream():
    """Work queued on a side stream right before the kernels must be visible to them."""
    from kvgen.gpu import ops
    from tests.gpu.reference import paged_decode_reference

    paged = Paged("fp16", [700, 300], layers=1, hd=128, kvh=2)
    ctx = torch.tensor([700, 300], dtype=torch.int32, device=DEV)
    q_src = torch.randn(2, 16, 128, device=DEV, dtype=torch.float16)
    ref = paged_decode_reference(q_src, paged.fmt, paged.store, 0, paged.tables, ctx)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q = torch.zeros_like(q_src)
        torch.cuda._sleep(50_000_000)  # delay the copy below: a kernel on another stream would miss it
        q.copy_(q_src)
        out = ops.flash_decode(q, paged.fmt, paged.store, 0, paged.tables, ctx)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float16])


# ---- Numba pack / unpack on the GPU ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_kernels_match_quant(dtype):
    from kvgen.engine.kv import quant
    from kvgen.gpu import codecs

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 2, 2, 17, 4, 64, generator=g) * 3).to(dtype)
    x[0, 0, 0] = 0
    x = x.to(DEV)
    q, scale = codecs.pack_fp8(x)
    ref_scale = quant.divide(x.float().abs().amax(dim=(-3, -1)), quant.FP8_MAX)
    ref_q = quant.fp8_quantize(x, ref_scale[..., None, :, None])
    assert torch.equal(raw_bits(q), raw_bits(ref_q)) and torch.equal(raw_bits(scale), raw_bits(ref_scale))
    for out_dtype in DTYPES:
        got = codecs.unpack_fp8(q, scale, out_dtype)
        ref = quant.fp8_dequantize(ref_q, ref_scale[..., None, :, None]).to(out_dtype)
        assert torch.equal(raw_bits(got), raw_bits(ref))
    for group in (32, 8, 2):
        packed, scales = codecs.pack_q4(x, group)
        ref_p, ref_s = quant.q4_quantize(x, group)
        assert torch.equal(packed, ref_p) and torch.equal(raw_bits(scales), raw_bits(ref_s))
        for out_dtype in DTYPES:
            got = codecs.unpack_q4(packed, scales, group, out_dtype)
            assert torch.equal(raw_bits(got), raw_bits(quant.q4_dequantize(ref_p, ref_s, group).to(out_dtype)))


def test_divide_rounds_like_the_kernels_on_the_device():
    # The formats' scales divide through quant.divide; on CUDA a plain x / 448.0 would multiply
    # by a rounded reciprocal and disagree with kv_append's "/" in the last bit.
    from kvgen.engine.kv import quant

    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 1000
    for c in (quant.FP8_MAX, 7.0):
        assert torch.equal(quant.divide(x.to(DEV), c).cpu(), (x.double() / c).float())


def test_pack_into_store_slices():
    from kvgen.engine.kv import quant
    from kvgen.gpu import codecs

    fmt = _format("fp8", 2, 16, 2, 64)
    store = fmt.allocate(4, DEV)
    x = torch.randn(2, 16, 2, 64, device=DEV, dtype=torch.float16)  # one layer, k and v of a block
    codecs.pack_fp8(x, store["kv"][2, 1], store["scale"][2, 1])
    k, v = fmt.read(store, 1, torch.tensor([2], device=DEV))
    s = quant.divide(x.float().abs().amax(dim=(1, 3)), quant.FP8_MAX)
    deq = quant.fp8_dequantize(quant.fp8_quantize(x, s[:, None, :, None]), s[:, None, :, None])
    assert torch.equal(k[0], deq[0]) and torch.equal(v[0], deq[1])


# ---- CUDA graphs -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ("fp16", "fp8", "q4"))
def test_graph_replay_equals_eager(name):
    from kvgen.gpu import ops
    from kvgen.gpu.graphs import GraphRunner

    layers, kvh, hd, heads = 2, 2, 64, 6
    lens = [3, 17, 40, 1, 60]
    eager = Paged(name, lens, layers=layers, kvh=kvh, hd=hd, extra_table=4, seed=3)
    graphed_store = _clone(eager.store)

    def make_step(store):
        def step(inp):
            outs = []
            for layer in range(layers):
                ops.kv_append(eager.fmt, store, layer, inp["k"][:, layer], inp["v"][:, layer],
                              inp["block_tables"], inp["seq_lens"])
                outs.append(ops.flash_decode(inp["q"][:, layer], eager.fmt, store, layer, inp["block_tables"],
                                             inp["seq_lens"], num_splits=3, len_offset=1))
            ops.increment(inp["seq_lens"])
            return torch.stack(outs, dim=1)
        return step

    runner = GraphRunner(make_step(graphed_store), pad_values={"seq_lens": -1, "block_tables": -1},
                         inplace=("seq_lens",))
    eager_step = make_step(eager.store)
    g = torch.Generator().manual_seed(9)
    lens_eager = torch.tensor(lens, dtype=torch.int32, device=DEV)
    lens_graph = lens_eager.clone()
    for it, batch in enumerate((3, 3, 5, 2, 5)):
        inp = {
            "q": torch.randn(batch, layers, heads, hd, generator=g).to(DEV),
            "k": torch.randn(batch, layers, kvh, hd, generator=g).to(DEV),
            "v": torch.randn(batch, layers, kvh, hd, generator=g).to(DEV),
            "block_tables": eager.tables[:batch],
        }
        a = eager_step({**inp, "seq_lens": lens_eager[:batch]})
        b = runner({**inp, "seq_lens": lens_graph[:batch]})
        torch.cuda.synchronize()
        assert torch.equal(a, b), f"step {it}"
        assert torch.equal(lens_eager, lens_graph)
        _assert_same_store(eager.store, graphed_store)
    assert runner.captured == (2, 4, 8)
    assert lens_graph.tolist()[:2] == [8, 22]
    # the switch: off runs eagerly and still agrees
    runner.enabled = False
    inp = {"q": torch.randn(2, layers, heads, hd, device=DEV),
           "k": torch.randn(2, layers, kvh, hd, device=DEV),
           "v": torch.randn(2, layers, kvh, hd, device=DEV), "block_tables": eager.tables[:2]}
    a = eager_step({**inp, "seq_lens": lens_eager[:2]})
    assert torch.equal(a, runner({**inp, "seq_lens": lens_graph[:2]}))
    assert torch.equal(lens_eager, lens_graph)


def test_a_capture_survives_another_graph_being_collected():
    """A captured graph left in a reference cycle (an engine closed after a failure, say) and
    collected while another graph is captured destroyed its graph inside the capture, which
    invalidated it (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, first seen on an H100)."""
    import gc

    from kvgen.gpu.graphs import GraphRunner

    def step(inp):
        return inp["x"] * 2 + 1

    old = GraphRunner(step)
    old({"x": torch.ones(3, 4, device=DEV)})
    assert old.captured == (4,)
    cycle = [old]
    cycle.append(cycle)  # only the collector frees it now
    del old, cycle
    saved = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation, so one falls inside the capture
    try:
        new = GraphRunner(step)
        out = new({"x": torch.full((5, 4), 3.0, device=DEV)})
    finally:
        gc.set_threshold(*saved)
    assert new.captured == (8,) and torch.equal(out, torch.full((5, 4), 7.0, device=DEV))
