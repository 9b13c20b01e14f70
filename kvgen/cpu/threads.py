"""Run torch set-up work in a thread that exits afterwards; cap the kernels' threads.

torch's CPU parallelism is libgomp's: every thread that opens a parallel region gets its own
pool of worker threads, kept until that thread exits. Once the pools hold more threads than
there are cores, libgomp stops spin-waiting between regions and every parallel op pays a
futex wake-up: a decode step on the engine thread ran 2.5x slower on 2 cores when the main
thread had loaded the model (bench/results/cpu.md). Loading in a thread that then exits takes
its pool with it, so the engine thread's pool is the only one.

The kernels' own pool (Numba's) takes every core unless the thread that launches them says
otherwise: two replicas with THREADS=1 on 2 cores each ran 2 kernel threads, and spun against each
other (a chat workload took 14.1 s a replica, 7.8 s with one thread each).
"""

from __future__ import annotations

import threading

import numba

# The most runs a kernel cuts its work in (a call's tiles, rows or tasks), one a thread: Numba's pool
PARTS = numba.config.NUMBA_NUM_THREADS


def in_fresh_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a new thread; returns its result or raises its exception."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed back to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="kvgen-setup")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def use_threads(n: int) -> None:
    """The calling thread's kernel launches take n threads (at most Numba's pool): THREADS for the
    kernels, as torch.set_num_threads is for torch's ops. Numba keeps the count per launching thread,
    so the thread that runs the kernels (the engine's) calls this itself."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
