"""kv_lanes.py's dequantizing kernels, through kv_io.load_block: every fp8 code and every q4
nibble reads back as the format's own read, bit for bit, in this CPU's build and in the AVX2
build (8 lanes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgen.cpu import features, kv_io
from kvgen.engine.kv.formats import make_format
from tests.cpu.isa_build import run_in_build

L, BS, KVH, HD = 2, 16, 2, 64


def check_fp8_codes() -> None:
    """Every E4M3 code but the two NaNs (subnormals, both zeros, both signs), at scales large and
    small: its value times the block's scale, as Fp8Format.read gives it."""
    fmt = make_format("fp8", L, BS, KVH, HD)
    store = fmt.allocate(2)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254
    n = 2 * BS * KVH * HD  # a block's K and V: every code in both, many times
    store["kv"].view(torch.uint8)[1, 1] = codes.repeat(-(-n // len(codes)))[:n].reshape(2, BS, KVH, HD)
    tile = np.empty((BS, HD), np.float32)
    for scale in (0.013, 3.7, 1e-4, 2.0 ** -20):
        store["scale"][1, 1] = scale
        k, v = fmt.read(store, 1, torch.tensor([1]))
        for kv, want in enumerate((k, v)):
            for h in range(KVH):
                kv_io.load_block(kv_io.cache_tuple(fmt, store), 1, kv, 1, h, BS, tile)
                assert torch.equal(torch.from_numpy(tile).view(torch.int32), want[0, :, h].view(torch.int32))


def check_q4_rows() -> None:
    """Keys (a scale a channel) and values (a scale a token and group of 32) of blocks written by
    Q4Format.write, rows of very different sizes among them (down to float16 subnormal scales),
    and a block read only in part."""
    fmt = make_format("q4", L, BS, KVH, HD)
    store = fmt.allocate(3)
    gen = torch.Generator().manual_seed(0)
    for pos in range(2 * BS):
        for layer in range(L):
            k, v = (torch.randn(1, KVH, HD, generator=gen) * 10.0 ** torch.randint(-7, 3, (1, KVH, 1), generator=gen)
                    for _ in range(2))
            fmt.write(store, layer, torch.tensor([2 - pos // BS]), torch.tensor([pos % BS]), k, v, torch.tensor([pos]))
    small = store["vscale"].view(torch.int16) & 0x7C00 == 0
    assert small.any() and (store["vscale"][small] != 0).any()  # subnormal scales were written
    tile = np.empty((BS, HD), np.float32)
    for b in (2, 1):
        for layer in range(L):
            k, v = fmt.read(store, layer, torch.tensor([b]))
            for kv, want in enumerate((k, v)):
                for h in range(KVH):
                    for n in (BS, 5):
                        kv_io.load_block(kv_io.cache_tuple(fmt, store), layer, kv, b, h, n, tile)
                        assert torch.equal(torch.from_numpy(tile[:n]).view(torch.int32),
                                           want[0, :n, h].contiguous().view(torch.int32)), (b, layer, kv, h, n)


def test_fp8_codes_read_back_as_the_formats_read():
    check_fp8_codes()


def test_q4_rows_read_back_as_the_formats_read():
    check_q4_rows()


@pytest.mark.heavy
def test_the_avx2_build_reads_alike():
    """The same checks in a build for this CPU with AVX-512 turned off (NUMBA_CPU_FEATURES, a
    cache per ISA: isa_build.py): 8 lanes, a q4 row's 32 nibbles in 4 steps."""
    if "+avx512f" not in features.FEATURES.split(","):
        pytest.skip("this CPU has no AVX-512: the AVX2 build is what runs here")
    isa = ",".join(f"-{f[1:]}" if f.startswith("+avx512") else f for f in features.FEATURES.split(","))
    code = ("from kvgen.cpu import features; assert features.LANES == 8; "
            "from tests.cpu.test_kv_lanes import check_fp8_codes, check_q4_rows; "
            "check_fp8_codes(); check_q4_rows()")
    run_in_build(code, isa)
