"""The CUDA decode step's logic on the CPU: bucket choice, staging / padding of step inputs, and
ModelRunner's kernel decode step (Model.forward with KernelAttention, through the graph runner)
run with torch reference kernels, and with the real CUDA C kernels emulated on the host, against
Model.forward with torch attention. tests/test_cuda_engine.py runs it on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvgen.engine.attention import Step
from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.model_runner import ModelRunner, fill_rows, pick_kernel_attention
from kvgen.engine.sampling import SamplingParams
from kvgen.gpu.graphs import GraphRunner, buckets_for
from tests.gpu import emulator
from tests.gpu.reference import kv_append_reference, paged_decode_reference
from tests.tiny import tiny_config, tiny_weights

# fixtures: kvgen.gpu.ops with its CUDA C kernels compiled for and run on the host
emu_lib, emulated = emulator.emu_lib, emulator.emulated


class RefKernels:
    """kvgen.gpu.ops' decode entry points as torch references (CPU tensors)."""

    kv_append = staticmethod(kv_append_reference)

    @staticmethod
    def flash_decode(q, fmt, store, layer, block_tables, context_lens, num_splits=None, *, len_offset=0, **_):
        return paged_decode_reference(q, fmt, store, layer, block_tables, context_lens + len_offset).to(q.dtype)

    @staticmethod
    def increment(seq_lens, valid=None, n=1):
        seq_lens.add_(torch.where(seq_lens >= 0, n, 0).to(seq_lens.dtype))


def test_buckets():
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_for(5) == (1, 2, 4, 8)
    assert buckets_for(1) == (1,)
    assert buckets_for(100) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert buckets_for(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # MAX_RUNNING 256: every load replays a graph
    assert buckets_for(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # beyond: eager, unpadded
    runner = GraphRunner(lambda inputs: inputs, buckets=buckets_for(64))
    assert [runner.bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 64, None]


def test_fill_rows_pads_and_rewrites_stale_rows():
    buf = np.full((8, 2 + 5), 77, dtype=np.int32)
    fill_rows(buf, [(11, 3, [4]), (12, 17, [0, 2, 9]), (13, 0, [6])], 4)
    assert buf[:4].tolist() == [[11, 3, 4, -1, -1, -1, -1],
                                [12, 17, 0, 2, 9, -1, -1],
                                [13, 0, 6, -1, -1, -1, -1],
                                [0, -1, -1, -1, -1, -1, -1]]  # padding: token 0, seq_len -1, no blocks
    assert (buf[4:] == 77).all()  # past the bucket: untouched
    fill_rows(buf, [(5, 40, [1, 2, 3, 4, 5])], 2)  # a later, smaller step: the old rows go
    assert buf[:2].tolist() == [[5, 40, 1, 2, 3, 4, 5], [0, -1, -1, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="6 blocks"):
        fill_rows(buf, [(5, 40, [1] * 6)], 1)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(layers=2, hidden=128, heads=4, kv_heads=2, ffn=128, vocab=512, context=256)
    return Model(cfg, tiny_weights(cfg, seed=5))


def _prefill(model, fmt, pool, prompts):
    """Each prompt through Model.forward into its own cache; returns the caches."""
    dev = model.device
    caches = []
    for ids in prompts:
        cache = PagedKVCache(pool)
        n = len(ids)
        cache.reserve(n)
        blocks, offsets = cache.slots(0, n)
        step = Step(positions=torch.arange(n, device=dev), write_blocks=blocks.to(dev),
                    write_offsets=offsets.to(dev), query_lens=[n], context_lens=[n],
                    block_tables=torch.tensor([cache.blocks], device=dev),
                    logits_rows=torch.tensor([n - 1], device=dev), is_decode=n == 1)
        model.forward(torch.tensor(ids, device=dev), step, fmt, pool.store)
        cache.advance(n)
        caches.append(cache)
    return caches


def _forward_decode(model, fmt, store, caches, tokens):
    """One decode step through Model.forward (on the model's device)."""
    dev = model.device
    slots = [c.slots(c.length, 1) for c in caches]
    width = max(len(c.blocks) for c in caches)
    step = Step(positions=torch.tensor([c.length for c in caches], device=dev),
                write_blocks=torch.cat([s[0] for s in slots]).to(dev),
                write_offsets=torch.cat([s[1] for s in slots]).to(dev), query_lens=[1] * len(caches),
                context_lens=[c.length + 1 for c in caches],
                block_tables=torch.tensor([c.blocks + [0] * (width - len(c.blocks)) for c in caches], device=dev),
                logits_rows=torch.arange(len(caches), device=dev), is_decode=True)
    return model.forward(torch.tensor(tokens, device=dev), step, fmt, store)


def _sequences(token_lists, caches):
    """Stand-ins for the engine's sequences, with what ModelRunner reads: tokens and cache."""
    return [SimpleNamespace(tokens=list(t), cache=c, prompt_logprobs=None, draft=[])
            for t, c in zip(token_lists, caches, strict=True)]


def _compare_decode(model, kv, kernels, graphs, lens=(5, 16, 17, 1, 30), steps=3, atol=1e-4):
    """Decode steps through ModelRunner's kernel path (with the given kernels, on the model's
    device) and through Model.forward with torch attention over two copies of the same cache:
    same logits; the runner's device-side lengths advance by one per step. Returns both stores.
    (tests/test_cuda_engine.py runs this on a GPU with the real kernels.)"""
    cfg = model.cfg
    fmt = make_format(kv, cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 64, model.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    caches = _prefill(model, fmt, pool, prompts)
    store_ref = {k: v.clone() for k, v in pool.store.items()}
    runner = ModelRunner(model, fmt, pool.store, cuda_graphs=graphs, width=-(-cfg.context_length // 8),
                         kernels=kernels)
    assert runner.kernel_attention is not None
    seqs = _sequences([p + p[-1:] for p in prompts], caches)  # first new token: the prompt's last again
    for _ in range(steps):
        for c in caches:
            c.reserve(1)
        got = runner.run([(s, 1) for s in seqs])
        tokens = [s.tokens[s.cache.length] for s in seqs]
        want = _forward_decode(model, fmt, store_ref, caches, tokens).cpu()  # on its own copy of the cache
        assert got.shape == want.shape == (len(lens), cfg.vocab_size) and got.device.type == "cpu"
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert runner.seq_lens.tolist() == [c.length + 1 for c in caches]
        for s, t in zip(seqs, want.argmax(-1).tolist(), strict=True):
            s.cache.advance(1)
            s.tokens.append(t)
    bucket = 1 << (len(lens) - 1).bit_length()  # the rows ran padded to the next power of two
    assert runner.graphs.captured == ((bucket,) if graphs else ())
    return pool.store, store_ref


@pytest.mark.parametrize("graphs", (True, False))
def test_decode_step_with_reference_kernels_matches_forward(tiny, graphs):
    store, ref = _compare_decode(tiny, "fp32", RefKernels, graphs)
    torch.testing.assert_close(store["kv"], ref["kv"], atol=1e-5, rtol=0)


def test_graphs_on_and_off_give_identical_logits(tiny):
    cfg = tiny.cfg
    out = []
    for graphs in (True, False):
        fmt = make_format("fp32", cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim)
        pool = BlockPool(fmt, 32)
        prompts = [[5, 6, 7], [8] * 9, [9, 10]]
        caches = _prefill(tiny, fmt, pool, prompts)
        runner = ModelRunner(tiny, fmt, pool.store, cuda_graphs=graphs, width=32, kernels=RefKernels)
        for c in caches:
            c.reserve(1)
        out.append(runner.run([(s, 1) for s in _sequences([p + [3] for p in prompts], caches)]).clone())
        assert runner.graphs.captured == ((4,) if graphs else ())  # 3 rows ran as a bucket of 4
    assert torch.equal(out[0], out[1])


def test_kernel_attention_is_picked_only_where_the_kernels_serve(tiny):
    """The one question to kvgen.gpu: CPU steps, windows, chunks and formats without kernels
    keep torch attention (and no graphs); an exact tail (recent_slots) runs on the kernels of
    its format (tests/gpu/test_emulated_exact_tail.py)."""
    cfg = tiny.cfg
    cpu = torch.device("cpu")

    def fmt(kv, **opts):
        return make_format(kv, cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim, **opts)

    assert pick_kernel_attention(cpu, fmt("fp32"), cfg.head_dim) is None  # no CUDA
    assert pick_kernel_attention(cpu, fmt("fp32"), cfg.head_dim, kernels=RefKernels) is not None
    assert pick_kernel_attention(cpu, fmt("fp32"), cfg.head_dim, window=8, kernels=RefKernels) is None
    assert pick_kernel_attention(cpu, fmt("fp32"), cfg.head_dim, chunk=8, kernels=RefKernels) is None
    assert pick_kernel_attention(cpu, fmt("q3"), cfg.head_dim, kernels=RefKernels) is None
    assert pick_kernel_attention(cpu, fmt("q4", recent_slots=2), cfg.head_dim, kernels=RefKernels) is not None
    assert pick_kernel_attention(cpu, fmt("q3", recent_slots=2), cfg.head_dim, kernels=RefKernels) is None
    assert pick_kernel_attention(cpu, fmt("fp32"), 512, kernels=RefKernels) is None  # head_dim past the kernels'
    runner = ModelRunner(tiny, fmt("fp32"), {})
    assert runner.kernel_attention is None and runner.graphs is None


@pytest.mark.parametrize("kv", ("fp32", "bf16", "fp8", "q4"))
def test_decode_step_with_emulated_kernels_matches_forward(tiny, emulated, kv):
    """kvgen.gpu.ops' own launch code and the CUDA C kernels (host-emulated) inside the step."""
    tol = 1e-4 if kv == "fp32" else 1e-3  # same K/V math on both sides: only summation order differs
    _compare_decode(tiny, kv, emulated, graphs=True, lens=(5, 17, 1), steps=2, atol=tol)


def test_engine_decode_path_matches_forward(tiny, embedded):
    """The engine's decode branch (rows built from the sequences, logits back to sampling)
    against the plain Model.forward engine: same greedy tokens, with batches that shrink
    across bucket boundaries."""
    _, tok = embedded
    results = []
    for use_decoder in (False, True):
        gen = Generator(tiny, tok, EngineOptions(kv_cache_mb=4, block_size=8))
        try:
            if use_decoder:
                gen.engine.runner = ModelRunner(tiny, gen.pool.fmt, gen.pool.store, width=32, kernels=RefKernels)
            prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]
            params = [SamplingParams(temperature=0, max_new_tokens=4 + 3 * i, ignore_eos=True) for i in range(5)]
            results.append([r.token_ids for r in gen.batch_generate(prompts, params)])
            if use_decoder:
                assert set(gen.engine.runner.graphs.captured) >= {8, 4}  # 5 rows, then fewer
        finally:
            gen.close()
    assert results[0] == results[1]


def test_model_to_device_keeps_tied_weights_shared():
    """Model.to moves every tensor (the meta device stands in for CUDA here) and keeps fp32
    tied embeddings one tensor; int8 / int4 weights are refused off the CPU."""
    cfg = tiny_config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=64, vocab=256)
    w = tiny_weights(cfg)
    m = Model(cfg, w, device="meta")
    assert m.device == torch.device("meta") and m.embed.table is m.lm_head.w and m.lm_head.wt.device.type == "meta"
    tensors = [m.embed.table, m.norm.w, m.rot, m.lm_head.w]
    for layer in m.layers:
        tensors += [layer.ln1.w, layer.ln2.w] + [lin.w for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        assert all(lin.wt._base is lin.w for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert all(t.device.type == "meta" for t in tensors)
    assert Model(cfg, w).device == torch.device("cpu")
    for dtype in ("int8", "int4"):
        with pytest.raises(ValueError, match="CPU only"):
            Model(cfg, w, dtype, device="meta")
