"""CI checks of kvgen.gpu on a machine without a GPU.

* every kernels/*.cu compiles with nvcc for sm_80 and sm_90 (no warnings, no spills), and with
  NVRTC exactly as CuPy compiles it when a libnvrtc can be found;
* the Python launch code passes exactly the parameters each CUDA entry point declares (PTX);
* the CUDA C conversion / quantisation helpers, compiled for the host, are bit-exact with torch;
* the Numba pack kernels lower without any float64 arithmetic, and under Numba's CUDA
  simulator match kvgen.engine.kv.quant bit-exactly (subprocesses: NUMBA_ENABLE_CUDASIM has to
  be set before numba is imported; this file is the subprocess's script);
* GraphRunner's bucketing and padding, the split heuristic and the torch reference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
KDIR = ROOT / "kvgen" / "gpu" / "kernels"
CU_FILES = sorted(KDIR.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")
                                         if os.path.exists(p)), None)


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def _ptxas() -> str:
    return shutil.which("ptxas") or str(pathlib.Path(NVCC).resolve().parent / "ptxas")


def _libnvrtc() -> str | None:
    """A libnvrtc to compile with, if this machine has one (CUDA toolkit or the
    nvidia-cuda-nvrtc wheel); KVGEN_NVRTC=path overrides."""
    if os.environ.get("KVGEN_NVRTC"):
        return os.environ["KVGEN_NVRTC"]
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + sys.path
    pats = ["lib64/libnvrtc.so*", "lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*",
            "nvidia/cuda_nvrtc/lib/libnvrtc.so*"]
    for root in roots:
        for pat in pats:
            hits = sorted(p for p in glob.glob(os.path.join(root, pat)) if "builtins" not in p)
            if root and hits:
                return hits[0]
    return ctypes.util.find_library("nvrtc")


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)


# ---- CUDA C: compile ------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles(cu, arch, tmp_path):
    r = _run([NVCC, "-std=c++17", f"-arch={arch}", "-c", str(cu), "-o", str(tmp_path / "k.o"),
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
    path = _libnvrtc()
    if path is None:
        pytest.skip("no libnvrtc here (pip install nvidia-cuda-nvrtc, or KVGEN_NVRTC=path)")
    from kvgen.gpu import ops

    lib = ctypes.CDLL(path)
    for name in ops.KERNEL_FILES:
        rc, log, ptx = _nvrtc_compile(lib, ops.kernel_source(name), f"{name}.cu",
                                      ["-std=c++17", f"--gpu-architecture={arch}"])
        assert rc == 0, log
        assert "warning" not in log.lower(), log
        assert ptx.count(".entry") == len(_ptx_entries(ptx))


# ---- CUDA C: launch parameters vs the entry points --------------------------------------------


def _ptx_entries(ptx: str) -> dict[str, list[str]]:
    """{entry name: PTX parameter types} of a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


@pytest.fixture(scope="module")
def ptx_entries(tmp_path_factory) -> dict[str, list[str]]:
    if NVCC is None:
        pytest.skip("nvcc not found")
    from kvgen.gpu import ops

    tmp = tmp_path_factory.mktemp("ptx")
    entries = {}
    for name in ops.KERNEL_FILES:
        src = tmp / f"{name}.cu"
        src.write_text(ops.kernel_source(name))
        r = _run([NVCC, "-std=c++17", "-arch=sm_80", "--ptx", str(src), "-o", str(tmp / f"{name}.ptx")])
        assert r.returncode == 0, r.stderr
        entries.update({f"{name}:{k}": v for k, v in _ptx_entries((tmp / f"{name}.ptx").read_text()).items()})
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
    monkeypatch.setattr(ops, "_device_index", lambda t: 0)
    monkeypatch.setattr(ops, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(ops, "_cp", lambda t: _Arr(ops._raw(t)))
    monkeypatch.setattr(ops, "_launch", lambda mod, fn, dev, grid, block, args:
                        calls.append((mod, fn, grid, block, args)))
    return calls


def _store(fmt_name, layers=2, block_size=16, kvh=2, hd=64, blocks=6):
    from kvgen.engine.kv.formats import make_format

    fmt = make_format(fmt_name, layers, block_size, kvh, hd)
    return fmt, fmt.allocate(blocks)


FORMATS = ("fp32", "fp16", "bf16", "fp8", "q4")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def test_launch_args_match_kernel_params(ptx_entries, launches):
    from kvgen.gpu import ops

    b, kvh = 3, 2
    bt = torch.zeros((b, 4), dtype=torch.int32)
    lens = torch.tensor([0, 5, -1], dtype=torch.int32)
    for name in FORMATS:
        for hd in (64, 256):
            fmt, store = _store(name, kvh=kvh, hd=hd)
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

    fmt, store = _store("fp16", kvh=2, hd=64)
    bt = torch.zeros((5, 4), dtype=torch.int32)
    lens = torch.ones(5, dtype=torch.int32)
    q = torch.zeros((5, 2 * 12, 64), dtype=torch.float16)  # 12 query heads per kv head: 2 chunks
    ops.flash_decode(q, fmt, store, 0, bt, lens, num_splits=3)
    (_, split_fn, split_grid, _, split_args), (_, red_fn, red_grid, _, red_args) = launches
    assert split_fn == "flash_decode_split_fp16_f16_hd128" and split_grid == (3, 2 * 2, 5)
    assert red_fn == "flash_decode_reduce_f16" and red_grid == (24, 5)
    assert split_args[6].shape == (5, 24, 3, 64) and split_args[7].shape == (5, 24, 3, 2)
    assert math.isclose(float(split_args[-1]), math.log2(math.e) / 8, rel_tol=1e-6)


def test_ops_validation(launches):
    from kvgen.gpu import ops

    fmt, store = _store("fp16", kvh=2, hd=64)
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
    q3, q3store = _store("q3", kvh=2, hd=64)
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


# ---- CUDA C helpers, compiled for the host ----------------------------------------------------

HOST_SRC = r"""
#include "common.cuh"
#define MAP(NAME, IN, OUT, FN) \
  void NAME(const IN* x, OUT* y, long n) { for (long i = 0; i < n; ++i) y[i] = FN(x[i]); }
#define MAP2(NAME, OUT, FN) \
  void NAME(const float* x, const float* s, OUT* y, long n) {     \
    for (long i = 0; i < n; ++i) y[i] = FN(x[i], s[i]);            \
  }
extern "C" {
MAP(f32_to_f16, float, unsigned short, kvg_f32_to_f16)
MAP(f32_to_bf16, float, unsigned short, kvg_f32_to_bf16)
MAP(f32_to_e4m3, float, unsigned char, kvg_f32_to_e4m3)
MAP(f16_to_f32, unsigned short, float, kvg_f16_to_f32)
MAP(bf16_to_f32, unsigned short, float, kvg_bf16_to_f32)
MAP(e4m3_to_f32, unsigned char, float, kvg_e4m3_to_f32)
MAP2(fp8_quantize, unsigned char, kvg_fp8_quantize)
MAP2(q4_code, unsigned char, kvg_q4_code)
void split_range(int len, int bs, int num_splits, int split, int* t) {
  kvg_split_range(len, bs, num_splits, split, t, t + 1);
}
}
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    tmp = tmp_path_factory.mktemp("host")
    (tmp / "host.cu").write_text(HOST_SRC)
    r = _run([NVCC, "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", f"-I{KDIR}", str(tmp / "host.cu"),
              "-o", str(tmp / "libkvg_host.so")])
    if r.returncode and "host compiler" in r.stderr.lower():
        pytest.skip(f"no host compiler for nvcc: {r.stderr[:200]}")
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(tmp / "libkvg_host.so"))


def _call(lib, fn, out_dtype, *arrays):
    arrays = [np.ascontiguousarray(a) for a in arrays]
    out = np.zeros(arrays[0].shape, out_dtype)
    ptrs = [a.ctypes.data_as(ctypes.c_void_p) for a in arrays]
    getattr(lib, fn)(*ptrs, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(out.size))
    return out


def _probe_floats(n=1_000_000, seed=0) -> torch.Tensor:
    """Random float32 bit patterns of every magnitude, every fp16 / bf16 / e4m3 value, the
    midpoints between neighbours (ties) and values just off them, -0.0 and the limits."""
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    rnd = rnd.view(torch.float32)
    parts = [rnd, torch.tensor([0.0, -0.0, 448.0, -448.0, 65504.0, 65519.99, 65520.0, 1e-45, -1e-45])]
    codes16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for grid in (codes16.view(torch.float16).float(), codes16.view(torch.bfloat16).float(),
                 torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()):
        grid = grid[torch.isfinite(grid)].sort().values
        mid = (grid[:-1] + grid[1:]) / 2  # exact in float32 for these formats
        parts += [grid, mid, torch.nextafter(mid, torch.full_like(mid, math.inf)),
                  torch.nextafter(mid, torch.full_like(mid, -math.inf))]
    x = torch.cat(parts)
    return x[torch.isfinite(x)]


def _bits(t: torch.Tensor) -> np.ndarray:
    view = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
            torch.float32: torch.int32}[t.dtype]
    return t.view(view).numpy()


def test_host_float_conversions_match_torch(host_lib):
    x = _probe_floats()
    xn = x.numpy()
    assert np.array_equal(_call(host_lib, "f32_to_f16", np.uint16, xn).view(np.int16), _bits(x.half()))
    assert np.array_equal(_call(host_lib, "f32_to_bf16", np.uint16, xn).view(np.int16), _bits(x.bfloat16()))
    xc = x.clamp(-448, 448)
    e4m3 = _call(host_lib, "f32_to_e4m3", np.uint8, xc.numpy())
    assert np.array_equal(e4m3, _bits(xc.to(torch.float8_e4m3fn)))
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
    assert np.array_equal(_call(host_lib, "fp8_quantize", np.uint8, x.numpy(), s.numpy()), _bits(ref))
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


# ---- Numba: lowering and the simulator (subprocesses running this file) ---------------------


def _subprocess(check: str, env_extra: dict[str, str]) -> None:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **env_extra, "PYTHONPATH": path}
    r = _run([sys.executable, __file__, check], env=env, cwd=ROOT)
    assert r.returncode == 0, f"{check} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"


def test_numba_kernels_lower_without_float64():
    """Typing + lowering of every pack kernel for every argument kind a caller can pass (no GPU,
    no simulator), refusing float64 arithmetic (the simulator computes in float32 numpy; a
    double on the device would round differently). With a libnvrtc also PTX for sm_80 / sm_90,
    assembled by ptxas."""
    extra = {"NUMBA_ENABLE_CUDASIM": "0"}
    nvrtc = _libnvrtc()
    if nvrtc and NVCC:
        extra["KVGEN_TEST_NVRTC_DIR"] = os.path.dirname(nvrtc)
        ld_path = [os.path.dirname(nvrtc), os.environ.get("LD_LIBRARY_PATH", "")]
        extra["LD_LIBRARY_PATH"] = os.pathsep.join(ld_path)
        homes = [os.environ.get("CUDA_HOME", ""), str(pathlib.Path(NVCC).resolve().parents[1]),
                 "/usr/local/cuda"]
        home = next((h for h in homes if h and glob.glob(os.path.join(h, "nvvm", "libdevice", "*.bc"))), None)
        if home:  # Numba finds libNVVM and libdevice there
            extra["CUDA_HOME"] = home
        else:
            extra.pop("KVGEN_TEST_NVRTC_DIR")
    _subprocess("lower", extra)


def test_numba_helpers_bit_exact():
    _subprocess("helpers", {"NUMBA_ENABLE_CUDASIM": "1"})


def test_numba_pack_kernels_in_simulator():
    _subprocess("simulator", {"NUMBA_ENABLE_CUDASIM": "1"})


def _check_lower() -> None:
    import types as pytypes

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
                    r = _run([_ptxas(), f"-arch=sm_{target[0]}{target[1]}", path,
                              "-o", path + ".cubin", "-warn-spills"])
                    assert r.returncode == 0 and "warning" not in r.stderr.lower(), r.stderr
                    os.remove(path)
                    os.remove(path + ".cubin")
    print("lowered", sum(len(s) for s in sigs.values()), "kernel signatures; ptxas:", bool(nvrtc))


def _check_helpers() -> None:
    import numba

    from kvgen.engine.kv import quant
    from kvgen.gpu import pack

    jit = pack.build_helpers(numba.njit)

    @numba.njit
    def apply1(fn, x, out):
        for i in range(x.size):
            out[i] = fn(x[i])

    @numba.njit
    def apply2(fn, x, s, out):
        for i in range(x.size):
            out[i] = fn(x[i], s[i])

    x = _probe_floats()
    xc = x.clamp(-448, 448)
    cases = [("f16_bits", x, lambda t: _bits(t.half()).astype(np.int64) & 0xFFFF),
             ("bf16_bits", x, lambda t: _bits(t.bfloat16()).astype(np.int64) & 0xFFFF),
             ("e4m3_bits", xc, lambda t: _bits(t.to(torch.float8_e4m3fn)).astype(np.int64))]
    for name, xs, ref in cases:
        out = np.zeros(xs.numel(), np.int64)
        apply1(jit[name], xs.numpy(), out)
        assert np.array_equal(out, ref(xs)), f"njit {name}"
        sub = xs[:: max(1, xs.numel() // 20000)]  # the pure-Python helpers (what the simulator runs)
        py = np.array([getattr(pack, name)(v) for v in sub.numpy()], np.int64)
        assert np.array_equal(py, ref(sub)), f"python {name}"
    for name, n, dt, view in (("f16_value", 2**16, torch.float16, torch.int16),
                              ("bf16_value", 2**16, torch.bfloat16, torch.int16),
                              ("e4m3_value", 256, torch.float8_e4m3fn, torch.uint8)):
        codes = np.arange(n, dtype=np.int64)
        ref = torch.from_numpy(codes).to(view).view(dt).float().numpy()
        compiled = np.zeros(n, np.float32)
        apply1(jit[name], codes, compiled)
        python = np.array([getattr(pack, name)(int(c)) for c in codes], np.float32)
        for got in (compiled, python):
            assert ((got.view(np.int32) == ref.view(np.int32)) | (np.isnan(got) & np.isnan(ref))).all(), name

    g = torch.Generator().manual_seed(2)
    v = torch.randn(300_000, generator=g) * torch.exp(torch.randn(300_000, generator=g) * 3)
    v[:500] = -0.0
    s = (v.abs() * torch.rand(300_000, generator=g) * 0.02).float()
    s[::7] = 0.0
    out = np.zeros(v.numel(), np.int64)
    apply2(jit["fp8_code"], v.numpy(), s.numpy(), out)
    assert np.array_equal(out, _bits(quant.fp8_quantize(v, s)).astype(np.int64)), "fp8_code"
    s4 = (v.abs() / torch.rand(300_000, generator=g).clamp_min(0.05) / 7).half().float()
    s4[::5] = 0.0
    y = torch.where(s4 > 0, v / torch.where(s4 > 0, s4, 1.0), 0.0)
    apply2(jit["q4_code"], v.numpy(), s4.numpy(), out)
    assert np.array_equal(out, (torch.round(y).clamp(-8, 7) + 8).long().numpy()), "q4_code"
    print("helpers ok")


def _check_simulator() -> None:
    from numba.cuda import config

    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    from kvgen.engine.kv import quant
    from kvgen.gpu import ops

    g = torch.Generator().manual_seed(3)

    def sample(shape, dtype):
        x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1], generator=g) * 2)[..., None]
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 10),), generator=g)] = 0.0
        x.view(-1, shape[-1])[0] = 0.0  # an all-zero row: scale 0
        return x.to(dtype)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_raw_bits(a), _raw_bits(b))

    # fp8: whole store-shaped blocks [n, L, 2, BS, KVH, HD]; odd token counts; a partly written block.
    for shape in ((2, 1, 2, 4, 2, 8), (1, 2, 2, 5, 1, 6), (3, 1, 1, 1, 3, 2), (1, 1, 2, 7, 2, 16)):
        for dt in DTYPES:
            x = sample(shape, dt)
            x[0, 0, 0, shape[3] // 2:] = 0.0  # the unwritten tail of a block
            q, scale = ops.pack_fp8(x)
            ref_scale = x.float().abs().amax(dim=(-3, -1)) / quant.FP8_MAX
            ref_q = quant.fp8_quantize(x, ref_scale[..., None, :, None])
            assert same(scale, ref_scale), ("fp8 scale", shape, dt)
            assert same(q, ref_q), ("fp8 q", shape, dt)
            for out_dt in DTYPES:
                got = ops.unpack_fp8(q, scale, out_dt)
                assert same(got, quant.fp8_dequantize(ref_q, ref_scale[..., None, :, None]).to(out_dt)), \
                    ("fp8 unpack", shape, dt, out_dt)
    # into the store itself: a strided slice of one layer
    from kvgen.engine.kv.formats import make_format

    fmt = make_format("fp8", 2, 4, 2, 8)
    store = fmt.allocate(3)
    x = sample((4, 2, 8), torch.float16)
    ops.pack_fp8(x, store["kv"][1, 1, 0], store["scale"][1, 1, 0])
    ref_scale = x.float().abs().amax(dim=(0, 2)) / quant.FP8_MAX
    assert same(store["scale"][1, 1, 0], ref_scale)
    assert same(store["kv"][1, 1, 0], quant.fp8_quantize(x, ref_scale[None, :, None]))
    assert not _raw_bits(store["kv"][0]).any() and not _raw_bits(store["kv"][1, 0]).any()

    # q4: rows of any leading shape, even / odd group sizes, odd row counts
    for shape, group in (((3, 5, 2, 8), None), ((7, 6), 3), ((1, 4, 16), 2), ((2, 3, 64), 32), ((5, 64), 16)):
        for dt in DTYPES:
            x = sample(shape, dt)
            packed, scales = ops.pack_q4(x, group)
            gs = group or min(32, shape[-1])
            ref_p, ref_s = quant.q4_quantize(x, gs)
            assert same(packed, ref_p) and same(scales, ref_s), ("q4", shape, group, dt)
            for out_dt in DTYPES:
                got = ops.unpack_q4(packed, scales, group, out_dt)
                ref = quant.q4_dequantize(ref_p, ref_s, gs).to(out_dt)
                assert same(got, ref), ("q4 unpack", shape, out_dt)
    # q4 values straight into a store slice, through the format's own read
    fmt = make_format("q4", 2, 4, 2, 8, group_size=4)
    store = fmt.allocate(2)
    x = sample((4, 2, 8), torch.float32)
    ops.pack_q4(x, 4, store["q"][1, 0, 1], store["vscale"][1, 0])
    _, v = fmt.read(store, 0, torch.tensor([1]))
    ref_p, ref_s = quant.q4_quantize(x, 4)
    assert torch.equal(v[0], quant.q4_dequantize(ref_p, ref_s, 4))
    print("simulator ok")


def _raw_bits(t: torch.Tensor) -> torch.Tensor:
    view = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
            torch.float32: torch.int32}.get(t.dtype)
    return t.view(view) if view is not None else t


# ---- GraphRunner (CPU stand-in for the graph) and the reference -------------------------------


def test_graph_runner_buckets_and_padding():
    from kvgen.gpu.graphs import GraphRunner

    seen = []

    def step(inp):
        seen.append({k: v.clone() for k, v in inp.items()})
        valid = inp["lens"] >= 0
        inp["lens"] += valid.int()  # a device-side counter the step advances
        return {"y": inp["x"] * 2 + inp["lens"][:, None], "n": inp["lens"].sum()}

    runner = GraphRunner(step, pad_values={"lens": -1}, inplace=("lens",), warmup=1)
    x = torch.arange(6.0).reshape(3, 2)
    lens = torch.tensor([4, 0, 7], dtype=torch.int32)
    out = runner({"x": x, "lens": lens})
    assert runner.captured == (4,)
    assert seen[-1]["x"].shape == (4, 2) and seen[-1]["lens"].tolist() == [4, 0, 7, -1]
    assert out["y"].shape == (3, 2) and torch.equal(out["y"], x * 2 + torch.tensor([[5], [1], [8]]))
    assert lens.tolist() == [5, 1, 8]  # copied back
    # a smaller batch reuses its own bucket and repads rows left over from before
    out = runner({"x": x[:1], "lens": lens[:1]})
    assert runner.captured == (1, 4) and lens.tolist() == [6, 1, 8]
    out = runner({"x": x[:2], "lens": lens[:2].clone()})
    assert seen[-1]["lens"].tolist()[:2] == [6, 1]
    out = runner({"x": x, "lens": lens})
    assert seen[-1]["lens"].tolist() == [6, 1, 8, -1]
    # off, or above the largest bucket: eager on the inputs themselves
    runner.enabled = False
    n_before = len(seen)
    out = runner({"x": x, "lens": lens})
    assert len(seen) == n_before + 1 and seen[-1]["x"].shape == (3, 2) and lens.tolist() == [8, 3, 10]
    runner.enabled = True
    small = GraphRunner(step, buckets=(1, 2))
    assert small({"x": x, "lens": lens.clone()})["y"].shape == (3, 2)
    assert small.captured == ()
    with pytest.raises(ValueError, match="only the batch"):
        runner({"x": x.double(), "lens": lens})
    with pytest.raises(ValueError, match="disagree"):
        runner({"x": x[:2], "lens": lens})


def test_graph_runner_capture_ahead():
    from kvgen.gpu.graphs import GraphRunner

    runner = GraphRunner(lambda inp: inp["x"] + 1, buckets=(1, 2, 4), pad_values={"x": -5})
    runner.capture({"x": torch.zeros(1, 3)})
    assert runner.captured == (1, 2, 4)
    out = runner({"x": torch.ones(3, 3)})
    assert out.shape == (3, 3) and torch.equal(out, torch.full((3, 3), 2.0))


def test_paged_decode_reference_matches_dense_attention():
    from kvgen.engine.kv.formats import make_format
    from kvgen.gpu.reference import kv_append_reference, paged_decode_reference

    g = torch.Generator().manual_seed(4)
    fmt = make_format("fp32", 1, 4, 2, 8)
    store = fmt.allocate(12)
    lens = [5, 0, 9]
    tables = torch.tensor([[3, 7, -1, -1], [-1, -1, -1, -1], [0, 11, 2, -1]], dtype=torch.int32)
    ks = [torch.randn(n, 2, 8, generator=g) for n in lens]
    vs = [torch.randn(n, 2, 8, generator=g) for n in lens]
    for pos in range(max(lens)):
        seq = torch.tensor([pos if pos < n else -1 for n in lens], dtype=torch.int32)
        k = torch.stack([ks[b][min(pos, n - 1)] if n else torch.zeros(2, 8) for b, n in enumerate(lens)])
        v = torch.stack([vs[b][min(pos, n - 1)] if n else torch.zeros(2, 8) for b, n in enumerate(lens)])
        kv_append_reference(fmt, store, 0, k, v, tables, seq)
    q = torch.randn(3, 6, 8, generator=g)  # GQA 3
    out = paged_decode_reference(q, fmt, store, 0, tables, torch.tensor(lens, dtype=torch.int32))
    for b, n in enumerate(lens):
        if n == 0:
            assert not out[b].any()
            continue
        k = ks[b].repeat_interleave(3, dim=1)
        v = vs[b].repeat_interleave(3, dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], k.transpose(0, 1), v.transpose(0, 1))[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


def test_import_without_cupy():
    r = _run([sys.executable, "-c", "import sys; sys.modules['cupy'] = None; import kvgen.gpu as g, "
              "kvgen.gpu.ops, kvgen.gpu.graphs, kvgen.gpu.reference; print(g.available())"], cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# ---- CUDA C kernels run on the host (emulated threads) ---------------------------------------
# The real kernels/*.cu compiled by g++ with a shim for the CUDA built-ins, launched through
# ops.py's own Python code on CPU tensors: checks the kernels' indexing, online softmax, split
# merging, fp8 requantisation and padding handling end to end without a GPU. Host float math
# is IEEE like the device's (no fma contraction here; the append kernels have no multiply-add
# to contract on the device either), so append must be byte-identical to KVFormat.write.

EMU_SHIM = r"""
// Host emulation of the CUDA built-ins the kernels use. The threads of a block are fibers
// (ucontext) on one OS thread, run round-robin; __syncthreads and warp shuffles are
// barriers that yield until every thread of the block / warp has arrived. Blocks run one
// after another.
#include <ucontext.h>
#include <algorithm>
#include <math.h>
#include <vector>
#define __CUDACC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct kvg_dim3 { unsigned x, y, z; };
static kvg_dim3 threadIdx, blockIdx, blockDim, gridDim;
using std::max;
using std::min;

struct EmuFiber { ucontext_t ctx; bool done; std::vector<char> stack; };
static std::vector<EmuFiber> emu_fibers;
static ucontext_t emu_sched;
static unsigned emu_cur;
struct EmuBarrier { unsigned count = 0, gen = 0; };
static EmuBarrier emu_block_bar, emu_warp_bar[32];
static float emu_warp_vals[32][32];

static void emu_yield() { swapcontext(&emu_fibers[emu_cur].ctx, &emu_sched); }
static void emu_wait(EmuBarrier& b, unsigned n) {
  const unsigned g = b.gen;
  if (++b.count == n) { b.count = 0; ++b.gen; return; }
  while (b.gen == g) emu_yield();
}
inline void __syncthreads() { emu_wait(emu_block_bar, blockDim.x); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  emu_warp_vals[warp][lane] = v;
  emu_wait(emu_warp_bar[warp], 32);
  const float r = emu_warp_vals[warp][lane ^ (unsigned)mask];
  emu_wait(emu_warp_bar[warp], 32);
  return r;
}
static void (*emu_body)(void*);
static void* emu_body_arg;
static void emu_entry() {
  emu_body(emu_body_arg);
  emu_fibers[emu_cur].done = true;
}
template <class F>
static void emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, F body) {
  blockDim = {threads, 1, 1};
  gridDim = {gx, gy, gz};
  emu_fibers.assign(threads, EmuFiber{});
  emu_body = [](void* p) { (*(F*)p)(); };
  emu_body_arg = &body;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        emu_block_bar = EmuBarrier{};
        for (auto& w : emu_warp_bar) w = EmuBarrier{};
        for (unsigned t = 0; t < threads; ++t) {
          EmuFiber& f = emu_fibers[t];
          f.done = false;
          f.stack.resize(1 << 16);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &emu_sched;
          makecontext(&f.ctx, emu_entry, 0);
        }
        for (unsigned live = threads; live;) {  // round-robin until every thread returned
          live = 0;
          for (unsigned t = 0; t < threads; ++t) {
            if (emu_fibers[t].done) continue;
            emu_cur = t;
            threadIdx = {t, 0, 0};
            swapcontext(&emu_sched, &emu_fibers[t].ctx);
            live += !emu_fibers[t].done;
          }
        }
      }
}
"""

EMU_LAUNCHERS = r"""
#include "kv_append.cu"
#include "flash_decode.cu"
typedef void (*append_fn)(KVG_APPEND_PARAMS);
typedef void (*split_fn)(KVG_SPLIT_PARAMS);
typedef void (*reduce_fn)(const float*, const float*, void*, int, int, int);
typedef void (*incr_fn)(int*, const u8*, int, int, int);
extern "C" {
void emu_append(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, KVG_APPEND_PARAMS) {
  emu_launch(gx, gy, gz, threads, [&] {
    ((append_fn)f)(k, v, cache, cache_scale, key_scale, block_tables, seq_lens, max_blocks, L, layer, BS, KVH,
                   HD, group);
  });
}
void emu_split(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, KVG_SPLIT_PARAMS) {
  emu_launch(gx, gy, gz, threads, [&] {
    ((split_fn)f)(q, cache, cache_scale, key_scale, block_tables, context_lens, part_acc, part_ml, max_blocks,
                  len_offset, H, KVH, HD, L, layer, BS, group, num_splits, qk_scale);
  });
}
void emu_reduce(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, const float* part_acc,
                const float* part_ml, void* out, int H, int HD, int S) {
  emu_launch(gx, gy, gz, threads, [&] { ((reduce_fn)f)(part_acc, part_ml, out, H, HD, S); });
}
void emu_increment(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, int* seq_lens,
                   const u8* valid, int has_valid, int B, int n) {
  emu_launch(gx, gy, gz, threads, [&] { ((incr_fn)f)(seq_lens, valid, has_valid, B, n); });
}
}
"""


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    tmp = tmp_path_factory.mktemp("emu")
    (tmp / "emu.cpp").write_text(EMU_SHIM + EMU_LAUNCHERS)
    r = _run([gxx, "-std=c++20", "-O2", "-ffp-contract=off", "-shared", "-fPIC", f"-I{KDIR}",
              str(tmp / "emu.cpp"), "-o", str(tmp / "libkvg_emu.so")])
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(tmp / "libkvg_emu.so"))


@pytest.fixture
def emulated(emu_lib, monkeypatch):
    """kvgen.gpu.ops running its CUDA C kernels on the host, on CPU tensors."""
    from kvgen.gpu import ops

    def launch(module, fn, dev, grid, block, args):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if fn == "kv_increment":
            family = emu_lib.emu_increment
        elif fn.startswith("kv_append_"):
            family = emu_lib.emu_append
        elif fn.startswith("flash_decode_split_"):
            family = emu_lib.emu_split
        else:
            family = emu_lib.emu_reduce
        cargs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                cargs.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, np.int32):
                cargs.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.float32):
                cargs.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"{fn}: argument of type {type(a)}")
        kernel = ctypes.cast(getattr(emu_lib, fn), ctypes.c_void_p)
        family(kernel, *(ctypes.c_uint(g) for g in grid), ctypes.c_uint(block[0]), *cargs)

    monkeypatch.setattr(ops, "_launch", launch)
    monkeypatch.setattr(ops, "_cp", ops._raw)
    monkeypatch.setattr(ops, "_device_index", lambda t: 0)
    monkeypatch.setattr(ops, "_sm_count", lambda dev: 2)  # a small GPU: the heuristic splits
    return ops


def _paged(name, lens, *, layers=2, block_size=8, kvh=2, hd=64, spare=3, extra=1, seed=0):
    """A store with sequences of the given lengths written through the format, blocks scattered;
    returns (fmt, store, tables [B, width] int32, spare block ids)."""
    from kvgen.engine.kv.formats import make_format

    g = torch.Generator().manual_seed(seed)
    fmt = make_format(name, layers, block_size, kvh, hd)
    need = [-(-max(n, 0) // block_size) for n in lens]
    total = sum(need) + spare
    store = fmt.allocate(total)
    perm = torch.randperm(total, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + extra), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    for layer in range(layers):
        for b, n in enumerate(lens):
            if n > 0:
                pos = torch.arange(n)
                mag = torch.exp(torch.randn(n, 1, 1, generator=g))  # fp8 scales from different rows
                k = torch.randn(n, kvh, hd, generator=g) * mag
                v = torch.randn(n, kvh, hd, generator=g) * mag
                fmt.write(store, layer, tables[b][pos // block_size].long(), pos % block_size, k, v)
    return fmt, store, tables, perm[at:]


def _assert_same_store(a, b):
    for key in a:
        x, y = _raw_bits(a[key]), _raw_bits(b[key])
        assert torch.equal(x, y), f"store[{key!r}] differs at {(x != y).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("name", FORMATS)
def test_emulated_kv_append_matches_format_write(emulated, name):
    from kvgen.gpu.reference import kv_append_reference

    ops = emulated
    bs, hd = 8, 64
    # New tokens at block starts / ends / odd places, then padding: -1, past the table, a -1 entry.
    pos = [0, bs - 1, bs, 2 * bs - 1, 2 * bs + 3, 21, -1, 0, 0]
    fmt, store, tables, spare = _paged(name, [max(p, 0) for p in pos], block_size=bs, hd=hd, kvh=3)
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
        _assert_same_store(got, ref)
        assert seq_lens.tolist() == pos
        if name in ("fp8", "q4"):  # the re-encoding path ran: a part-filled block's scale grew
            key = "scale" if name == "fp8" else "kscale"
            grown = got[key].float() > store[key].float()
            assert any(grown[tables[b, p // bs]].any() for b, p in enumerate(pos[:6]) if p % bs), "no growth"
    # every row padding: nothing at all changes
    got = {n: t.clone() for n, t in store.items()}
    ops.kv_append(fmt, got, 0, k * 100, v * 100, tables, torch.tensor([-1, -3] + [-1] * 7, dtype=torch.int32))
    _assert_same_store(got, store)


def test_emulated_increment(emulated):
    lens = torch.tensor([0, 5, -1, 7, 300] * 30, dtype=torch.int32)  # 150 rows: two thread blocks
    emulated.increment(lens)
    assert lens.tolist() == [1, 6, -1, 8, 301] * 30
    valid = torch.tensor([True, False, True, True, False] * 30)
    emulated.increment(lens, valid, n=2)
    assert lens.tolist() == [3, 6, -1, 10, 301] * 30


@pytest.mark.parametrize("gqa", (1, 3, 8, 12))
@pytest.mark.parametrize("name", FORMATS)
def test_emulated_flash_decode_matches_reference(emulated, name, gqa):
    from kvgen.gpu.reference import paged_decode_reference

    ops = emulated
    # (block size, head_dim, kv heads, q dtype) vary with the case; lengths hit block edges,
    # an empty row and odd lengths; 12 query heads per kv head take two head chunks.
    i = FORMATS.index(name) + gqa
    bs, hd, kvh = ((8, 64, 2), (16, 96, 1), (4, 32, 2), (8, 256, 1))[i % 4]
    q_dtype = DTYPES[i % 3]
    lens = [1, bs, bs + 1, 2 * bs - 1, 0, 53]
    fmt, store, tables, _ = _paged(name, lens, block_size=bs, hd=hd, kvh=kvh, seed=i)
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(len(lens), kvh * gqa, hd, generator=g) * 2).to(q_dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    # Scores reach ~100 with these magnitudes, so float32 rounding of a dot product moves a
    # softmax weight by ~1e-4 relative: the fp32 tolerance is that, not float32 epsilon.
    tol = {torch.float32: 3e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[q_dtype]
    ref = paged_decode_reference(q, fmt, store, 1, tables, ctx)
    for splits in (None, 1, 4):
        out = ops.flash_decode(q, fmt, store, 1, tables, ctx, num_splits=splits)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol, msg=lambda m, s=splits: f"{s}: {m}")
        assert not out[4].any()  # the empty row
    # decode-step form: counters before the new token, len_offset=1
    out = ops.flash_decode(q, fmt, store, 1, tables, (ctx - 1).clamp_min(-1), len_offset=1)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


if __name__ == "__main__":  # the subprocess checks above
    {"lower": _check_lower, "helpers": _check_helpers, "simulator": _check_simulator}[sys.argv[1]]()
