"""GGUF weight blocks (weight_blocks.py) and their Numba kernels (vector_matmul.py) against gguf-py and fp32 matmuls."""

from __future__ import annotations

import tempfile

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu import features
from kvgen.cpu.vector_matmul import NIBBLE_KINDS
from kvgen.cpu.weight_blocks import (
    BLOCK_TYPES,
    GROUP,
    LOW_BITS,
    PACKED,
    BlockLinear,
    WeightBlocks,
)
from kvgen.engine.generator import kernel_path, load_model
from kvgen.engine.model import Model, interleave
from tests.cpu.isa_build import run_in_build
from tests.engine.test_model_files import all_logits, bpe, chunkings, gguf_base, logits_at_chunk_ends, token_sequences  # noqa: F401  (fixtures)
from tests.tiny import write_gguf

Q = gguf.GGMLQuantizationType
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # the types whose kinds (q4, q8) have tile kernels too (test_amx_matmul.py)
# every type kept in blocks (weight_blocks.BLOCK_TYPES): q4, q8, then q5, q5m, q6h (packed), q8h, q8hm
ALL_TYPES = (*TYPES, Q.Q4_K, Q.Q5_0, Q.IQ4_NL, Q.IQ4_XS, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K)
# gguf-py writes these; the others' bytes are made at random (random_blocks)
GGUF_PY_WRITES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1)
# A random block's fp16 fields: byte offset and magnitude (the weights come out about 0.1 to 0.3)
FP16_FIELDS = {Q.Q4_0: ((0, 2e-2),), Q.Q4_1: ((0, 2e-2), (2, 0.1)), Q.Q8_0: ((0, 2e-3),),
               Q.Q4_K: ((0, 2e-4), (2, 1e-3)), Q.Q5_0: ((0, 1e-2),), Q.IQ4_NL: ((0, 2e-3),),
               Q.IQ4_XS: ((0, 5e-5),), Q.Q5_1: ((0, 5e-3), (2, 0.1)), Q.Q5_K: ((0, 1e-4), (2, 1e-3)),
               Q.Q6_K: ((208, 5e-5),), Q.Q3_K: ((108, 2e-3),), Q.Q2_K: ((80, 4e-3), (82, 4e-3))}


def width(qtype, k: int) -> int:
    """k for the types of 32-input blocks; for those of 256 (the K-quants, IQ4_XS) k rounded up to
    whole super-blocks, two at least."""
    return k if gguf.GGML_QUANT_SIZES[qtype][0] == GROUP else max(512, -(-k // 256) * 256)


def random_blocks(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid blocks for an [n, k] weight made as bytes: every code, packed scale and bit at random,
    the fp16 scales random of either sign in a sane range (FP16_FIELDS)."""
    rng = np.random.default_rng(seed)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at, scale in FP16_FIELDS[qtype]:
        v = (rng.uniform(0.25, 1, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]) * scale).astype(np.float16)
        raw[..., at:at + 2] = v[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def quantized(qtype, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [n, k/32 * block bytes], what gguf-py dequantizes them to [n, k]): gguf-py's
    quantization of a random weight where gguf-py writes the type, else random_blocks."""
    if qtype not in GGUF_PY_WRITES:
        raw = random_blocks(qtype, n, k, seed)
        return raw, gguf.quants.dequantize(raw, qtype).reshape(n, k)
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, :32] += 0.3  # blocks whose minimum is well above zero (Q4_1's m term)
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(n, k)


def test_the_table_lists_the_types_tested():
    assert set(BLOCK_TYPES) == {q.name for q in ALL_TYPES}
    for q in ALL_TYPES:
        _, size, per = BLOCK_TYPES[q.name]
        assert (per, size) == gguf.GGML_QUANT_SIZES[q]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_blocks_dequantize_as_gguf_py(qtype):
    k = width(qtype, 96)
    raw, ref = quantized(qtype, 40, k)
    b = WeightBlocks.from_gguf(qtype.name, raw)
    assert b.shape == (40, k) and b.kind == BLOCK_TYPES[qtype.name][0]
    assert torch.equal(b.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_random_blocks_dequantize_as_gguf_py(qtype):
    """Every bit of a block at random (codes, packed sub-block scales, high bits): each weight is
    the blocks' integer code times their float32 scales (plus the minimum), gguf-py's value
    exactly; the codes fit their kind (nibbles, packed nibbles and high bits, or int8)."""
    k = width(qtype, 1024)
    raw = random_blocks(qtype, 64, k, seed=7)
    b = WeightBlocks.from_gguf(qtype.name, raw)
    assert torch.equal(b.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(64, k)))
    assert b.qs.dtype == (torch.uint8 if b.kind in NIBBLE_KINDS or b.kind in PACKED else torch.int8)
    halves = b.kind in ("q8h", "q8hm", "q6h", "q3h", "q2hm")  # a scale per 16 inputs
    d, m = b.block_scales()
    assert d.dtype == torch.float32 and d.shape == ((64, k // 32, 2) if halves else (64, k // 32))
    assert (m is None) == (b.kind in ("q4i", "q3h", "q8", "q8h", "q5", "q6h"))


# Bits a weight held (codes, then scales), per type: nibbles (IQ4's indices into its table), packed 2-, 3-, 5-
# or 6-bit codes or int8 codes; an fp16 d (and m) per block of 32, or per super-block of 256 with an int8 per
# block of 32 (per 16 for Q6_K, Q3_K, Q2_K) for d (and m): the file's own scales, its 6-bit ones a byte each,
# Q2_K's 4-bit scale and minimum a byte together
HELD_BITS = {"Q4_0": 4 + 16 / 32, "Q4_1": 4 + 32 / 32, "Q4_K": 4 + 32 / 256 + 16 / 32,
             "Q8_0": 8 + 16 / 32, "Q5_0": 5 + 16 / 32, "IQ4_NL": 4 + 16 / 32, "IQ4_XS": 4 + 16 / 256 + 8 / 32,
             "Q5_1": 5 + 32 / 32, "Q5_K": 5 + 32 / 256 + 16 / 32,
             "Q6_K": 6 + 16 / 256 + 8 / 16, "Q3_K": 3 + 16 / 256 + 8 / 16, "Q2_K": 2 + 32 / 256 + 8 / 16}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_blocks_hold_the_files_scales_not_floats(qtype):
    """A BlockLinear holds its codes and its scales' bytes and nothing else, HELD_BITS a weight:
    the scales as the file holds them (fp16, int8), not a float32 per block; the codes at the file's
    bits, so every type within an eighth of a bit of its file (Q4_K 4.625 against 4.5, Q5_K 5.625
    against 5.5, Q3_K 3.5625 against 3.4375; Q4_0, Q4_1, Q5_0, Q5_1, Q6_K, Q2_K, IQ4_NL and IQ4_XS at it:
    Q2_K's 4-bit scale and minimum per 16 inputs a byte, as the file holds them)."""
    n, k = 64, width(qtype, 1024)
    blocks = WeightBlocks.from_gguf(qtype.name, random_blocks(qtype, n, k))
    assert blocks.d.dtype == torch.float16 and (blocks.m is None or blocks.m.dtype == torch.float16)
    assert all(t is None or t.dtype == torch.int8 for t in (blocks.ds, blocks.ms))
    lin = BlockLinear(blocks, None)
    held = [a for a in vars(lin).values() if isinstance(a, (np.ndarray, torch.Tensor))]
    assert [id(a) for a in held] == [id(lin.qs), id(lin.scales)] and lin.scales.dtype == np.uint8
    bits = 8 * sum(a.nbytes for a in held) / (n * k)
    assert bits == HELD_BITS[qtype.name]
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    assert bits <= 8 * size / per + 1 / 8


def int16_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply the weight codes by: each row's blocks of 32 inputs rounded to
    int16 steps of (the block's largest |x|) / 32767, half to even (written from that rule, not
    from int16_rounding.quantize)."""
    blocks = x.double().reshape(x.shape[0], -1, GROUP)
    step = blocks.abs().amax(-1, keepdim=True).float().double() / 32767
    return (torch.round(blocks / torch.where(step > 0, step, 1)) * step).reshape(x.shape)


def expected(qtype, raw: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """x W^T of the dequantized weight as the kernels define it, in float64: d * q times the
    int16-rounded activations, plus each block's m (q4, q8m) times the block's sum of x itself
    (q8h, q8hm: a d and an m per 16 inputs, m times the 16 inputs' sum of x)."""
    n, k = raw.shape[0], x.shape[1]
    b = WeightBlocks.from_gguf(qtype.name, raw)
    d, m = b.block_scales()
    xr = int16_activations(x)
    q = b.codes().double()
    per = 16 if d.dim() == 3 else GROUP  # inputs a scale
    y = xr @ (q.reshape(n, -1, per) * d.double().reshape(n, -1)[..., None]).reshape(n, k).T
    if m is None:
        return y
    return y + x.double().reshape(x.shape[0], -1, per).sum(-1) @ m.double().reshape(n, -1).T


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 32, 37])
def test_kernels_multiply_int16_activations_exactly(qtype, rows):
    """However many rows, the kernels compute x W^T with the activations rounded to int16 per
    block and nothing else lost (integer sums; the fp32 scaling, where Q4_0's m = -8 d cancels most of
    the d q term, to 3e-5); that stays within the rounding's
    bound of the fp32 matmul. 72 output rows is not a whole number of tiles (the kernel pads)."""
    k = width(qtype, 160)
    raw, ref = quantized(qtype, 72, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(72)
    got = BlockLinear(WeightBlocks.from_gguf(qtype.name, raw), bias)(x)
    assert got.shape == (rows, 72) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected(qtype, raw, x) + bias.double(), rtol=1e-5, atol=3e-5)
    bound = (x - int16_activations(x).float()).abs() @ torch.from_numpy(ref).abs().T  # sum |dx| |w|
    assert ((got - (x @ torch.from_numpy(ref).T + bias)).abs() <= bound + 1e-5).all()


# A packed kind and the int8 kind whose kernels multiply the same codes by the same scales (q5m's
# int8 twin, q8m, went with it: no type runs on int8 codes with a minimum per 32 any more)
INT8_TWIN = {"q5": "q8", "q6h": "q8h", "q3h": "q8h", "q2hm": "q8hm"}


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q6_K, Q.Q3_K, Q.Q2_K], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 37])
def test_packed_codes_give_the_int8_codes_bits(qtype, rows):
    """Q5_0's, Q6_K's, Q3_K's and Q2_K's packed 5-, 6-, 3- and 2-bit codes (planes of low and high bits,
    unpacked in registers) are the very integers int8 codes hold: the packed kernels' outputs are the int8
    kernels' bit for bit, every code of every block at random."""
    k = width(qtype, 576)
    packed = WeightBlocks.from_gguf(qtype.name, random_blocks(qtype, 72, k, seed=rows))
    codes, (high, offset) = packed.codes(), PACKED[packed.kind]
    bits = LOW_BITS.get(packed.kind, 4) + high
    assert (codes.min(), codes.max()) == (-offset, (1 << bits) - 1 - offset)  # every bit in use
    as_int8 = WeightBlocks(INT8_TWIN[packed.kind], codes.to(torch.int8), packed.d, packed.m, packed.ds, packed.ms)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(BlockLinear(packed, None)(x), BlockLinear(as_int8, None)(x))


def kernel_outputs() -> list[torch.Tensor]:
    """Every type's BlockLinear at 1, 9 and 40 rows: what the builds for each ISA must agree on."""
    out = []
    for q in ALL_TYPES:
        k = width(q, 160)
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(9))
        lin = BlockLinear(WeightBlocks.from_gguf(q.name, quantized(q, 72, k)[0]), None)
        out += [lin(x[:r]) for r in (1, 9, 40)]
    return out


# path: (the features its build turns off, the first one's absence skipping the path; what
# features.py and llvm_ir.py then select: PMADDWD, WIDE, VNNI, AMX, F16C)
PATHS = {"amx": (("+amx-int8",), (True, True, True, False, True)),
         "avx512": (("+avx512vnni",), (True, True, False, False, True)),
         "avx2": (("+avx512bw",), (True, False, False, False, True)),
         "portable": (("+avx2", "+f16c"), (False, False, False, False, False))}


# `make test` runs the host's own path (on a Zen 3 host that is AVX2's 256-bit pmaddwd); the builds for the
# other ISAs (AVX2 on the AVX-512 hosts, AVX-512 without VNNI, the portable IR: no AVX2, no F16C) run in
# `make test-slow`, for CI's time (~40 s a build on 2 cores)
@pytest.mark.heavy
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p in ("avx2", "avx512", "portable")
                                  else p for p in PATHS])
def test_every_kernel_path_gives_the_same_bits(path):
    """With AMX-INT8 a call of AMX_FROM (12) rows or more runs on tiles (amx_matmul.py), with AVX512-VNNI
    the kernels call vpdpwssd, with AVX-512 the 512-bit pmaddwd, with AVX2 the 256-bit one,
    elsewhere LLVM lowers a portable multiply-add (and, without F16C, the fp16 scales are widened
    by integer arithmetic: llvm_ir.halves_to_floats). All sum the same integers and scale them by
    the same float operations: a build for this CPU without the feature (NUMBA_CPU_FEATURES, in a
    process with a cache per ISA: isa_build.py) gives bit-identical outputs, at 1 row, at 9 (two calls of 4
    rows and one of 1) and at 40 (tiles where there are)."""
    drops, flags = PATHS[path]
    if drops[0] not in features.FEATURES.split(","):
        pytest.skip(f"this CPU has no {drops[0][1:]}: the {path} path is what runs here")
    code = (
        "import numpy as np, sys, torch; from kvgen.cpu import features, llvm_ir; "
        "from kvgen.cpu.weight_blocks import BlockLinear, WeightBlocks; "
        "from tests.cpu.test_weight_blocks import kernel_outputs; "
        f"assert (features.PMADDWD, features.WIDE, features.VNNI, features.AMX, llvm_ir.F16C) == {flags}; "
        "torch.save(kernel_outputs(), sys.argv[1])")
    isa = features.FEATURES
    for drop in drops:
        isa = isa.replace(drop, "-" + drop[1:])
    with tempfile.TemporaryDirectory() as d:
        run_in_build(code, isa, f"{d}/out.pt")
        other = torch.load(f"{d}/out.pt")
    native = kernel_outputs()
    for a, b in zip(native, other, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_a_row_does_not_depend_on_its_neighbours(qtype):
    """A row's output is bit-identical whatever the other rows and however many there are (a
    prompt's K/V and logits do not depend on how it is cut in chunks)."""
    k = width(qtype, 576)
    raw, _ = quantized(qtype, 96, k)
    lin = BlockLinear(WeightBlocks.from_gguf(qtype.name, raw), None)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3))
    together = lin(x)
    for i in range(len(x) - 1):
        assert torch.equal(lin(x[i:i + 2])[0], together[i])
    assert torch.equal(lin(x[:37]), together[:37])


def test_rows_rearrange_and_fuse_like_the_fp32_weights():
    """map_rows / cat (the model's q/k interleave and q|k|v fusion) move blocks with their rows."""
    parts = [quantized(Q.Q4_1, n, 64, seed=n) for n in (32, 16, 16)]
    blocks = [WeightBlocks.from_gguf("Q4_1", raw) for raw, _ in parts]
    fused = WeightBlocks.cat([blocks[0].map_rows(lambda t: interleave(t, 4)), blocks[1], blocks[2]])
    want = torch.cat([interleave(torch.from_numpy(parts[0][1]), 4), torch.from_numpy(parts[1][1]),
                      torch.from_numpy(parts[2][1])])
    assert torch.equal(fused.dequantize(), want)
    with pytest.raises(ValueError, match="kinds"):
        WeightBlocks.cat([blocks[0], WeightBlocks.from_gguf("Q8_0", quantized(Q.Q8_0, 32, 64)[0])])
    # packed codes and scales per 16 inputs ([N, G, 2]) move with their rows too; Q6_K's packed
    # codes are a kind of their own (q6h), Q3_K's int8 ones another (q8h): they do not fuse
    parts = [quantized(Q.Q6_K, n, 512, seed=n) for n in (32, 16)]
    halves = [WeightBlocks.from_gguf("Q6_K", raw) for raw, _ in parts]
    fused = WeightBlocks.cat([halves[0].map_rows(lambda t: interleave(t, 4)), halves[1]])
    want = torch.cat([interleave(torch.from_numpy(parts[0][1]), 4), torch.from_numpy(parts[1][1])])
    assert fused.kind == "q6h" and torch.equal(fused.dequantize(), want)
    with pytest.raises(ValueError, match="kinds"):
        WeightBlocks.cat([halves[1], WeightBlocks.from_gguf("Q3_K", quantized(Q.Q3_K, 16, 512)[0])])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gguf_weights_compute_the_files_fp32_model(gguf_base, bpe, tmp_path, qtype):  # noqa: F811
    """A quantized GGUF run on its blocks (auto on the CPU) gives the logits of the same file
    dequantized to fp32, at every position of prefill and decode. The kernels' rows carry their
    activations' int16 rounding through every layer, so the logits agree to 1e-3 of their largest."""
    _, cfg, weights, _, _ = gguf_base
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, cfg, weights, bpe, qtype=qtype)
    blocks_model, _ = load_model(str(path))
    fp32_model, _ = load_model(str(path), "fp32")
    assert blocks_model.weight_dtype == "gguf" and fp32_model.weight_dtype == "fp32"
    assert isinstance(blocks_model.layers[0].qkv, BlockLinear) and isinstance(blocks_model.lm_head, BlockLinear)
    # GetModelInfo.cpu_kernels: the blocks' code path on this CPU; none for fp32 weights
    assert kernel_path(blocks_model) == features.path() != "" and kernel_path(fp32_model) == ""
    for ids in token_sequences(cfg.vocab_size, bpe)[1:]:
        whole = all_logits(blocks_model, ids), all_logits(fp32_model, ids)
        decode = chunkings(len(ids))[1]  # prefill 10, a chunk of 7, then one-row steps (the kernels)
        chunked = logits_at_chunk_ends(blocks_model, ids, decode)[0], logits_at_chunk_ends(fp32_model, ids, decode)[0]
        for got, want in (whole, chunked):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
            assert (got.argmax(-1) == want.argmax(-1)).all()


def test_weight_dtype_auto_and_gguf_choice(gguf_base):  # noqa: F811
    """auto keeps fp32 where a model has no blocks (an fp32 HF folder or GGUF); asking for gguf
    there is an error that says what to use instead."""
    _, cfg, weights, _, _ = gguf_base
    assert Model(cfg, weights, "auto").weight_dtype == "fp32"
    with pytest.raises(ValueError, match="has neither"):
        Model(cfg, weights, "gguf")


def test_q8_blocks_from_float_are_llama_cpps_q8_0():
    """WeightBlocks.q8_from_float (the EAGLE head's matrices over gguf weights) makes gguf-py's Q8_0
    scales bit for bit (amax / 127 held in fp16) and its codes off by one at most: llama.cpp rounds
    x by the float32 scale, q8_from_float by the fp16 one it holds (where the two differ across a
    rounding boundary: 1.4% of these codes), so that every value is within half a held step of
    its block; a zero block stays zero."""
    x = np.random.default_rng(3).standard_normal((8, 128)).astype(np.float32)
    x[1, :32] = 0.0
    x[2, 5] = 40.0  # an outlier block
    ours = WeightBlocks.q8_from_float(torch.from_numpy(x))
    theirs = WeightBlocks.from_gguf("Q8_0", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0))
    assert ours.d.dtype == torch.float16 and torch.equal(ours.d, theirs.d)
    diff = (ours.qs.int() - theirs.qs.int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.97
    step = ours.d.float().repeat_interleave(32, 1)
    assert ((ours.dequantize() - torch.from_numpy(x)).abs() <= step / 2 + 1e-6).all()
    assert (ours.qs[1, 0] == 0).all() and ours.d[1, 0] == 0
