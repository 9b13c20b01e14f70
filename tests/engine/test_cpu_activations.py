"""CPU_ACTIVATIONS: the int8-activation kernels (kvgen/cpu/int8_matmul.py: the q4, q8, q5, q5m and q6h kinds) as
the engine runs them.

The kernels are chosen when kvgen.cpu is imported (features.py), so the int8 build runs in a process of its
own, with its own kernel cache: the engine's own suites of the fused step and of batch invariance, on the q4, q8
and mixed-kind models they build, there. The kernel itself against its reference: tests/cpu/test_int8_matmul.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgen.cpu import features
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.model_files import embedded_model_path

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def embedded_blocks():
    return load_model(embedded_model_path(), "auto")


def test_the_setting_names_its_values_and_must_be_the_builds(embedded_blocks):
    with pytest.raises(ValueError, match="int16 or int8"):
        Generator(*embedded_blocks, EngineOptions(cpu_activations="int4"))
    if features.ACTIVATIONS == "int16":  # this process's kernels: asking the options for others is an error
        want = "needs AVX512-VNNI" if not features.VNNI else "read from the environment"
        with pytest.raises(ValueError, match=want):
            Generator(*embedded_blocks, EngineOptions(cpu_activations="int8"))


@pytest.mark.slow  # a second build of every kernel (~90 s of compiling on 2 cores), then the suites
@pytest.mark.skipif(not features.VNNI, reason="int8 activations take AVX512-VNNI")
def test_int8_activations_keep_the_fused_step_and_batch_invariance():
    """Under CPU_ACTIVATIONS=int8 the fused step still equals Model.forward on Q4_1 / Q4_K / Q8_0 files and the
    mixtures of every kind (both multiply int8 activations), and a request's tokens do not depend on its batch."""
    code = ("from kvgen.cpu import features\n"
            "assert features.INT8 and features.path().endswith('+int8'), features.path()\n"
            "import sys, pytest\n"
            "sys.exit(pytest.main(['-q', '-p', 'no:randomly', '-p', 'no:cacheprovider', '-m', 'not slow',\n"
            "    'tests/engine/test_batch_invariance.py', 'tests/engine/test_fused_decode.py',\n"
            "    '-k', 'q4 or Q4 or Q8 or mixture or a_step_of_several or batch or sessions']))\n")
    env = dict(os.environ, CPU_ACTIVATIONS="int8")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
