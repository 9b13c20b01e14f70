"""The pack kernels' scalar helpers (kvgen/gpu/bits.py: float <-> fp16 / bf16 / e4m3 bits, fp8 and q4 codes)
bit-exact with torch: compiled by numba.njit, and as the pure-Python functions the CUDA simulator runs
(run with NUMBA_ENABLE_CUDASIM=1)."""

from __future__ import annotations

import numpy as np
import torch

from tests.gpu.helpers import bits, probe_floats


def main() -> None:
    import numba

    from kvgen.engine.kv import quant
    from kvgen.gpu import bits as scalar

    jit = scalar.build_helpers(numba.njit)

    @numba.njit
    def apply1(fn, x, out):
        for i in range(x.size):
            out[i] = fn(x[i])

    @numba.njit
    def apply2(fn, x, s, out):
        for i in range(x.size):
            out[i] = fn(x[i], s[i])

    x = probe_floats()
    xc = x.clamp(-448, 448)
    cases = [("f16_bits", x, lambda t: bits(t.half()).astype(np.int64) & 0xFFFF),
             ("bf16_bits", x, lambda t: bits(t.bfloat16()).astype(np.int64) & 0xFFFF),
             ("e4m3_bits", xc, lambda t: bits(t.to(torch.float8_e4m3fn)).astype(np.int64))]
    for name, xs, ref in cases:
        out = np.zeros(xs.numel(), np.int64)
        apply1(jit[name], xs.numpy(), out)
        assert np.array_equal(out, ref(xs)), f"njit {name}"
        sub = xs[:: max(1, xs.numel() // 20000)]  # the pure-Python helpers (what the simulator runs)
        py = np.array([getattr(scalar, name)(v) for v in sub.numpy()], np.int64)
        assert np.array_equal(py, ref(sub)), f"python {name}"
    for name, n, dt, view in (("f16_value", 2**16, torch.float16, torch.int16),
                              ("bf16_value", 2**16, torch.bfloat16, torch.int16),
                              ("e4m3_value", 256, torch.float8_e4m3fn, torch.uint8)):
        codes = np.arange(n, dtype=np.int64)
        ref = torch.from_numpy(codes).to(view).view(dt).float().numpy()
        compiled = np.zeros(n, np.float32)
        apply1(jit[name], codes, compiled)
        python = np.array([getattr(scalar, name)(int(c)) for c in codes], np.float32)
        for got in (compiled, python):
            assert ((got.view(np.int32) == ref.view(np.int32)) | (np.isnan(got) & np.isnan(ref))).all(), name

    g = torch.Generator().manual_seed(2)
    v = torch.randn(300_000, generator=g) * torch.exp(torch.randn(300_000, generator=g) * 3)
    v[:500] = -0.0
    s = (v.abs() * torch.rand(300_000, generator=g) * 0.02).float()
    s[::7] = 0.0
    out = np.zeros(v.numel(), np.int64)
    apply2(jit["fp8_code"], v.numpy(), s.numpy(), out)
    assert np.array_equal(out, bits(quant.fp8_quantize(v, s)).astype(np.int64)), "fp8_code"
    s4 = (v.abs() / torch.rand(300_000, generator=g).clamp_min(0.05) / 7).half().float()
    s4[::5] = 0.0
    y = torch.where(s4 > 0, v / torch.where(s4 > 0, s4, 1.0), 0.0)
    apply2(jit["q4_code"], v.numpy(), s4.numpy(), out)
    assert np.array_equal(out, (torch.round(y).clamp(-8, 7) + 8).long().numpy()), "q4_code"
    print("helpers ok")


if __name__ == "__main__":
    main()
