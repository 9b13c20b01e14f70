"""ruff over the Python sources, as `make lint` runs it: a line too long or an unused import fails
the suite (and so CI), not only a `make lint` nobody ran."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_passes():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists() and not shutil.which("ruff"):
        pytest.skip("ruff is not installed")
    p = subprocess.run([str(ruff) if ruff.exists() else "ruff", "check", "kvgen", "tests", "bench"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
