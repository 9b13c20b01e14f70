"""GGUF's quantized weight types (F16 ... Q6_K) as the loader reads them: each within a bound of the
F32 model's weights and logits measured on a tiny random model, bounds that a wrong layout
(shuffled rows, q/k left permuted) fails; and our K-quant writers against gguf-py's readers.
The models are test_model_files.py's (written by gguf-py the way llama.cpp's converter writes them)."""

from __future__ import annotations

from collections import Counter

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu.weight_blocks import BLOCK_TYPES, BlockLinear
from kvgen.engine import model_files
from kvgen.engine.generator import load_model
from kvgen.engine.model import Model
from tests import tiny
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
    # auto runs F16 / BF16 matrices as Q8_0 blocks (test_float_weights.py); fp32 runs the file's own values
    model, _ = load_model(str(path), "fp32" if qtype in (Q.F16, Q.BF16) else "auto")
    rel, worst, agree = logits_error(model, f32_logits, bpe)
    assert rel < logit_bound and agree >= argmax_bound, \
        f"{qtype.name}: logits rel err {rel:.3g}, max |diff| {worst:.3g}, argmax agreement {agree:.3f}"
    # the chunked path (prefill 10, chunk 7, decode) reads the same weights; where the weights stay
    # in blocks (weight_blocks.BLOCK_TYPES), those short steps round activations to int16 (test_weight_blocks.py)
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


# Writers for the block types neither gguf-py nor tests/tiny.py quantizes: plain rounding to each
# type's layout (not llama.cpp's search for the best scales), enough for a model whose weights are
# the F32 model's to a few percent. gguf-py's dequantize is the reader.

def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [..., 2], the fp16 values as float32)."""
    h = v.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _round(x: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(x / np.where(step == 0, 1, step)), lo, hi)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit codes [..., 256] -> 64 bytes: byte 32 h + i holds input 128 h + 32 s + i at bits 2 s."""
    q = q.reshape(*q.shape[:-1], 2, 4, 32).astype(np.uint8)
    return sum(q[..., s, :] << (2 * s) for s in range(4)).reshape(*q.shape[:-3], 64)


def _iq4_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The index of the IQ4 value nearest x / step ([..., 32] each), as q4 nibble bytes [..., 16]."""
    values = gguf.quants.IQ4_NL.kvalues
    q = np.abs(x[..., None] - step[..., None, None] * np.array(values, np.float32)).argmin(-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    b = x.reshape(x.shape[0], -1, 32)
    d, df = _f16(np.abs(b).max(-1) / 127)
    return np.concatenate((d, _iq4_codes(b, df)), -1).reshape(x.shape[0], -1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    b = x.reshape(n, -1, 8, 32)
    s = np.abs(b).max(-1) / 127
    d, df = _f16(s.max(-1) / 31)
    ls = _round(s, df[..., None], -32, 31).astype(np.int32) + 32  # 6 bits: 4 low, 2 high
    high = sum(((ls[..., j] >> 4) & 3) << (2 * j) for j in range(8)).astype(np.uint16)
    low = ((ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)).astype(np.uint8)
    qs = _iq4_codes(b, df[..., None] * (ls - 32).astype(np.float32))
    return np.concatenate((d, high[..., None].view(np.uint8), low, qs.reshape(n, -1, 128)), -1).reshape(n, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    b = x.reshape(n, -1, 8, 32)
    lo = np.minimum(b.min(-1), 0)
    scale, mins = (b.max(-1) - lo) / 31, -lo
    d, df = _f16(scale.max(-1) / 63)
    dmin, dminf = _f16(mins.max(-1) / 63)
    sc = _round(scale, df[..., None], 0, 63).astype(np.uint8)
    mn = _round(mins, dminf[..., None], 0, 63).astype(np.uint8)
    q = _round(b + (dminf[..., None] * mn)[..., None], (df[..., None] * sc)[..., None], 0, 31).astype(np.uint8)
    scales = np.concatenate((sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)), -1)
    qh = sum(((q[..., k, :] >> 4) & 1) << k for k in range(8)).astype(np.uint8)
    qs = ((q[..., 0::2, :] & 15) | ((q[..., 1::2, :] & 15) << 4)).reshape(n, -1, 128)
    return np.concatenate((d, dmin, scales, qh, qs), -1).reshape(n, -1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    b = x.reshape(n, -1, 16, 16)
    s = np.abs(b).max(-1) / 4
    d, df = _f16(s.max(-1) / 31)
    sc = _round(s, df[..., None], -32, 31)
    u = (_round(b, (df[..., None] * sc)[..., None], -4, 3) + 4).astype(np.uint8).reshape(n, -1, 256)
    hmask = sum(((u.reshape(n, -1, 8, 32)[..., k, :] >> 2) & 1) << k for k in range(8)).astype(np.uint8)
    v = (sc + 32).astype(np.uint8)
    low = (v[..., :8] & 15) | ((v[..., 8:] & 15) << 4)
    high = sum(((v[..., 4 * t:4 * t + 4] >> 4) & 3) << (2 * t) for t in range(4)).astype(np.uint8)
    return np.concatenate((hmask, _crumbs(u & 3), low, high, d), -1).reshape(n, -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    b = x.reshape(n, -1, 16, 16)
    lo = np.minimum(b.min(-1), 0)
    scale, mins = (b.max(-1) - lo) / 3, -lo
    d, df = _f16(scale.max(-1) / 15)
    dmin, dminf = _f16(mins.max(-1) / 15)
    sc = _round(scale, df[..., None], 0, 15).astype(np.uint8)
    mn = _round(mins, dminf[..., None], 0, 15).astype(np.uint8)
    q = _round(b + (dminf[..., None] * mn)[..., None], (df[..., None] * sc)[..., None], 0, 3)
    return np.concatenate((sc | (mn << 4), _crumbs(q.reshape(n, -1, 256)), d, dmin), -1).reshape(n, -1)


WRITERS = {Q.IQ4_NL: quantize_iq4_nl, Q.IQ4_XS: quantize_iq4_xs, Q.Q5_K: quantize_q5_k, Q.Q3_K: quantize_q3_k,
           Q.Q2_K: quantize_q2_k}
# The types kept in blocks beyond Q4_0 / Q4_1 / Q8_0 (test_weight_blocks.py runs those), and the
# largest relative error of a weight our writers (or gguf-py's, tests/tiny.py's) leave.
BLOCK_MODEL_TYPES = {Q.Q4_K: 0.15, Q.Q5_0: 0.08, Q.Q5_1: 0.08, Q.Q5_K: 0.08, Q.Q6_K: 0.05, Q.Q3_K: 0.3,
                     Q.Q2_K: 0.6, Q.IQ4_NL: 0.15, Q.IQ4_XS: 0.15}


def _write(array, qtype):
    return WRITERS[qtype](array) if qtype in WRITERS else gguf_quantize(array, qtype)


@pytest.mark.parametrize("qtype", BLOCK_MODEL_TYPES, ids=lambda q: q.name)
def test_block_types_run_on_their_kernels(gguf_base, bpe, tmp_path, monkeypatch, qtype):  # noqa: F811
    """A GGUF whose 2-D weights are all of one type loads with WEIGHT_DTYPE=gguf on that type's
    blocks (every matrix a BlockLinear of the table's kind, no fp32 copy multiplied) and gives the
    logits of the same file dequantized to fp32 (gguf-py's values), at every position of prefill
    and decode, to 1e-3 of their largest (the activations' int16 rounding through every layer)."""
    _, cfg, weights, _, _ = gguf_base
    monkeypatch.setattr(tiny, "gguf_quantize", _write)
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=qtype)
    _, got_w, src = model_files.load(str(path))
    assert sorted(src["blocks"]) == sorted(name for name, w in weights.items() if w.ndim == 2)
    for name, w in weights.items():  # the file holds the model's weights (the writers are sane)
        assert ((got_w[name] - w).norm() / w.norm()).item() < (BLOCK_MODEL_TYPES[qtype] if w.ndim == 2 else 1e-7)
    blocks_model, _ = load_model(str(path), "gguf")
    fp32_model, _ = load_model(str(path), "fp32")
    kind = BLOCK_TYPES[qtype.name][0]
    lins = [lin for layer in blocks_model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(lin, BlockLinear) and lin.kind == kind for lin in [*lins, blocks_model.lm_head])
    for ids in token_sequences(cfg.vocab_size, bpe)[1:]:
        whole = all_logits(blocks_model, ids), all_logits(fp32_model, ids)
        decode = chunkings(len(ids))[1]  # prefill 10, a chunk of 7, then one-row steps
        chunked = logits_at_chunk_ends(blocks_model, ids, decode)[0], logits_at_chunk_ends(fp32_model, ids, decode)[0]
        for got, want in (whole, chunked):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("head", [Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_head_of_another_kind_runs_in_the_fused_step(gguf_base, bpe, tmp_path, monkeypatch,  # noqa: F811
                                                       head):
    """Real files often ship output.weight as Q6_K over Q4 layers. The fused decode step takes a
    head of any kind (on its own kind's kernel), and greedy decoding gives the fp32 model's tokens."""
    from kvgen.engine.fused_decode import FusedDecode
    from kvgen.engine.generator import EngineOptions, Generator
    from kvgen.engine.kv.formats import make_format
    from kvgen.engine.sampling import SamplingParams

    _, cfg, weights, _, _ = gguf_base
    monkeypatch.setattr(tiny, "gguf_quantize", _write)
    path = tmp_path / f"q4_0-{head.name}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=Q.Q4_0,
               types={"lm_head.weight": head, "model.embed_tokens.weight": head})  # (tied, or not)
    model, tok = load_model(str(path), "gguf")
    assert model.layers[0].qkv.kind == "q4" and model.lm_head.kind == BLOCK_TYPES[head.name][0]
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    assert FusedDecode.supports(model, fmt)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    outputs = []
    for m in (model, load_model(str(path), "fp32")[0]):
        gen = Generator(m, tok, EngineOptions())
        try:
            outputs.append(gen.generate(token_sequences(cfg.vocab_size, bpe)[1], params).token_ids)
        finally:
            gen.close()
    assert outputs[0] == outputs[1]


def test_a_q4_k_m_mixture_runs_every_matrix_on_its_own_blocks(gguf_base, bpe, tmp_path, monkeypatch):  # noqa: F811
    """llama-quantize's Q4_K_M keeps attn_v and ffn_down in Q6_K in some layers, the rest Q4_K.
    Where q|k|v mix kinds the fused weight runs as parts on their own blocks (no fp32 copy of any
    matrix), and the logits are the fp32 model's of the same file at every position."""
    from kvgen.engine.generator import type_kernels
    from kvgen.engine.model import PartsLinear

    _, cfg, weights, _, _ = gguf_base
    monkeypatch.setattr(tiny, "gguf_quantize", _write)
    mixed = {f"model.layers.0.{n}.weight": Q.Q6_K for n in ("self_attn.v_proj", "mlp.down_proj")}
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=Q.Q4_K, types=mixed)
    dequantized = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize",
                        lambda data, qtype: dequantized.append(data.shape) or real(data, qtype))
    blocks_model, _ = load_model(str(path), "gguf")
    assert all(len(shape) == 1 or shape[0] == cfg.vocab_size for shape in dequantized), dequantized  # norms, embed
    first, second = blocks_model.layers[0], blocks_model.layers[1]
    assert isinstance(first.qkv, PartsLinear) and [p.kind for p in first.qkv.parts] == ["q4", "q4", "q6h"]
    assert first.down.kind == "q6h" and isinstance(second.qkv, BlockLinear) and second.qkv.kind == "q4"
    # GetModelInfo's mixture and kernels: the file's types as gguf-py reads them, each's kernel kind
    mixture = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    assert blocks_model.cfg.tensor_types == mixture and mixture["Q6_K"] == 2
    assert type_kernels(blocks_model) == {"Q4_K": "q4", "Q6_K": "q6h", "F32": "fp32"}
    fp32_model, _ = load_model(str(path), "fp32")
    for ids in token_sequences(cfg.vocab_size, bpe)[1:]:
        got, want = all_logits(blocks_model, ids), all_logits(fp32_model, ids)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
