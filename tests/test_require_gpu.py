"""KVGEN_REQUIRE_GPU (tests/conftest.py's report hook, set by `make test-gpu`): a `gpu` test that skips
fails instead, so a GPU run without a device cannot pass by skipping; other tests skip as ever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = '''
import pytest

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_on_the_gpu():
    pass

@pytest.mark.skipif(True, reason="not today")
def test_elsewhere():
    pass
'''


def _run(tmp_path, require: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "KVGEN_REQUIRE_GPU"}
    if require:
        env["KVGEN_REQUIRE_GPU"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_suite.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_skipped_gpu_test_fails_when_a_gpu_is_required(tmp_path):
    out = _run(tmp_path, require=True)
    assert out.returncode == 1, out.stdout
    assert "KVGEN_REQUIRE_GPU is set and this GPU test skipped: Skipped: needs a CUDA device" in out.stdout
    assert "1 skipped" in out.stdout and "1 error" in out.stdout  # (a skip at setup fails as an error)


def test_without_it_gpu_tests_skip(tmp_path):
    out = _run(tmp_path, require=False)
    assert out.returncode == 0, out.stdout
    assert "2 skipped" in out.stdout
