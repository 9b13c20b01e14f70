"""The Numba pack kernels (kvgen/gpu/pack.py) without a GPU: they lower with no float64
arithmetic (and, with a libnvrtc, assemble with ptxas for sm_80 / sm_90); their scalar helpers
are bit-exact with torch; under Numba's CUDA simulator the kernels match kvgen.engine.kv.quant.

Each check is a script in tests/gpu/numba_checks/ run in a subprocess: NUMBA_ENABLE_CUDASIM is
read once when numba is first imported, so each check needs a fresh interpreter with it set.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sys

import pytest

from tests.gpu.helpers import NVCC, ROOT, libnvrtc, run


def _check(name: str, env_extra: dict[str, str]) -> None:
    """Run tests/gpu/numba_checks/<name>.py in a fresh interpreter with env_extra set."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **env_extra, "PYTHONPATH": path}
    r = run([sys.executable, "-m", f"tests.gpu.numba_checks.{name}"], env=env, cwd=ROOT)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"


def test_numba_kernels_lower_without_float64():
    """Typing + lowering of every pack kernel for every argument kind a caller can pass (no GPU,
    no simulator), refusing float64 arithmetic (the simulator computes in float32 numpy; a
    double on the device would round differently). With a libnvrtc also PTX for sm_80 / sm_90,
    assembled by ptxas."""
    extra = {"NUMBA_ENABLE_CUDASIM": "0"}
    nvrtc = libnvrtc()
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
    _check("lower", extra)


def test_numba_helpers_bit_exact():
    _check("bit_exact", {"NUMBA_ENABLE_CUDASIM": "1"})


@pytest.mark.slow  # 40 s of simulated CUDA: `make test-slow` (CI's time); the helpers above run in `make test`
def test_numba_pack_kernels_in_simulator():
    _check("simulator", {"NUMBA_ENABLE_CUDASIM": "1"})
