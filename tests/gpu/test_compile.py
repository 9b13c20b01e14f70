"""Every kernels/*.cu compiles for the architectures kvgen targets: with nvcc for sm_80 and sm_90
(no warnings, no spills), and with NVRTC exactly as CuPy's RawModule compiles it when a libnvrtc
can be found. Also: kvgen.gpu imports on a machine without CuPy."""

from __future__ import annotations

import ctypes
import sys

import pytest

from tests.gpu.helpers import CU_FILES, KDIR, NVCC, ROOT, libnvrtc, needs_nvcc, ptx_params, run

ARCHS = ("sm_80", "sm_90")


@needs_nvcc  # sm_80 (A100) in `make test-slow`, for CI's time; sm_90 (the H100s the kernels run on) here
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "sm_80" else a for a in ARCHS])
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles(cu, arch, tmp_path):
    r = run([NVCC, "-std=c++17", f"-arch={arch}", "-c", str(cu), "-o", str(tmp_path / "k.o"),
             "-Xptxas", "-warn-spills,-warn-lmem-usage"], cwd=KDIR)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr.lower(), r.stderr


def test_kernel_files_present():
    from kvgen.gpu import ops

    assert {p.stem for p in CU_FILES} == set(ops.KERNEL_FILES)


def _nvrtc_compile(lib: ctypes.CDLL, src: str, name: str, opts: list[str]) -> tuple[int, str, str]:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), ptx.decode(errors="replace")


@pytest.mark.parametrize("arch", ("compute_80", "compute_90"))
def test_cu_compiles_with_nvrtc_as_cupy_does(arch):
    """The exact source CuPy's RawModule gets (common.cuh pasted in), through NVRTC with no
    include path: the kernels must not need any CUDA header."""
    path = libnvrtc()
    if path is None:
        pytest.skip("no libnvrtc here (pip install nvidia-cuda-nvrtc, or KVGEN_NVRTC=path)")
    from kvgen.gpu import ops

    lib = ctypes.CDLL(path)
    for name in ops.KERNEL_FILES:
        rc, log, ptx = _nvrtc_compile(lib, ops.kernel_source(name), f"{name}.cu",
                                      ["-std=c++17", f"--gpu-architecture={arch}"])
        assert rc == 0, log
        assert "warning" not in log.lower(), log
        assert ptx.count(".entry") == len(ptx_params(ptx))


def test_import_without_cupy():
    r = run([sys.executable, "-c", "import sys; sys.modules['cupy'] = None; import kvgen.gpu as g, "
             "kvgen.gpu.ops, kvgen.gpu.graphs; print(g.available())"], cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
