"""Typing + lowering of every pack kernel for every argument kind a caller can pass (no GPU, no
simulator; run with NUMBA_ENABLE_CUDASIM=0), refusing float64 arithmetic: the simulator
computes in float32 numpy, and a double on the device would round differently.

With KVGEN_TEST_NVRTC_DIR set (a libnvrtc, libNVVM and libdevice are present) also PTX for
sm_80 / sm_90, assembled by ptxas without spills.
"""

from __future__ import annotations

import os
import pathlib
import re
import types as pytypes

from tests.gpu.helpers import ptxas, run


def main() -> None:
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    from numba import types as nt
    from numba.cuda.compiler import compile_cuda

    # Device functions ask the current device for its compute capability; there is none here.
    cc = (8, 0)
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
    from kvgen.gpu import pack

    def arr(dt, nd):
        return nt.Array(dt, nd, "A")

    i32, f32, i16, u8 = nt.int32, nt.float32, nt.int16, nt.uint8
    sigs = {
        pack.fp8_scale_kernel: [(arr(f32, 4), i32, arr(f32, 2)), (arr(i16, 4), i32, arr(f32, 2))],
        pack.fp8_quant_kernel: [(arr(x, 4), i32, arr(f32, 2), arr(u8, 4)) for x in (f32, i16)],
        pack.fp8_dequant_f32_kernel: [(arr(u8, 4), arr(f32, 2), arr(f32, 4))],
        pack.fp8_dequant_16_kernel: [(arr(u8, 4), arr(f32, 2), i32, arr(i16, 4))],
        pack.q4_scale_kernel: [(arr(x, 2), i32, i32, arr(i16, 2)) for x in (f32, i16)],
        pack.q4_pack_kernel: [(arr(x, 2), i32, i32, arr(i16, 2), arr(u8, 2)) for x in (f32, i16)],
        pack.q4_dequant_f32_kernel: [(arr(u8, 2), arr(i16, 2), i32, arr(f32, 2))],
        pack.q4_dequant_16_kernel: [(arr(u8, 2), arr(i16, 2), i32, i32, arr(i16, 2))],
    }
    assert set(sigs) == set(pack.KERNELS)
    # float constants written as doubles and truncated at compile time are not arithmetic
    const_trunc = re.compile(r"fptrunc double\s+(0x[0-9A-Fa-f]+|[-+0-9.e]+) to float")
    nvrtc = os.environ.get("KVGEN_TEST_NVRTC_DIR")
    for kernel, kernel_sigs in sigs.items():
        for sig in kernel_sigs:
            cres = compile_cuda(kernel.py_func, nt.void, sig, cc=cc)
            ir = cres.library.get_llvm_str()
            doubles = [ln.strip() for ln in ir.splitlines() if "double" in ln and not const_trunc.search(ln)]
            assert not doubles, f"{kernel.__name__}{sig}: float64 in the IR: {doubles[:5]}"
            if nvrtc:
                for target in ((8, 0), (9, 0)):
                    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=target)
                    path = f"/tmp/kvgen_{os.getpid()}_{kernel.__name__}.ptx"
                    pathlib.Path(path).write_text(ptx)
                    r = run([ptxas(), f"-arch=sm_{target[0]}{target[1]}", path,
                             "-o", path + ".cubin", "-warn-spills"])
                    assert r.returncode == 0 and "warning" not in r.stderr.lower(), r.stderr
                    os.remove(path)
                    os.remove(path + ".cubin")
    print("lowered", sum(len(s) for s in sigs.values()), "kernel signatures; ptxas:", bool(nvrtc))


if __name__ == "__main__":
    main()
