"""key_lanes.py's kernels in paged_attention.py (decode_step's attention over fp32 KV): softmax attention, the same bits
for a row whatever its step holds (alone or among others, keys from the cache's rows or from
their transposed copy, on one thread or two), on this CPU's build and on the AVX2 and no-FMA
builds."""

from __future__ import annotations

import numpy as np
import pytest

from kvgen.cpu import features, key_lanes, kv_io, paged_attention
from tests.cpu.isa_build import run_in_build

# (query heads, KV heads, head_dim, block): groups of 3, 1 and 8 (more than key_lanes.MAX_HEADS),
# a head_dim that is not a multiple of four vectors (values' one-vector tail), blocks of 32
SHAPES = [(9, 3, 64, 16), (4, 4, 32, 32), (16, 2, 128, 16), (6, 2, 80, 16)]
# last positions: one key, a tile's edge, a block's, a run's (paged_attention.SPLIT) and three runs
POSITIONS = [0, 15, 16, 37, 255, 256, 300, 700]


def cache(shape, rows, seed=0):
    """A random pool, q and block tables (blocks shuffled) for rows attending up to `rows` positions."""
    heads, kv_heads, hd, block = shape
    rng = np.random.default_rng(seed)
    per_row = max(rows) // block + 1
    pool = len(rows) * per_row + 3
    kv = rng.standard_normal((pool, 2, 2, block, kv_heads, hd)).astype(np.float32)
    order = rng.permutation(pool)
    tables = np.stack([order[i * per_row:(i + 1) * per_row] for i in range(len(rows))]).astype(np.int64)
    q = rng.standard_normal((len(rows), (heads + 2 * kv_heads) * hd)).astype(np.float32)
    return kv, tables, np.array(rows, np.int64), q


def attend(shape, kv, tables, positions, q, transposed=False, layer=1):
    """paged_attention.attend as decode_step.step calls it (transposed: from transpose_blocks' copy)."""
    heads, kv_heads, hd, block = shape
    out = np.full((len(positions), heads * hd), np.nan, np.float32)
    slot, kt = np.zeros(kv.shape[0], np.int64), np.empty((0, kv_heads, hd, block), np.float32)
    if transposed:
        blocks, slot = paged_attention.blocks_read(tables, positions, block, kv.shape[0])
        kt = np.empty((len(blocks), kv_heads, hd, block), np.float32)
        key_lanes.transpose_blocks(kv, layer, blocks, kt)
    plan = paged_attention.plan(positions, kv_heads, heads // kv_heads, hd)
    paged_attention.attend(q, kv, kv_io.cache_tuple(None, {}), layer, tables, positions, heads, kv_heads, hd, out,
                           *plan, slot, kt)
    return out


def reference(shape, kv, tables, positions, q, layer=1):
    heads, kv_heads, hd, block = shape
    out = np.empty((len(positions), heads * hd))
    for r, pos in enumerate(positions):
        k, v = (np.concatenate([kv[b, layer, i] for b in tables[r]])[:pos + 1].astype(np.float64) for i in (0, 1))
        for h in range(heads):
            s = k[:, h // (heads // kv_heads)] @ q[r, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[r, h * hd:(h + 1) * hd] = (w / w.sum()) @ v[:, h // (heads // kv_heads)]
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_is_softmax_attention_and_a_rows_bits_do_not_depend_on_its_step(shape):
    """Every row equals float64 softmax attention, and the same bits whether the row is attended
    alone (one head a task, one thread for short rows), among all the others (a KV head's group a
    task, two threads), or from the transposed copy of the blocks (a prompt chunk's way)."""
    kv, tables, positions, q = cache(shape, POSITIONS)
    together = attend(shape, kv, tables, positions, q)
    np.testing.assert_allclose(together, reference(shape, kv, tables, positions, q), rtol=0, atol=2e-5)
    assert np.array_equal(attend(shape, kv, tables, positions, q, transposed=True), together)
    for r in range(len(positions)):
        alone = attend(shape, kv, tables[r:r + 1], positions[r:r + 1], q[r:r + 1])
        assert np.array_equal(alone[0], together[r]), positions[r]


def test_a_prompt_chunks_rows_equal_the_same_rows_decoded_one_at_a_time():
    """A prompt chunk's rows (consecutive positions over one block table, keys from the
    transposed copy) against each row as a decode step's single row (keys from the cache)."""
    shape = SHAPES[0]
    kv, tables, _, q = cache(shape, [300] * 300, seed=4)
    tables[:] = tables[0]
    positions = np.arange(300, dtype=np.int64)
    chunk = attend(shape, kv, tables, positions, q, transposed=True)
    for r in (0, 1, 17, 255, 256, 299):
        assert np.array_equal(attend(shape, kv, tables[r:r + 1], positions[r:r + 1], q[r:r + 1])[0], chunk[r])


def test_rows_at_consecutive_positions_of_other_sequences_are_not_bundled_with_a_chunk():
    """paged_attention reads a tile of keys once for up to BUNDLE consecutive rows of one sequence.
    A row at the next position of another sequence that shares the chunk's first blocks (a prefix
    cache hit) but not its last, and a chunk cut by the threads mid-bundle, still get their own
    keys: every row equals that row attended alone."""
    shape = SHAPES[0]
    block = shape[3]
    kv, tables, _, q = cache(shape, [90] * 70, seed=5)
    a, b = tables[0].copy(), tables[1].copy()
    tables[:41] = a  # sequence A: positions 0..40 (not a whole number of bundles)
    tables[41:] = b  # sequence B: positions 41..69, its first two blocks A's
    tables[41:, :2] = a[:2]
    positions = np.arange(70, dtype=np.int64)
    assert (tables[41, :41 // block + 1] != tables[0, :41 // block + 1]).any()
    for transposed in (False, True):
        together = attend(shape, kv, tables, positions, q, transposed=transposed)
        for r in range(36, 50):
            alone = attend(shape, kv, tables[r:r + 1], positions[r:r + 1], q[r:r + 1])[0]
            assert np.array_equal(alone, together[r]), (transposed, r)


def test_transpose_blocks_copies_each_blocks_keys_transposed():
    heads, kv_heads, hd, block = SHAPES[1]
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((6, 3, 2, block, kv_heads, hd)).astype(np.float32)
    blocks = np.array([4, 0, 5], np.int64)
    kt = np.empty((3, kv_heads, hd, block), np.float32)
    key_lanes.transpose_blocks(kv, 2, blocks, kt)
    assert np.array_equal(kt, kv[blocks, 2, 0].transpose(0, 2, 3, 1))


BUILDS = {"avx2": ("+avx512f", 8), "no-fma": ("+fma", None)}


@pytest.mark.heavy  # both builds in `make test-slow` (CI's time): make test runs the native one, AVX2 on an AVX2 CPU
@pytest.mark.parametrize("build", [pytest.param(b, marks=pytest.mark.slow) for b in BUILDS])
def test_other_builds_attend_alike(build):
    """The AVX2 build (8 lanes: two vectors a tile of keys, the transpose in three stages) and a
    build without FMA (a multiply and an add for each multiply-add), made for this CPU with the
    feature turned off (NUMBA_CPU_FEATURES, in a process with a cache per ISA: isa_build.py): softmax
    attention, and the same bits from the cache's rows and from the transposed copy."""
    drop, lanes = BUILDS[build]
    if drop not in features.FEATURES.split(","):
        pytest.skip(f"this CPU has no {drop[1:]}: that build is what runs here")
    code = ("import numpy as np; from kvgen.cpu import key_lanes, llvm_ir; "
            "from tests.cpu.test_paged_attention import SHAPES, POSITIONS, cache, attend, reference; "
            f"assert {lanes} in (None, key_lanes.LANES) and llvm_ir.FMA == {build != 'no-fma'}; "
            "shape = SHAPES[0]; kv, tables, positions, q = cache(shape, POSITIONS); "
            "out = attend(shape, kv, tables, positions, q); "
            "np.testing.assert_allclose(out, reference(shape, kv, tables, positions, q), rtol=0, atol=2e-5); "
            "assert np.array_equal(attend(shape, kv, tables, positions, q, transposed=True), out)")
    isa = features.FEATURES.replace(drop, "-" + drop[1:])
    if build == "avx2":  # every AVX-512 feature goes with avx512f
        isa = ",".join(f"-{f[1:]}" if f.startswith("+avx512") else f for f in isa.split(","))
    run_in_build(code, isa)
