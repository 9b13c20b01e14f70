"""GGUF blocks (blocks.py) and their Numba kernels (cpu_kernels.py) against gguf-py and fp32 matmuls."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvgen.engine.blocks import KERNEL_ROWS, BlockLinear, Blocks
from kvgen.engine.generator import load_model
from kvgen.engine.model import Model, interleave
from tests.engine.test_loader import all_logits, bpe, chunkings, gguf_base, logits_at_chunk_ends, token_sequences  # noqa: F401  (fixtures)
from tests.tiny import write_gguf

Q = gguf.GGMLQuantizationType
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)


def quantized(qtype, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [n, k/32 * block bytes], what gguf-py dequantizes them to [n, k])."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, :32] += 0.3  # blocks whose minimum is well above zero (Q4_1's m term)
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(n, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_blocks_dequantize_as_gguf_py(qtype):
    raw, ref = quantized(qtype, 40, 96)
    b = Blocks.from_gguf(qtype.name, raw)
    assert b.shape == (40, 96)
    assert torch.equal(b.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, KERNEL_ROWS, KERNEL_ROWS + 3, 37])  # both kernels and the fp32 copy
def test_block_linear_is_the_fp32_matmul(qtype, rows):
    """Kernel rows (<= KERNEL_ROWS) and the fp32 copy's rows both compute x W^T of the dequantized
    weight; 72 output rows is not a whole number of tiles (the kernel pads)."""
    raw, ref = quantized(qtype, 72, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(72)
    got = BlockLinear(Blocks.from_gguf(qtype.name, raw), bias)(x)
    want = x @ torch.from_numpy(ref).T + bias
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_row_does_not_depend_on_its_neighbours(qtype):
    """Within the several-rows kernel, a row's output is bit-identical whatever the other rows."""
    raw, _ = quantized(qtype, 96, 576)
    lin = BlockLinear(Blocks.from_gguf(qtype.name, raw), None)
    x = torch.randn(KERNEL_ROWS, 576, generator=torch.Generator().manual_seed(3))
    together = lin(x)
    for i in range(KERNEL_ROWS - 1):
        assert torch.equal(lin(x[i:i + 2])[0], together[i])


def test_rows_rearrange_and_fuse_like_the_fp32_weights():
    """map_rows / cat (the model's q/k interleave and q|k|v fusion) move blocks with their rows."""
    parts = [quantized(Q.Q4_1, n, 64, seed=n) for n in (32, 16, 16)]
    blocks = [Blocks.from_gguf("Q4_1", raw) for raw, _ in parts]
    fused = Blocks.cat([blocks[0].map_rows(lambda t: interleave(t, 4)), blocks[1], blocks[2]])
    want = torch.cat([interleave(torch.from_numpy(parts[0][1]), 4), torch.from_numpy(parts[1][1]),
                      torch.from_numpy(parts[2][1])])
    assert torch.equal(fused.dequantize(), want)
    with pytest.raises(ValueError, match="kinds"):
        Blocks.cat([blocks[0], Blocks.from_gguf("Q8_0", quantized(Q.Q8_0, 32, 64)[0])])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gguf_weights_compute_the_files_fp32_model(gguf_base, bpe, tmp_path, qtype):  # noqa: F811
    """A quantized GGUF run on its blocks (auto on the CPU) gives the logits of the same file
    dequantized to fp32, at every position of prefill and decode, to fp32 rounding."""
    _, cfg, weights, _, _ = gguf_base
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=qtype)
    blocks_model, _ = load_model(str(path))
    fp32_model, _ = load_model(str(path), "fp32")
    assert blocks_model.weight_dtype == "gguf" and fp32_model.weight_dtype == "fp32"
    assert isinstance(blocks_model.layers[0].qkv, BlockLinear) and isinstance(blocks_model.lm_head, BlockLinear)
    for ids in token_sequences(cfg.vocab_size, bpe)[1:]:
        torch.testing.assert_close(all_logits(blocks_model, ids), all_logits(fp32_model, ids), rtol=1e-4, atol=1e-4)
        decode = chunkings(len(ids))[1]  # prefill 10, a chunk of 7, then one-row steps (the kernels)
        got, _ = logits_at_chunk_ends(blocks_model, ids, decode)
        want, _ = logits_at_chunk_ends(fp32_model, ids, decode)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_weight_dtype_auto_and_gguf_choice(gguf_base):  # noqa: F811
    """auto keeps fp32 where a model has no blocks (an HF folder, a float GGUF); asking for gguf
    there is an error that says what to use instead."""
    _, cfg, weights, _, _ = gguf_base
    assert Model(cfg, weights, "auto").weight_dtype == "fp32"
    with pytest.raises(ValueError, match="has none"):
        Model(cfg, weights, "gguf")
