"""Run torch set-up work in a thread that exits afterwards.

torch's CPU parallelism is libgomp's: every thread that opens a parallel region gets its own
pool of worker threads, kept until that thread exits. Once the pools hold more threads than
there are cores, libgomp stops spin-waiting between regions and every parallel op pays a
futex wake-up: a decode step on the engine thread ran 2.5x slower on 2 cores when the main
thread had loaded the model (bench/results/cpu.md). Loading in a thread that then exits takes
its pool with it, so the engine thread's pool is the only one.
"""

from __future__ import annotations

import threading


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
