"""Importing the engine must not open a torch (OpenMP) worker pool on the importing thread.

threads.py says why: a second libgomp pool (the importing thread's, next to the engine thread's)
made every fused decode step ~2.5x slower on 2 cores. It happened once through a torch op over
65,536 values run at import (kv_io's float16 table); this test would have caught it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvgen.cpu.threads import in_fresh_thread

_COUNT = """
import importlib, os, pkgutil
import torch
torch.set_num_threads(2)  # a pool, if one opens, has a worker to show for it
before = len(os.listdir("/proc/self/task"))
{body}
print(before, len(os.listdir("/proc/self/task")))
"""

_IMPORT_ENGINE = """
import kvgen.cpu, kvgen.engine
for pkg in (kvgen.cpu, kvgen.engine):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
"""


def _threads(body: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _COUNT.format(body=body)], capture_output=True, text=True,
                         check=True, timeout=300)
    before, after = out.stdout.split()[-2:]
    return int(before), int(after)


def test_a_large_torch_op_on_the_importing_thread_opens_a_pool():
    """The check below can fail: the same count sees the pool a large op opens."""
    before, after = _threads("torch.arange(65536, dtype=torch.float32).exp().sum()")
    assert after > before


def test_importing_every_cpu_and_engine_module_opens_no_thread():
    before, after = _threads(_IMPORT_ENGINE)
    assert after == before, f"importing kvgen.cpu and kvgen.engine started {after - before} threads"


def test_in_fresh_thread_returns_the_result_and_raises_the_error():
    assert in_fresh_thread(lambda a, b=0: a + b, 2, b=3) == 5

    def boom():
        raise KeyError("x")

    try:
        in_fresh_thread(boom)
    except KeyError as e:
        assert e.args == ("x",)
    else:
        raise AssertionError("the error was not raised")


_ENGINE_WITH_A_DRAFTER = """
import tempfile
from safetensors.torch import save_file
from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.sampling import SamplingParams
from kvgen.cpu.threads import in_fresh_thread
from tests.engine.speculative.test_lossless import eagle_head
from tests.engine.test_batch_invariance import small_model
model, tokenizer = in_fresh_thread(small_model)
head = tempfile.NamedTemporaryFile(suffix=".safetensors")
in_fresh_thread(lambda: save_file(eagle_head(model.cfg), head.name))
import time
def settled():  # an exited thread's pool workers go a moment after it
    n = -1
    while n != len(os.listdir("/proc/self/task")):
        n = len(os.listdir("/proc/self/task"))
        time.sleep(0.3)
    return n
before = settled()  # from here: the engines' own
for opts in (EngineOptions(speculative="eagle", eagle_head=head.name), EngineOptions(speculative="draft")):
    gen = Generator(model, tokenizer, opts, draft_model=model)
    gen.generate("the cat sat on the mat and the cat sat on the", SamplingParams(temperature=0, max_new_tokens=8))
    gen.close()
settled()
"""


@pytest.mark.heavy
def test_an_engine_with_a_drafter_leaves_no_pool_behind():
    """Building and closing engines that draft (an EAGLE head, a draft model) leaves the caller's
    thread without a pool: one left there slowed every later engine in the process to less than
    half its speed (bench/speculative.py's plain decoding after an EAGLE engine had run)."""
    before, after = _threads(_ENGINE_WITH_A_DRAFTER)
    assert after == before, f"the engines left {after - before} threads"
