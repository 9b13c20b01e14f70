"""codecs.pack_fp8 / unpack_fp8 / pack_q4 / unpack_q4, the Numba kernels run in Numba's CUDA
simulator (run with NUMBA_ENABLE_CUDASIM=1), bit-exact with kvgen.engine.kv.quant: whole
store-shaped blocks, odd shapes, all-zero rows, and packing straight into store slices."""

from __future__ import annotations

import torch

from tests.gpu.helpers import DTYPES, raw_bits


def main() -> None:
    from numba.cuda import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    from kvgen.engine.kv import quant
    from kvgen.engine.kv.formats import make_format
    from kvgen.gpu import codecs

    g = torch.Generator().manual_seed(3)

    def sample(shape, dtype):
        x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1], generator=g) * 2)[..., None]
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 10),), generator=g)] = 0.0
        x.view(-1, shape[-1])[0] = 0.0  # an all-zero row: scale 0
        return x.to(dtype)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw_bits(a), raw_bits(b))

    # (each output dtype is unpacked from the first input dtype's codes, each other input to its own dtype:
    # the unpack kernels read codes and scales, not what they were packed from)
    # fp8: whole store-shaped blocks [n, L, 2, BS, KVH, HD]; odd token counts; a partly written block.
    for shape in ((2, 1, 2, 4, 2, 8), (1, 2, 2, 5, 1, 6), (3, 1, 1, 1, 3, 2), (1, 1, 2, 7, 2, 16)):
        for dt in DTYPES:
            x = sample(shape, dt)
            x[0, 0, 0, shape[3] // 2:] = 0.0  # the unwritten tail of a block
            q, scale = codecs.pack_fp8(x)
            ref_scale = quant.divide(x.float().abs().amax(dim=(-3, -1)), quant.FP8_MAX)
            ref_q = quant.fp8_quantize(x, ref_scale[..., None, :, None])
            assert same(scale, ref_scale), ("fp8 scale", shape, dt)
            assert same(q, ref_q), ("fp8 q", shape, dt)
            for out_dt in DTYPES if dt == DTYPES[0] else (dt,):  # unpacking reads the codes alone
                got = codecs.unpack_fp8(q, scale, out_dt)
                assert same(got, quant.fp8_dequantize(ref_q, ref_scale[..., None, :, None]).to(out_dt)), \
                    ("fp8 unpack", shape, dt, out_dt)
    # into the store itself: a strided slice of one layer
    fmt = make_format("fp8", 2, 4, 2, 8)
    store = fmt.allocate(3)
    x = sample((4, 2, 8), torch.float16)
    codecs.pack_fp8(x, store["kv"][1, 1, 0], store["scale"][1, 1, 0])
    ref_scale = quant.divide(x.float().abs().amax(dim=(0, 2)), quant.FP8_MAX)
    assert same(store["scale"][1, 1, 0], ref_scale)
    assert same(store["kv"][1, 1, 0], quant.fp8_quantize(x, ref_scale[None, :, None]))
    assert not raw_bits(store["kv"][0]).any() and not raw_bits(store["kv"][1, 0]).any()

    # q4: rows of any leading shape, even / odd group sizes, odd row counts
    for shape, group in (((3, 5, 2, 8), None), ((7, 6), 3), ((1, 4, 16), 2), ((2, 3, 64), 32), ((5, 64), 16)):
        for dt in DTYPES:
            x = sample(shape, dt)
            packed, scales = codecs.pack_q4(x, group)
            gs = group or min(32, shape[-1])
            ref_p, ref_s = quant.q4_quantize(x, gs)
            assert same(packed, ref_p) and same(scales, ref_s), ("q4", shape, group, dt)
            for out_dt in DTYPES if dt == DTYPES[0] else (dt,):  # unpacking reads the codes alone
                got = codecs.unpack_q4(packed, scales, group, out_dt)
                ref = quant.q4_dequantize(ref_p, ref_s, gs).to(out_dt)
                assert same(got, ref), ("q4 unpack", shape, out_dt)
    # q4 values straight into a store slice, through the format's own read
    fmt = make_format("q4", 2, 4, 2, 8, group_size=4)
    store = fmt.allocate(2)
    x = sample((4, 2, 8), torch.float32)
    codecs.pack_q4(x, 4, store["q"][1, 0, 1], store["vscale"][1, 0])
    _, v = fmt.read(store, 0, torch.tensor([1]))
    ref_p, ref_s = quant.q4_quantize(x, 4)
    assert torch.equal(v[0], quant.q4_dequantize(ref_p, ref_s, 4))
    print("simulator ok")


if __name__ == "__main__":
    main()
