"""The GPU decode kernels over an ExactTail store on a real GPU (`make test-gpu`; skipped without
a CUDA device, CuPy and Numba): the cases of tests/gpu/test_emulated_exact_tail.py, run on cuda
tensors with kvgen.gpu.ops itself.

* decode steps through ExactTail.prepare_decode + kv_append + flash_decode against
  ExactTail.write + paged_decode_reference: store, exact rows, sink and slot maps byte for byte,
  attention within the flash-decode tolerances (block boundaries crossed, a first token written
  to the sink by the kernels, a padding row, more sequences than slots);
* ModelRunner with make_format(fp8 / q4, recent_slots=2) on CUDA picks the kernels and its
  decode logits (CUDA graphs on and off) match the same runner on torch attention.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu.test_emulated_exact_tail import check_coverage, compare_runner_decode, decode_case


def _ready() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return False
    import kvgen.gpu

    return kvgen.gpu.available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ready(), reason="needs a CUDA device, CuPy and Numba")]


@pytest.mark.parametrize(("name", "gqa", "dtype"), [("fp8", 1, torch.float32), ("fp8", 3, torch.bfloat16),
                                                    ("q4", 1, torch.float16), ("q4", 4, torch.float32)])
def test_decode_over_exact_tail_matches_torch_path(name, gqa, dtype):
    from kvgen.gpu import ops

    check_coverage(decode_case(ops, name, gqa, dtype, "cuda", hd=(64, 32)[gqa % 2], seed=gqa))


@pytest.fixture(scope="module")
def tiny_cuda():
    from kvgen.engine.model import Model
    from tests.tiny import tiny_config, tiny_weights

    cfg = tiny_config(layers=2, hidden=128, heads=4, kv_heads=2, ffn=128, vocab=512, context=256)
    return Model(cfg, tiny_weights(cfg, seed=5), device="cuda")


@pytest.mark.parametrize("graphs", (True, False))
@pytest.mark.parametrize("kv", ("fp8", "q4"))
def test_runner_decode_over_exact_tail_matches_torch_attention(tiny_cuda, kv, graphs):
    from kvgen.gpu import ops

    # The kernel side runs the rows padded to a bucket (5 -> 8), so GEMM rounding can move a
    # stored code: the tolerance of test_cuda_engine's test_decode_step_matches_forward for fp8 / q4.
    runner = compare_runner_decode(tiny_cuda, kv, None, graphs=graphs, atol=2e-2)
    assert runner.kernel_attention.kernels is ops  # the real kernels, picked by pick_kernel_attention
