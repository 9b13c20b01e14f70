"""Each model family as a quantized GGUF, in every type the CPU kernels run (weight_blocks.BLOCK_TYPES).

Per family, a tiny random model that transformers writes (tests/tiny.py's family shapes, widened to
hidden 256 and intermediate 512 so that every matrix's rows are whole 256-input K-quant super-blocks),
converted by llama.cpp's convert_hf_to_gguf.py to F32, then re-encoded: every metadata key copied and
every 2-D tensor (embedding and head included) written in one quant type, by gguf-py (Q4_0 ... Q8_0)
or by the block writers of test_model_files_quants.py (the K and IQ types gguf-py cannot write).

The oracle is transformers fed the file's own weights: each 2-D tensor of the quantized file
dequantized by gguf-py (gguf.quants.dequantize) and put back in the folder's model under its HF name
(gguf-py's tensor name map; llama.cpp's q/k row interleave undone for llama-arch files), the 1-D
tensors (norms) the folder's. kvgen runs the file on its blocks (WEIGHT_DTYPE=gguf): 4 prompts
decoded greedily for 32 tokens in one batch equal transformers' tokens, and its logits at every
position of a prompt and its continuation are transformers' within the kernels' stated rounding
(activations rounded to int16 per block of 32: 1e-3 of the largest logit, as
test_model_files_quants.py's block tests state it).

Types rotate over the families, each family two types, each type at least one family (CASES), so
`make test` runs 14 of the 12 types x 7 families; `make test-slow` runs the other 70 (REST).
Where fused_decode.ARCHITECTURES claims a family, the engine's
decode steps on its quantized files take the fused step (ModelRunner.decode_path, what GetModelInfo's
decode_path reports); elsewhere they take Model.forward and say why.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from kvgen.cpu.weight_blocks import BLOCK_TYPES, BlockLinear
from kvgen.engine.fused_decode import ARCHITECTURES
from kvgen.engine.generator import Generator, load_model
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_model_files import all_logits
from tests.engine.test_model_files_quants import _write as write_blocks
from tests.engine.test_oracle import CHATS, RAW, hf_greedy
from tests.tiny import convert_to_gguf, smollm2_hf_tokenizer, write_family_folder, write_sentencepiece_model

pytestmark = pytest.mark.heavy  # llama.cpp's converter on a tiny model of each family

Q = gguf.GGMLQuantizationType
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma2"]
TYPES = [Q[name] for name in BLOCK_TYPES]  # the kernels' list: Q4_0 ... Q2_K, IQ4_NL, IQ4_XS
# family i gets types 2i and 2i + 1 (mod 12): 14 runs, every type at least once, every family two
CASES = [(f, TYPES[(2 * i + j) % len(TYPES)]) for i, f in enumerate(FAMILIES) for j in range(2)]
# Every row 256 inputs or a multiple (K-quants' super-blocks): hidden 256, 4 heads of 64 (qwen3: of
# 128, its head_dim not hidden / heads), intermediate 512. The rest is test_families.py's shapes.
# Tied embeddings: one vocabulary-sized matrix to quantize and run, not two.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=True)
HEAD_DIMS = {"qwen3": 128, "phi3": None}  # phi3 takes hidden / heads (no head_dim field)
# A sentencepiece vocabulary of 400 (tests/tiny.py's write_sentencepiece_model, which every family's
# converter reads before tokenizer.json): SmolLM2's 49152 would make the embedding (the tied head) 50
# times all the layers together, and its quantizing, dequantizing and running most of the test's time.
VOCAB = 400
PROMPTS = [*RAW[:2], *CHATS[:2]]  # raw text and chats, 4 (test_families.py runs 8 on the float files)
STEPS = 32
# The block kernels round activations to int16 per 32 (2^-16 of the block's largest) at every
# matmul: test_model_files_quants.py holds their logits to 1e-3 of the largest against the same
# file's fp32 dequantization; transformers over that dequantization adds test_families.py's 2e-4.
ROUNDING = 1e-3
# Gemma's final soft-cap (the tiny configs' 5) squeezes the logits, so the largest is the cap, not the
# scale of the values the kernels rounded: measured here 1.2e-3 (gemma2 Q4_0 / Q4_1) and 2.0e-3
# (gemma3 Q2_K) of it, with the greedy tokens equal. The bound for the soft-capped families:
SOFTCAPPED_ROUNDING = 3e-3


def shape(family: str) -> dict:
    head_dim = HEAD_DIMS.get(family, 64)
    extra = {} if head_dim is None else {"head_dim": head_dim}
    if family.startswith("gemma"):
        extra["query_pre_attn_scalar"] = head_dim
    if family == "phi3":  # Phi-3's config pads with id 32000, past this vocabulary
        extra["pad_token_id"] = 0
    return {**SHAPE, **extra}


def requantize(src, dst, qtype) -> None:
    """The converter's F32 GGUF at `src` rewritten to `dst` with every 2-D tensor in `qtype`: the
    metadata (architecture, tokenizer, template, rope) copied key by key, the 1-D tensors as they are."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer's own
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        assert t.tensor_type == Q.F32, t.name
        a = np.ascontiguousarray(t.data)
        if a.ndim == 2:
            assert a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0, (t.name, a.shape)
            data = write_blocks(a, qtype)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """tests/tiny.py's llama_cpp_permute undone: q/k rows back in the rotary halves' order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_on_file_weights(hf, path):
    """`hf` with each 2-D weight replaced by the file's tensor of that name, dequantized by gguf-py."""
    r = gguf.GGUFReader(str(path))
    arch_name = r.fields["general.architecture"].contents()
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    names = gguf.get_tensor_name_map(arch, hf.config.num_hidden_layers)
    tensors = {t.name: t for t in r.tensors}
    replaced = 0
    with torch.no_grad():
        for name, p in hf.named_parameters():  # a tied head once, as the embedding
            if p.ndim != 2:
                continue
            t = tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))]
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            if arch_name == "llama" and (".q_proj." in name or ".k_proj." in name):
                heads = hf.config.num_attention_heads if ".q_proj." in name else hf.config.num_key_value_heads
                w = unpermute(w, heads)
            assert w.shape == tuple(p.shape), name
            p.copy_(torch.from_numpy(np.ascontiguousarray(w)))
            replaced += 1
    assert replaced == sum(1 for t in r.tensors if len(t.shape) == 2)
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (folder, the converter's F32 GGUF), each made once."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = smollm2_hf_tokenizer()
    made = {}

    def get(family):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            hf_dir = folder / "hf"
            write_family_folder(hf_dir, family, tokenizer, seed=5, vocab_size=VOCAB, **shape(family))
            write_sentencepiece_model(hf_dir / "tokenizer.model", vocab=VOCAB)  # the converter takes it first
            if family == "phi3":  # Phi-3's own class, not write_family_folder's BPE marker (GPT2Tokenizer):
                # the converter's Phi3 vocabulary reads tokenizer.model unless the class is GPT2Tokenizer, and
                # it reads the class as tokenizer_config["tokenizer_class"], so the key must be there
                tc = hf_dir / "tokenizer_config.json"
                tc.write_text(json.dumps({**json.loads(tc.read_text()), "tokenizer_class": "LlamaTokenizer"}))
            made[family] = hf_dir, convert_to_gguf(hf_dir, folder / f"{family}.f32.gguf")
        return made[family]

    return get


def test_cases_cover_every_type_and_family():
    assert {t for _, t in CASES} == set(TYPES) and len(TYPES) == 12
    assert all(sum(f == g for g, _ in CASES) >= 2 for f in FAMILIES)


@pytest.mark.parametrize(("family", "qtype"), CASES, ids=[f"{f}-{t.name}" for f, t in CASES])
def test_quantized_family_equals_transformers_on_the_files_weights(converted, tmp_path, family, qtype):
    from transformers import AutoModelForCausalLM

    folder, f32 = converted(family)
    path = tmp_path / f"{family}.{qtype.name}.gguf"
    requantize(f32, path, qtype)
    hf = hf_on_file_weights(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), path)

    model, tok = load_model(str(path), "gguf")  # the file's own vocabulary and chat template
    assert model.weight_dtype == "gguf" and model.cfg.vocab_size == VOCAB
    kind = BLOCK_TYPES[qtype.name][0]
    lins = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(lin, BlockLinear) and lin.kind == kind for lin in [*lins, model.lm_head])
    prompts = [tok.encode(p) if isinstance(p, str) else tok.encode_chat(p) for p in PROMPTS]

    gen = Generator(model, tok, EngineOptions())
    try:
        runner = gen.engine.runner
        if family in ARCHITECTURES:  # the fused step claims these families (qwen2's q/k/v biases, qwen3's q/k
            # norms, phi3's fused q|k|v and gate|up)
            assert runner.decode_path == "fused", f"{family}: {runner.decode_path_reason}"
        else:  # Model.forward, and why: gemma's windows (else the step's list of architectures)
            assert runner.decode_path == "torch" and runner.decode_path_reason
            if model.torch_attention_why is None:
                assert f"architecture {family}" in runner.decode_path_reason, runner.decode_path_reason
        results = gen.batch_generate(prompts, SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
    finally:
        gen.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(hf, ids, STEPS), f"{family} {qtype.name}: {tok.decode(ids)!r}"

    ids = prompts[-1] + results[-1].token_ids  # a chat and its continuation
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    err = (all_logits(model, ids) - ref).abs().max().item()
    bound = SOFTCAPPED_ROUNDING if family.startswith("gemma") else ROUNDING
    assert err < bound * ref.abs().max().item(), f"{family} {qtype.name}: max |logit diff| {err}"


# `make test-slow`: the rest of the 12 types x 7 families, so that every family runs every type
REST = [(f, t) for f in FAMILIES for t in TYPES if (f, t) not in CASES]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "qtype"), REST, ids=[f"{f}-{t.name}" for f, t in REST])
def test_every_other_type_of_each_family_equals_transformers(converted, tmp_path, family, qtype):
    test_quantized_family_equals_transformers_on_the_files_weights(converted, tmp_path, family, qtype)


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_the_fused_step_takes_every_family_it_claims(converted, tmp_path, family):
    """What GetModelInfo.decode_path reports for a quantized file of each family in ARCHITECTURES."""
    _, f32 = converted(family)
    path = tmp_path / f"{family}.Q4_0.gguf"
    requantize(f32, path, Q.Q4_0)
    model, tok = load_model(str(path), "gguf")
    gen = Generator(model, tok, EngineOptions())
    try:
        runner = gen.engine.runner
        assert runner.decode_path == "fused", runner.decode_path_reason
    finally:
        gen.close()


# an adapter's modules per family: Phi-3's q|k|v and gate|up are one module each, as its matrices are
ADAPTER_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
SPLIT_ADAPTER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
@pytest.mark.parametrize("family", ARCHITECTURES)
def test_a_claimed_familys_fused_steps_equal_the_forward_with_an_adapter(converted, tmp_path, family, kv):
    """The step's own layer loop against Model.forward on a Q4_0 file of each family it claims (qwen2's q|k|v
    biases, qwen3's q/k head norms, phi3's one q|k|v and one gate|up matrix), over fp32 and fp8 KV (each with
    its own K/V write in the step, both normalising qwen3's heads): 3 prompts prefilled through Model.forward
    into two pools, then 12 steps of the 3 sequences decoding a token each, one fused call a step, one row on
    the base model and two with a random PEFT adapter over every linear (its deltas added inside the step),
    give Model.forward's logits (its LoraBatch the same rows) within the kernels' rounding."""
    from kvgen.engine.fused_decode import FusedDecode
    from kvgen.engine.kv.formats import make_format
    from kvgen.engine.kv.pool import BlockPool
    from kvgen.engine.kv_samples import calibrate_format
    from kvgen.engine.lora import LoraBatch, load_adapter
    from tests.engine.test_fused_decode import decode_step, prefill
    from tests.engine.test_lora import write_adapter

    folder, f32 = converted(family)
    path = tmp_path / f"{family}.Q4_0.gguf"
    requantize(f32, path, Q.Q4_0)
    model = load_model(str(path), "gguf")[0]
    cfg = model.cfg
    adapter_dir = write_adapter(folder, tmp_path / "adapter", ADAPTER_TARGETS.get(family, SPLIT_ADAPTER_TARGETS),
                                4, 8, False, seed=7)
    adapter = load_adapter("every", str(adapter_dir), model, 64)
    fmts = [make_format(kv, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    if kv == "fp8":  # keys equalised as the Generator fits them
        for f in fmts:
            calibrate_format(model, f, ids=list(range(3, VOCAB)))
    assert FusedDecode.why_not(model, fmts[1]) is None
    fused = FusedDecode(model)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (5 + 7 * i,), generator=g).tolist() for i in range(3)]
    pools = [BlockPool(f, 16) for f in fmts]
    caches = [[prefill(model, f, pool, p) for p in prompts] for f, pool in zip(fmts, pools, strict=True)]
    rows_adapters = [None, adapter, adapter]
    lora = LoraBatch.of([(a, 1) for a in rows_adapters], model.device)
    # of the largest logit: the kernels' rounding (test_fused_decode's bound); over fp8, its codes' too, where one
    # key's code rounding the other way in one path moves a logit (measured up to 8e-3 on the base rows, 2.0e-2
    # once on an adapter's, whose keys the calibration never saw); measured, qwen3's q/k norms skipped in the step
    # move them by their whole size, its k norm's weights taken as ones by 5%
    tol = 2e-3 if kv == "fp32" else 5e-2
    for _ in range(12):
        nxt = torch.randint(3, VOCAB, (3,), generator=g).tolist()
        for c in caches[0] + caches[1]:
            c.reserve(1)
        want = model.forward(torch.tensor(nxt), decode_step(caches[0]), fmts[0], pools[0].store, lora=lora)
        got = fused([(t, c.length, c.blocks) for t, c in zip(nxt, caches[1], strict=True)], pools[1].store,
                    fmts[1], adapters=rows_adapters)
        torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())
        for c in caches[0] + caches[1]:
            c.advance(1)
    for c in caches[0]:  # the adapter moves its rows' logits well past that: a next step with and without it
        c.reserve(1)
    step = decode_step(caches[0])
    base = model.forward(torch.tensor(nxt), step, fmts[0], pools[0].store)
    adapted = model.forward(torch.tensor(nxt), step, fmts[0], pools[0].store, lora=lora)  # (its K/V over base's)
    assert torch.equal(base[0], adapted[0])
    assert (base[1:] - adapted[1:]).abs().max() > 10 * tol * adapted.abs().max()
