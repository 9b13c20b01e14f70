"""Weight settings (WEIGHT_DTYPE): every one runs a batch of decode rows of each size the
packed kernels and the dequantized path see, and a sequence decodes the same in a batch as alone."""

from __future__ import annotations

import pytest
import torch

from bench.kv import greedy
from kvgen.engine.kv.formats import make_format
from kvgen.engine.model import SMALL_M, Model
from tests.tiny import tiny_config, tiny_weights


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3, SMALL_M + 2])
def test_a_sequence_decodes_the_same_in_a_batch_as_alone(weights, batch):
    cfg = tiny_config(vocab=512, hidden=64, heads=4, kv_heads=2, ffn=128)
    model = Model(cfg, tiny_weights(cfg), weights)
    fmt = make_format("auto", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, compute_dtype=model.act_dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (5 + i,), generator=g).tolist() for i in range(batch)]
    together = greedy(model, prompts, fmt, 12)
    alone = [greedy(model, [p], fmt, 12)[0] for p in prompts]
    assert [len(t) for t in together] == [12] * batch
    # rows of a batch go through the same kernels as a lone row up to SMALL_M rows; past it the
    # dequantized weight gives other roundings, so only most tokens must agree
    same = sum(a == b for t, s in zip(together, alone, strict=True) for a, b in zip(t, s, strict=True))
    assert same == 12 * batch if batch <= SMALL_M or weights == "fp32" else same >= 0.75 * 12 * batch


def test_auto_weight_dtype_follows_the_device_and_the_file():
    """auto: on the CPU blocks where there are any, else fp32; on a GPU bf16 for a file of anything
    narrower than fp32 (an HF bf16 folder, a GGUF's quantized blocks), fp32 for an fp32 file."""
    from kvgen.engine.model import resolve_weight_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_dtype("auto", cpu, {"w": object()}, {"Q4_1": 180, "F32": 61}) == "gguf"
    assert resolve_weight_dtype("auto", cpu, None, {"F32": 10}) == "fp32"
    assert resolve_weight_dtype("auto", cuda, None, {"BF16": 290}) == "bf16"
    assert resolve_weight_dtype("auto", cuda, {"w": object()}, {"Q4_1": 180, "F32": 61}) == "bf16"
    assert resolve_weight_dtype("auto", cuda, None, {"F32": 10}) == "fp32"
    assert resolve_weight_dtype("auto", cuda, None, {}) == "fp32"  # a model made in memory names no types
    assert resolve_weight_dtype("fp32", cuda, None, {"BF16": 290}) == "fp32"  # asked for, not auto
