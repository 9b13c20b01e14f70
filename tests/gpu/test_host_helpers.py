"""common.cuh's conversion / quantisation helpers and split ranges, compiled for the host by nvcc
(host/host_helpers.cu) and called through ctypes: bit-exact with torch on ~1.5M probe values (every
fp16 / bf16 / e4m3 value, the ties between them and random bit patterns)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.gpu.helpers import HOST_DIR, KDIR, NVCC, bits, probe_floats, run


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    tmp = tmp_path_factory.mktemp("host")
    r = run([NVCC, "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", f"-I{KDIR}",
             str(HOST_DIR / "host_helpers.cu"), "-o", str(tmp / "libkvg_host.so")])
    if r.returncode and "host compiler" in r.stderr.lower():
        pytest.skip(f"no host compiler for nvcc: {r.stderr[:200]}")
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(tmp / "libkvg_host.so"))


def _call(lib, fn, out_dtype, *arrays):
    """lib.fn(*arrays, out, n) over contiguous copies of the arrays; returns out."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    out = np.zeros(arrays[0].shape, out_dtype)
    ptrs = [a.ctypes.data_as(ctypes.c_void_p) for a in arrays]
    getattr(lib, fn)(*ptrs, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(out.size))
    return out


def test_host_float_conversions_match_torch(host_lib):
    x = probe_floats()
    xn = x.numpy()
    assert np.array_equal(_call(host_lib, "f32_to_f16", np.uint16, xn).view(np.int16), bits(x.half()))
    assert np.array_equal(_call(host_lib, "f32_to_bf16", np.uint16, xn).view(np.int16), bits(x.bfloat16()))
    xc = x.clamp(-448, 448)
    e4m3 = _call(host_lib, "f32_to_e4m3", np.uint8, xc.numpy())
    assert np.array_equal(e4m3, bits(xc.to(torch.float8_e4m3fn)))
    codes16 = np.arange(2**16, dtype=np.uint16)
    for fn, dt in (("f16_to_f32", torch.float16), ("bf16_to_f32", torch.bfloat16)):
        got = _call(host_lib, fn, np.float32, codes16)
        ref = torch.from_numpy(codes16.view(np.int16)).view(dt).float().numpy()
        same = (got.view(np.int32) == ref.view(np.int32)) | (np.isnan(got) & np.isnan(ref))
        assert same.all(), fn
    codes8 = np.arange(256, dtype=np.uint8)
    got = _call(host_lib, "e4m3_to_f32", np.float32, codes8)
    ref = torch.from_numpy(codes8).view(torch.float8_e4m3fn).float().numpy()
    assert ((got.view(np.int32) == ref.view(np.int32)) | (np.isnan(got) & np.isnan(ref))).all()


def test_host_quantizers_match_reference(host_lib):
    from kvgen.engine.kv import quant

    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 3)
    x[:1000] = 0.0
    x[1000:2000] = -0.0
    s = (x.abs() * torch.rand(200_000, generator=g) * 0.02).float()
    s[::7] = 0.0
    ref = quant.fp8_quantize(x, s)
    assert np.array_equal(_call(host_lib, "fp8_quantize", np.uint8, x.numpy(), s.numpy()), bits(ref))
    # q4 code per element with its (already rounded) group scale.
    s4 = (x.abs() / torch.rand(200_000, generator=g).clamp_min(0.05) / 7).half().float()
    s4[::5] = 0.0
    y = torch.where(s4 > 0, x / torch.where(s4 > 0, s4, 1.0), 0.0)
    ref4 = (torch.round(y).clamp(-8, 7) + 8).to(torch.uint8)
    assert np.array_equal(_call(host_lib, "q4_code", np.uint8, x.numpy(), s4.numpy()), ref4.numpy())


def test_host_split_ranges_cover_the_sequence(host_lib):
    t = (ctypes.c_int * 2)()
    for bs in (1, 3, 16):
        for n_splits in range(1, 10):
            for length in list(range(0, 70)) + [255, 256, 257, 1000]:
                covered = []
                for s in range(n_splits):
                    host_lib.split_range(length, bs, n_splits, s, t)
                    t0, t1 = t[0], t[1]
                    assert t0 % bs == 0  # splits start on a cache block
                    covered += list(range(t0, t1))
                assert covered == list(range(length)), (length, bs, n_splits)
