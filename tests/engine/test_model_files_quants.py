"""GGUF's quantized weight types (F16 ... Q6_K) as the loader reads them: each within a bound of the
F32 model's weights and logits measured on a tiny random model, bounds that a wrong layout
(shuffled rows, q/k left permuted) fails; and our K-quant writers against gguf-py's readers.
The models are test_model_files.py's (written by gguf-py the way llama.cpp's converter writes them)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvgen.engine import model_files
from kvgen.engine.generator import load_model
from kvgen.engine.model import Model
from tests.engine.test_model_files import (  # noqa: F401  (fixtures)
    Q,
    all_logits,
    bpe,
    chunkings,
    gguf_base,
    logits_at_chunk_ends,
    one_thread,
    token_sequences,
)
from tests.tiny import gguf_quantize, llama_cpp_permute, write_gguf

# Measured on this model (2 layers, hidden 256, ffn 512, vocab 300; logits std 8.1, max 47) over
# every position of token_sequences() (~115 positions):
#   type   weight rel err   logits rel err   max |logit diff|   argmax agreement
#   F16    2.1e-4           1.06e-3          0.059              1.000
#   BF16   1.7e-3           8.3e-3           0.37               0.991
#   Q8_0   5.4e-3           2.7e-2           1.24               0.965
#   Q4_0   8.7e-2           0.40             14.9               0.678
#   Q4_1   7.9e-2           0.37             17.3               0.687
#   Q4_K   7.9e-2           0.37             14.1               0.678
#   Q6_K   1.9e-2           0.095            5.0                0.913
# (rel err = ||x - ref|| / ||ref||: worst 2-D tensor, and all logits; the 14 quantized matrices'
# errors add up, hence ~5x the per-tensor error.) Controls, in test_bounds_reject_wrong_layouts:
# row-shuffled matrices give logits rel err 1.40 / argmax 0.18; q/k left permuted 0.85 / 0.42.
QUANT_BOUNDS = {  # qtype: (weight rel err <, logits rel err <, argmax agreement >=)
    Q.F16: (1e-3, 3e-3, 0.99),
    Q.BF16: (5e-3, 2e-2, 0.95),
    Q.Q8_0: (1.5e-2, 6e-2, 0.9),
    Q.Q4_0: (0.15, 0.6, 0.55),
    Q.Q4_1: (0.15, 0.6, 0.55),
    Q.Q4_K: (0.15, 0.6, 0.55),
    Q.Q6_K: (0.05, 0.2, 0.8),
}


@pytest.fixture(scope="module")
def f32_logits(gguf_base, bpe):  # noqa: F811
    """Every position's logits of the F32 model, over token_sequences()."""
    _, cfg, _, f32_model, _ = gguf_base
    return torch.cat([all_logits(f32_model, ids) for ids in token_sequences(cfg.vocab_size, bpe)])


def logits_error(model, ref: torch.Tensor, bpe) -> tuple[float, float, float]:  # noqa: F811
    """(relative error, max |diff|, argmax agreement) of model's logits against ref."""
    got = torch.cat([all_logits(model, ids) for ids in token_sequences(model.cfg.vocab_size, bpe)])
    return (((got - ref).norm() / ref.norm()).item(), (got - ref).abs().max().item(),
            (got.argmax(-1) == ref.argmax(-1)).float().mean().item())


@pytest.mark.parametrize("qtype", list(QUANT_BOUNDS), ids=lambda q: q.name)
def test_gguf_quantized_types_dequantize(gguf_base, f32_logits, bpe, qtype):  # noqa: F811
    d, cfg, weights, f32_model, _ = gguf_base
    path = d / f"{qtype.name}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=qtype)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["token_embd.weight"] == qtype
    assert types["output_norm.weight"] == Q.F32
    w_bound, logit_bound, argmax_bound = QUANT_BOUNDS[qtype]
    _, got_w, _ = model_files.load(str(path))
    for name, w in weights.items():
        got = got_w[name]
        assert got.shape == w.shape and got.dtype == torch.float32, name
        rel = ((got - w).norm() / w.norm()).item()
        assert rel < (w_bound if w.ndim == 2 else 1e-7), f"{name}: relative error {rel}"
    model, _ = load_model(str(path))
    rel, worst, agree = logits_error(model, f32_logits, bpe)
    assert rel < logit_bound and agree >= argmax_bound, \
        f"{qtype.name}: logits rel err {rel:.3g}, max |diff| {worst:.3g}, argmax agreement {agree:.3f}"
    # the chunked path (prefill 10, chunk 7, decode) reads the same weights; where the weights stay
    # in blocks (Q4_0 / Q4_1 / Q8_0), those short steps round activations to int16 (test_weight_blocks.py)
    ids = token_sequences(cfg.vocab_size, bpe)[2]
    ours, ends = logits_at_chunk_ends(model, ids, chunkings(len(ids))[1])
    whole = all_logits(model, ids)[ends]
    tol = 1e-3 * whole.abs().max().item() if model.weight_dtype == "gguf" else 1e-4
    torch.testing.assert_close(ours, whole, rtol=0, atol=tol)


def test_bounds_reject_wrong_layouts(gguf_base, f32_logits, bpe):  # noqa: F811
    """The logits bounds above tell a right dequantization from a wrong one."""
    _, cfg, weights, _, _ = gguf_base
    loosest = max(b[1] for b in QUANT_BOUNDS.values()), min(b[2] for b in QUANT_BOUNDS.values())
    g = torch.Generator().manual_seed(0)
    shuffled = {k: v[torch.randperm(v.shape[0], generator=g)] if v.ndim == 2 else v
                for k, v in weights.items()}
    permuted = dict(weights)  # q/k rows left in llama.cpp's order: the unpermute forgotten
    for k, v in weights.items():
        if "q_proj" in k or "k_proj" in k:
            n_head = cfg.num_heads if "q_proj" in k else cfg.num_kv_heads
            permuted[k] = torch.from_numpy(llama_cpp_permute(v.numpy(), n_head))
    for bad in (shuffled, permuted):
        rel, _, agree = logits_error(Model(cfg, bad), f32_logits, bpe)
        assert rel > loosest[0] and agree < loosest[1], (rel, agree)


def test_k_quant_writers_agree_with_gguf_py():
    """Our Q4_K / Q6_K writers (llama.cpp's layout) and gguf-py's readers describe the same bytes."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 0.1
    x[1, :7] += 2.0  # an outlier block
    for qtype, bound in ((Q.Q4_K, 0.1), (Q.Q6_K, 0.03)):
        data = gguf_quantize(x, qtype)
        assert data.dtype == np.uint8 and data.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, qtype)
        y = gguf.quants.dequantize(data, qtype)
        assert np.linalg.norm(y - x) / np.linalg.norm(x) < bound
