"""FusedDecode over the quantized KV formats (kv_io.py): its cache write is the format's
write byte for byte, its attention is attention over the format's read, and whole decode steps
equal Model.forward on the same format, with and without the exact tail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvgen.cpu import kv_io, paged_attention
from kvgen.engine.fused_decode import FusedDecode
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.kv_samples import calibrate_format
from kvgen.engine.model_runner import ModelRunner
from tests.engine.test_fused_decode import decode_step, prefill, q4_model  # noqa: F401  (fixture)
from tests.engine.test_model_files import bpe, gguf_base  # noqa: F401  (fixtures)

# more rows than a kernel call takes at once (vector_matmul.ROWS_AT_ONCE), and not a multiple of it
MANY = 33

L, BS, KVH, HD = 2, 16, 2, 32
VARIANTS = [("fp8", 0), ("fp8", 4), ("q4", 0), ("q4", 4)]  # (format, recent_slots)


def tensors(fmt, store) -> dict[str, torch.Tensor]:
    """Everything the format holds: the store and, with an exact tail, its rows and sink."""
    out = dict(store)
    if fmt.recent_slots:
        out["rows"], out["sink"] = fmt.rows, fmt.sink
    return out


def rows_like(gen, n):
    """Rows of very different sizes (scales grow and requantize), a zero row now and then."""
    x = torch.randn(n, KVH, HD, generator=gen) * 10.0 ** torch.randint(-2, 2, (n, KVH, 1), generator=gen)
    x[torch.rand(n, generator=gen) < 0.1] = 0
    return x


@pytest.mark.parametrize("name", ["fp8", "q4"])
def test_the_write_is_the_formats_write_byte_for_byte(name):
    """Tokens written one at a time through blocks (offset 0 of a reused block starts it over):
    kv_io.write leaves every byte of the store as the format's write does."""
    fmt = make_format(name, L, BS, KVH, HD)
    ref, got = fmt.allocate(3), fmt.allocate(3)
    for t in (ref, got):  # stale bytes in the blocks, as a reused block has
        for a in t.values():
            a.view(torch.uint8).copy_(torch.randint(0, 256, a.view(torch.uint8).shape,
                                                    generator=torch.Generator().manual_seed(1), dtype=torch.uint8))
    c = kv_io.cache_tuple(fmt, got)
    gen = torch.Generator().manual_seed(0)
    for pos in range(3 * BS + 5):
        b, off = (pos // BS) % 3, pos % BS
        k, v = rows_like(gen, 1), rows_like(gen, 1)
        for layer in range(L):
            fmt.write(ref, layer, torch.tensor([b]), torch.tensor([off]), k, v)
            kv_io.write(c, layer, pos, b, off, k.flatten().numpy(), v.flatten().numpy(), KVH)
        for key in ref:
            assert torch.equal(got[key].view(torch.uint8), ref[key].view(torch.uint8)), (pos, key)


def test_rounding_matches_torchs_casts():
    """float16 scales (subnormal, overflow to inf) and fp8 codes (-0, +-448) round as torch casts."""
    x = torch.cat([torch.randn(20000) * 10.0 ** torch.randint(-9, 6, (20000,)),
                   torch.tensor([0.0, 65519.0, 65520.0, 1e9, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14 * 0.99])])
    x = x.abs().float()
    want = x.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert [kv_io.f16_bits(v) for v in x.numpy()] == want.tolist()
    y = torch.cat([torch.randn(20000) * 10.0 ** torch.randint(-5, 3, (20000,)), torch.tensor([-0.0, 448.0, -448.0])])
    s = np.float32(1.0)
    want = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert [kv_io.fp8_code(v, s) for v in y.numpy()] == want.tolist()


@pytest.mark.parametrize("name,slots", VARIANTS)
def test_attend_is_attention_over_the_formats_read(name, slots):
    """Rows of different lengths (a block's first and last slots, the sink, exact newest blocks):
    the fused attention equals softmax(q K^T / sqrt(D)) V over what fmt.read returns."""
    heads, gen = 2 * KVH, torch.Generator().manual_seed(3)
    fmt = make_format(name, L, BS, KVH, HD, recent_slots=slots)
    store = fmt.allocate(40)
    lengths = [1, 16, 17, 40, 70, 300]  # 300: two runs of keys (paged_attention.SPLIT), merged
    tables = ([list(range(4 * i, 4 * i + 4)) + [0] * 15 for i in range(4)] + [list(range(16)[::-1][:5]) + [0] * 14]
              + [list(range(39, 20, -1))])
    for n, table in zip(lengths, tables, strict=True):
        for pos in range(n):
            blocks, offsets = torch.tensor([table[pos // BS]]), torch.tensor([pos % BS])
            for layer in range(L):
                k, v = rows_like(gen, 1), rows_like(gen, 1)
                fmt.write(store, layer, blocks, offsets, k, v, torch.tensor([pos]))
    q = torch.randn(len(lengths), (heads + 2 * KVH) * HD, generator=gen)
    width = max(len(t) for t in tables)
    tab = np.array([t + [0] * (width - len(t)) for t in tables], np.int64)
    positions = np.array(lengths, np.int64) - 1
    # the step's arguments for a quantized cache: no fp32 rows, no transposed copy
    empty, kt = np.empty((0, L, 2, BS, KVH, HD), np.float32), np.empty((0, KVH, HD, BS), np.float32)
    slot = np.zeros(1, np.int64)
    for layer in range(L):
        out = np.zeros((len(lengths), heads * HD), np.float32)
        paged_attention.attend(q.numpy(), empty, kv_io.cache_tuple(fmt, store), layer, tab, positions, heads, KVH,
                               HD, out, *paged_attention.plan(positions, KVH, heads // KVH, HD), slot, kt)
        for r, (n, table) in enumerate(zip(lengths, tables, strict=True)):
            k, v = fmt.read(store, layer, torch.tensor(table))
            k, v = (x.reshape(-1, KVH, HD)[:n].transpose(0, 1) for x in (k, v))  # [KVH, n, HD]
            qr = q[r, :heads * HD].view(heads, 1, HD)
            want = F.scaled_dot_product_attention(qr, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0))
            torch.testing.assert_close(torch.from_numpy(out[r]), want.flatten(), rtol=1e-5, atol=1e-5)


def formats(model, name, slots):
    """Two identical formats (reference, fused), fp8's key scales fitted as the Generator does."""
    cfg = model.cfg
    out = []
    for _ in range(2):
        fmt = make_format(name, cfg.num_layers, BS, cfg.num_kv_heads, cfg.head_dim, recent_slots=slots)
        calibrate_format(model, fmt, ids=list(range(3, 200)))
        out.append(fmt)
    assert (out[0].qk_scale is not None) == (name == "fp8")
    return out


# The fused step's K/V differ from the forward's in the last bits (its norms and RoPE are its own
# float32 loops), and quantizing moves that difference to a whole code or float16 scale step where
# a value sits on a rounding boundary (test_the_write_is_the_formats_write_byte_for_byte shows the
# write itself exact), as the weight kernels' int16 activations do with the layers' inputs
# (test_fused_decode.assert_near), and a code step of q4 is a fifteenth of its group's range; the two
# caches then drift apart step by step (q4 without the exact tail over 44 steps: up to 1.0e-2 of
# the largest logit measured, 3.6e-3 otherwise). Logits agree to 2e-2 of their largest, the
# cache's floats to 2e-3 of their largest and its codes in nearly every byte, what it reads back
# to 3e-3 on average (fp8 values without the tail measured 1.6e-3 on an AVX-512 CPU, whose wider
# vectors round the fused step's norms differently; 2.3e-4 at most otherwise); the write and the
# attention themselves are checked exactly above. A wrong slot or scale is off by far more.


def assert_logits_near(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def assert_same_cache(fmts, pools, caches):
    """The two caches hold the same: exact rows and scales within rounding, codes equal but for
    the odd rounding boundary, and what they read back the same on average to 3e-3."""
    a, b = (tensors(f, p.store) for f, p in zip(fmts, pools, strict=True))
    blocks = [torch.tensor(c.blocks) for c in caches]
    for key in a:
        x, y = (a[key], b[key]) if key in ("rows", "sink") else (a[key][blocks[0]], b[key][blocks[1]])
        if x.dtype in (torch.float32, torch.float16):
            torch.testing.assert_close(y.float(), x.float(), rtol=0, atol=2e-3 * x.float().abs().max().item())
        else:
            assert (x.view(torch.uint8) != y.view(torch.uint8)).float().mean() < 0.01, key
    for layer in range(fmts[0].num_layers):
        ka, va = fmts[0].read(pools[0].store, layer, blocks[0])
        kb, vb = fmts[1].read(pools[1].store, layer, blocks[1])
        assert (kb - ka).abs().mean() <= 3e-3 * ka.abs().mean()
        assert (vb - va).abs().mean() <= 3e-3 * va.abs().mean()


@pytest.mark.parametrize("name,slots", VARIANTS)
def test_every_decode_step_equals_the_forward(q4_model, name, slots):  # noqa: F811
    """Prefill 5 tokens, then 44 decode steps across block boundaries (blocks of 16, the exact
    tail flushing full blocks into the store): the fused step's logits and the cache it leaves
    equal Model.forward's on the same format."""
    m, cfg = q4_model, q4_model.cfg
    fmts = formats(m, name, slots)
    assert FusedDecode.supports(m, fmts[0])
    fused = FusedDecode(m)
    ids = torch.randint(3, cfg.vocab_size, (49,), generator=torch.Generator().manual_seed(5)).tolist()
    pools = [BlockPool(f, 8) for f in fmts]
    caches = [prefill(m, f, p, ids[:5]) for f, p in zip(fmts, pools, strict=True)]
    for pos in range(5, 49):
        for cache in caches:
            cache.reserve(1)
        want = m.forward(torch.tensor([ids[pos]]), decode_step(caches[:1]), fmts[0], pools[0].store)
        got = fused([(ids[pos], pos, caches[1].blocks)], pools[1].store, fmts[1])
        assert_logits_near(got, want)
        for c in caches:
            c.advance(1)
    if slots:
        assert fmts[1].recent.held and fmts[1].recent.held.keys() == fmts[0].recent.held.keys()
    assert_same_cache(fmts, pools, caches)


@pytest.mark.parametrize("rows", [2, 3, MANY])
@pytest.mark.parametrize("name,slots", [("fp8", MANY), ("q4", MANY), ("q4", 2)])
def test_a_step_of_several_sequences_equals_the_forward(q4_model, name, slots, rows):  # noqa: F811
    """Sequences of different lengths (14 to 14 + 3 * rows) decode one token each in one fused
    step: the batched forward's logits and cache (with fewer exact slots than rows, some rows
    go straight to the quantized store)."""
    m, cfg = q4_model, q4_model.cfg
    fmts = formats(m, name, slots)
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(3, cfg.vocab_size, (14 + 3 * i,), generator=g).tolist() for i in range(rows)]
    nxt = torch.randint(3, cfg.vocab_size, (rows,), generator=g).tolist()
    pools = [BlockPool(f, 8 * rows) for f in fmts]
    caches = [[prefill(m, f, pool, p) for p in prompts] for f, pool in zip(fmts, pools, strict=True)]
    want = m.forward(torch.tensor(nxt), decode_step(caches[0]), fmts[0], pools[0].store)
    got = FusedDecode(m)([(t, c.length, c.blocks) for t, c in zip(nxt, caches[1], strict=True)],
                         pools[1].store, fmts[1])
    assert_logits_near(got, want)
    for a, b in zip(*caches, strict=True):
        a.advance(1)
        b.advance(1)
    for a, b in zip(*caches, strict=True):
        assert_same_cache(fmts, pools, [a, b])


def test_the_runner_fuses_fp8_and_q4_but_not_q3(q4_model):  # noqa: F811
    m, cfg = q4_model, q4_model.cfg

    def runner(kv, slots=None):
        fmt = make_format(kv, cfg.num_layers, BS, cfg.num_kv_heads, cfg.head_dim, recent_slots=slots)
        calibrate_format(m, fmt, ids=list(range(3, 100)))
        return ModelRunner(m, fmt, BlockPool(fmt, 8).store)

    for kv in ("fp8", "q4"):
        assert runner(kv).fused is not None and runner(kv, 4).fused is not None
    assert runner("q3").fused is None and runner("q3", 4).fused is None and runner("bf16").fused is None
    # a format computing in bf16 (its exact rows too) is left to the forward
    fmt = make_format("q4", cfg.num_layers, BS, cfg.num_kv_heads, cfg.head_dim, compute_dtype=torch.bfloat16)
    assert not FusedDecode.supports(m, fmt)


@pytest.mark.parametrize("kv", ["fp8", "q4"])
def test_the_engine_decodes_the_same_tokens_fused(q4_model, bpe, kv):  # noqa: F811
    """Through the Generator (the runner's call, the pool freeing blocks, the exact tail as the
    Generator sizes it): greedy tokens over a quantized KV equal those of Model.forward's steps."""
    from kvgen.engine.generator import EngineOptions, Generator
    from kvgen.engine.sampling import SamplingParams
    from kvgen.engine.tokenizer import TextTokenizer
    from tests.tiny import CHATML_TEMPLATE

    tok = TextTokenizer(bpe, CHATML_TEMPLATE, bos_id=None, add_bos=False, special_ids={0, 1, 2},
                        eos_token="<|im_end|>")
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [list(range(3, 30)), list(range(40, 47))]
    out = []
    for fused in (True, False):
        g = Generator(q4_model, tok, EngineOptions(kv_dtype=kv, prefix_cache=False))
        try:
            assert g.engine.runner.fused is not None and g.engine.runner.fmt.recent_slots
            if not fused:
                g.engine.runner.fused = None
            out.append([g.generate(p, params).token_ids for p in prompts])
        finally:
            g.close()
    assert out[0] == out[1]
