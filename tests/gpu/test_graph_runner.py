"""GraphRunner on the CPU, where the step runs eagerly in place of a captured graph: batch size
buckets, padding rows, copy-back of in-place inputs, capture ahead of time and the checks on its
inputs. (Graph replay itself is checked on a GPU in test_kernels.py.)"""

from __future__ import annotations

import pytest
import torch


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
