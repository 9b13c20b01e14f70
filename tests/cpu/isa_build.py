"""Run code in a process whose kernels are built for another instruction set: this CPU's features
with some turned off (NUMBA_CPU_FEATURES). Its kernel cache is kvgen's own for that feature set
(kernel_cache.py keys the folder on the features), so the builds for one ISA are compiled once and
shared by every test, and by later runs, until a kernel's source changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_in_build(code: str, isa: str, *argv: str) -> None:
    env = dict(os.environ, NUMBA_CPU_FEATURES=isa)
    subprocess.run([sys.executable, "-c", code, *argv], env=env, check=True, timeout=600, cwd=ROOT)
