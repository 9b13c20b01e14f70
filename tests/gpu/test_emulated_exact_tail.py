"""The GPU decode kernels over an ExactTail store (kvgen/engine/kv/stage.py: each sequence's
newest block and first token kept exact), the real CUDA C kernels run on the host
(tests/gpu/emulator.py) through ops.py, against the torch path: decode steps through
ExactTail.prepare_decode + ops.kv_append + ops.flash_decode give the store, exact rows, sink and
slot maps byte for byte as ExactTail.write does, and attention as paged_decode_reference reading
through ExactTail.read. tests/gpu/test_exact_tail_kernels.py runs the same cases on a GPU.

The decode case crosses block boundaries (a full block flushed into the store, its slot given to
a new block), has sequences whose first token sits in the sink (one written by the kernels at
position 0), a padding row, and more sequences than slots (their rows go to the store, and a
slot freed later stages a part-filled block's rows that are in the store already).
"""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.kv.formats import make_format
from tests.gpu.helpers import raw_bits
from tests.gpu.reference import paged_decode_reference

# Prompt lengths (rows in this order), decode steps, block size, slots. The 1st and 4th prompts
# end part-way through a block and take the two slots; the 3rd is whole blocks (quantized at
# once) and the 5th finds no slot (its rows go to the store); the 2nd is empty: it starts at
# position 0 in the decode (the kernels write its first token to the sink) and takes the slot
# the 4th frees when it crosses a block boundary (its rows already in the store staged into it).
LENS, STEPS, BS, SLOTS = (5, 0, 8, 3, 6), 7, 4, 2
TOL = {torch.float32: 3e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as test_emulated_flash_decode


def exact_state(fmt, dtype: torch.dtype) -> dict:
    """Everything an ExactTail holds besides the store, comparable with == (rows and sink as
    `dtype` bits)."""
    return {"rows": raw_bits(fmt.rows.to(dtype)).clone(), "sink": raw_bits(fmt.sink.to(dtype)).clone(),
            "recent": fmt.recent.of.cpu().tolist(), "first": fmt.first.of.cpu().tolist(),
            "held": dict(fmt.recent.held), "first_held": dict(fmt.first.held), "pending": set(fmt.pending)}


def assert_same_tail(a_fmt, a_store, b_fmt, b_store) -> None:
    for key in a_store:
        x, y = raw_bits(a_store[key]), raw_bits(b_store[key])
        assert torch.equal(x, y), f"store[{key!r}] differs at {(x != y).nonzero()[:5].tolist()}"
    a, b = exact_state(a_fmt, a_fmt.rows.dtype), exact_state(b_fmt, a_fmt.rows.dtype)
    for key in a:
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, f"{key} differs"


def decode_case(ops, name: str, gqa: int, dtype: torch.dtype, device, *, hd: int = 64, kvh: int = 2,
                layers: int = 2, seed: int = 0) -> dict:
    """Prefill LENS through ExactTail.write (two formats, the same writes), then STEPS decode
    steps: one format through prepare_decode + the kernels (`ops`), the other through
    ExactTail.write + paged_decode_reference; compares after every step and returns what
    happened (for the coverage checks).

    K, V and q are `dtype` values; the kernels' format computes in `dtype` (its exact rows
    are `dtype`), the torch side's in float32: its rows hold the same values exactly, and its
    reads do not round the dequantised store to `dtype` (Fp8Format / Q4Format.read do, the
    kernels do not), so the reference computes what the kernels compute."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-(n + STEPS) // BS) for n in LENS) + 2
    fmts = [make_format(name, layers, BS, kvh, hd, compute_dtype=cd, recent_slots=SLOTS)
            for cd in (dtype, torch.float32)]
    stores = [f.allocate(n_blocks, device) for f in fmts]
    kfmt, tfmt = fmts
    kstore, tstore = stores
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables: list[list[int]] = [[] for _ in LENS]

    def slot(i: int, pos: int) -> tuple[int, int]:
        if pos // BS == len(tables[i]):
            tables[i].append(free.pop())
        return tables[i][pos // BS], pos % BS

    def rows(n: int, heads: int) -> torch.Tensor:
        # magnitudes vary per row so fp8 scales and q4 key scales come from different rows
        return (torch.randn(n, heads, hd, generator=g) * torch.exp(torch.randn(n, 1, 1, generator=g))).to(dtype)

    for i, n in enumerate(LENS):  # prefill: each prompt its own forward pass
        if not n:
            continue
        where = [slot(i, p) for p in range(n)]
        blocks = torch.tensor([b for b, _ in where], device=device)
        offsets = torch.tensor([o for _, o in where], device=device)
        for layer in range(layers):
            k, v = rows(n, kvh).to(device), rows(n, kvh).to(device)
            for f, s in zip(fmts, stores, strict=True):
                f.write(s, layer, blocks, offsets, k, v, torch.arange(n, device=device))
    assert_same_tail(kfmt, kstore, tfmt, tstore)

    seen = {"flushed": 0, "staged": 0, "to_store": 0, "sink_at_decode": False}
    lens = list(LENS)
    width = max(len(t) for t in tables) + -(-STEPS // BS) + 1
    for _ in range(STEPS):
        where = [slot(i, p) for i, p in enumerate(lens)]
        held_before, pending_before = dict(tfmt.recent.held), set(tfmt.pending)
        # the batch as the runner stages it: every sequence, then a padding row
        table = torch.full((len(lens) + 1, width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        table = table.to(device)
        seq_lens = torch.tensor(lens + [-1], dtype=torch.int32, device=device)
        blocks, offsets = [b for b, _ in where], [o for _, o in where]
        kfmt.prepare_decode(kstore, blocks, offsets, lens)
        for layer in range(layers):
            q = (torch.randn(len(lens) + 1, kvh * gqa, hd, generator=g) * 2).to(dtype).to(device)
            k, v = rows(len(lens) + 1, kvh).to(device), rows(len(lens) + 1, kvh).to(device)
            ops.kv_append(kfmt, kstore, layer, k, v, table, seq_lens)
            got = ops.flash_decode(q, kfmt, kstore, layer, table, seq_lens, len_offset=1)
            n = len(lens)  # the torch path writes the real rows only
            tfmt.write(tstore, layer, torch.tensor(blocks, device=device), torch.tensor(offsets, device=device),
                       k[:n], v[:n], torch.tensor(lens, device=device))
            want = paged_decode_reference(q, tfmt, tstore, layer, table, seq_lens + 1)
            tol = TOL[dtype]
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
            assert not got[n].any()  # the padding row
        assert_same_tail(kfmt, kstore, tfmt, tstore)
        assert seq_lens.tolist() == lens + [-1]  # the kernels do not advance the lengths
        seen["flushed"] += len(pending_before - set(tfmt.pending))
        seen["staged"] += sum(1 for b, o in where if o > 0 and b not in held_before and b in tfmt.recent.held)
        seen["to_store"] += sum(1 for b, _ in where if b not in tfmt.recent.held)
        seen["sink_at_decode"] |= any(p == 0 and b in tfmt.first.held for (b, _), p in zip(where, lens, strict=True))
        lens = [p + 1 for p in lens]
    return seen


def check_coverage(seen: dict) -> None:
    assert seen["flushed"] >= 2 and seen["staged"] >= 1 and seen["to_store"] >= STEPS and seen["sink_at_decode"], seen


@pytest.mark.parametrize(("name", "gqa", "dtype"), [("fp8", 1, torch.float32), ("fp8", 3, torch.bfloat16),
                                                    ("q4", 1, torch.float16), ("q4", 4, torch.float32)])
def test_emulated_decode_over_exact_tail_matches_torch_path(emulated, name, gqa, dtype):
    check_coverage(decode_case(emulated, name, gqa, dtype, "cpu", hd=(64, 32)[gqa % 2], seed=gqa))


# ---- the engine's decode step: ModelRunner on the kernels against torch attention ----------------


def compare_runner_decode(model, kv: str, kernels, *, graphs=True, lens=LENS, steps=6, slots=SLOTS, atol=1e-3):
    """ModelRunner over an ExactTail format (recent_slots) on the kernel path (prepare_decode,
    kv_append, flash_decode, graphs) against the same runner forced onto torch attention
    (ExactTail.write / read), each over its own pool: same logits, step after step, with block
    boundaries crossed and more sequences than slots. Returns the kernel runner."""
    from kvgen.engine.kv.paged import PagedKVCache
    from kvgen.engine.kv.pool import BlockPool
    from kvgen.engine.model_runner import ModelRunner
    from tests.engine.test_model_runner import _prefill, _sequences

    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    width = -(-(max(lens) + steps) // BS) + 1
    sides = []
    for use_kernels in (True, False):
        fmt = make_format(kv, cfg.num_layers, BS, cfg.num_kv_heads, cfg.head_dim, recent_slots=slots)
        pool = BlockPool(fmt, len(lens) * width, model.device)
        filled = [p for p in prompts if p]
        done = iter(_prefill(model, fmt, pool, filled))  # an empty prompt starts in the decode
        caches = [next(done) if p else PagedKVCache(pool) for p in prompts]
        runner = ModelRunner(model, fmt, pool.store, cuda_graphs=graphs, width=width, kernels=kernels)
        assert runner.kernel_attention is not None
        if not use_kernels:
            runner.kernel_attention = None  # the same runner on torch attention (ExactTail.write / read)
        first = [p[-1:] or [7] for p in prompts]  # first new token: the prompt's last again
        sides.append((runner, fmt, _sequences([p + f for p, f in zip(prompts, first, strict=True)], caches)))
    for _ in range(steps):
        out = []
        for runner, _, seqs in sides:
            for s in seqs:
                s.cache.reserve(1)
            out.append(runner.run([(s, 1) for s in seqs]).clone())
        torch.testing.assert_close(out[0], out[1], atol=atol, rtol=0)
        for _, _, seqs in sides:
            for s, t in zip(seqs, out[1].argmax(-1).tolist(), strict=True):
                s.cache.advance(1)
                s.tokens.append(t)
    (kernel_runner, kfmt, _), (_, tfmt, _) = sides
    assert kfmt.recent.held == tfmt.recent.held and kfmt.pending == tfmt.pending
    assert bool(kernel_runner.graphs.captured) == graphs
    return kernel_runner


@pytest.mark.parametrize("kv", ("fp8", "q4"))
def test_emulated_runner_decode_over_exact_tail_matches_torch_attention(emulated, kv):
    from kvgen.engine.model import Model
    from tests.tiny import tiny_config, tiny_weights

    cfg = tiny_config(layers=2, hidden=128, heads=4, kv_heads=2, ffn=128, vocab=512, context=256)
    compare_runner_decode(Model(cfg, tiny_weights(cfg, seed=5)), kv, emulated)
