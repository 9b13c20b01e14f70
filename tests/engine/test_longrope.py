"""Phi-3's LongRoPE (Phi-3.5-mini, Phi-3-mini-128k): per-frequency divisors, short ones below the original
context and long ones from it on, every rotation scaled by an attention factor (model.rope_tables).

The oracle is transformers on the same folder, for sequences within the original context (48 here): the
prompts and their 32 greedy tokens stay within it. Past it transformers recomputes every cached key with the
long divisors once a sequence crosses (Phi3ForCausalLM.prepare_inputs_for_generation drops its cache), where
kvgen keeps the keys it cached below with their short rotations and rotates each position from the original
context on with the long ones; so there the checks are kvgen's own: both files, and the fused step against
Model.forward, over sequences that cross it.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvgen.engine import model_files
from kvgen.engine.generator import Generator, load_model
from kvgen.engine.model_config import UnsupportedModel
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_families import LOGIT_TOL
from tests.engine.test_families_quantized import ROUNDING, hf_on_file_weights, requantize
from tests.engine.test_model_files import all_logits
from tests.engine.test_oracle import RAW, hf_greedy
from tests.tiny import convert_to_gguf, smollm2_hf_tokenizer, write_family_folder

pytestmark = pytest.mark.heavy  # llama.cpp's converter

ORIGINAL = 48  # the original context: the prompts and their STEPS tokens stay within it, LONG_STEPS cross it
MAX_POSITIONS = 512  # the extended one: factor 512 / 48, attention factor sqrt(1 + ln(factor) / ln(48))
HALF = 8  # head_dim 16 / 2: a divisor per rotated pair
STEPS = 32
LONG_STEPS = 64
PROMPTS = [RAW[0], RAW[2], RAW[4], "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def phi35(tmp_path_factory):
    """(HF folder, transformers model, the converter's F32 GGUF, the prompts' ids) of a LongRoPE phi3."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = smollm2_hf_tokenizer()
    g = torch.Generator().manual_seed(11)
    # Phi-3.5-mini's long divisors run from 1 to ~80 and its short ones from 1 to ~3; these differ enough that
    # taking the wrong set at any position moves the tokens
    long = (1 + 30 * torch.rand(HALF, generator=g)).tolist()
    short = (1 + 2 * torch.rand(HALF, generator=g)).tolist()
    work = tmp_path_factory.mktemp("phi35")
    hf = write_family_folder(work / "hf", "phi3", tok, seed=3, max_position_embeddings=MAX_POSITIONS,
                             original_max_position_embeddings=ORIGINAL,  # Phi3Config's own field wins
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": long,
                                              "short_factor": short, "original_max_position_embeddings": ORIGINAL})
    gguf = convert_to_gguf(work / "hf", work / "phi35.gguf")
    _, ktok = load_model(str(work / "hf"), "fp32")
    ids = [ktok.encode(p) for p in PROMPTS]
    assert all(len(i) + STEPS <= ORIGINAL < len(i) + LONG_STEPS for i in ids), [len(i) for i in ids]
    return work / "hf", hf, gguf, ids


def hf_decoding_logits(hf, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after ids and the logits it decoded each from [STEPS, vocab]."""
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0, top_k=None,
                      top_p=None, temperature=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)


def test_both_files_read_the_scaling(phi35):
    folder, _, gguf, _ = phi35
    attention = math.sqrt(1 + math.log(MAX_POSITIONS / ORIGINAL) / math.log(ORIGINAL))
    for path in (folder, gguf):
        cfg, _, _ = model_files.load(str(path))
        s = cfg.rope_scaling
        assert s["rope_type"] == "longrope" and s["original_max_position_embeddings"] == ORIGINAL, path
        assert cfg.context_length == MAX_POSITIONS
        model, _ = load_model(str(path), "fp32")
        assert model.rot.abs().sub(attention).abs().max() < 1e-5  # every rotation scaled by the factor
        assert model.shift_keys is None  # no re-rotation across the two sets: a context shift recomputes


def test_greedy_tokens_and_logits_equal_transformers_within_the_original_context(phi35):
    folder, hf, _, ids = phi35
    model, tok = load_model(str(folder), "fp32")
    gen = Generator(model, tok, EngineOptions())
    try:
        results = gen.batch_generate(ids, SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
    finally:
        gen.close()
    for prompt, r in zip(ids, results, strict=True):
        tokens, ref = hf_decoding_logits(hf, prompt)
        assert r.token_ids == tokens == hf_greedy(hf, prompt, STEPS), tok.decode(prompt)
        ours = all_logits(model, prompt + tokens)[len(prompt) - 1:-1]
        err = (ours - ref).abs().max().item()
        assert err < LOGIT_TOL, f"max |logit diff| {err}"


def test_the_converters_gguf_runs_the_folders_model(phi35):
    folder, hf, gguf, ids = phi35
    ours, _ = load_model(str(folder), "fp32")
    theirs, _ = load_model(str(gguf), "fp32")
    seq = ids[0] + hf_greedy(hf, ids[0], LONG_STEPS)  # across the original context
    err = (all_logits(theirs, seq) - all_logits(ours, seq)).abs().max().item()
    assert err < LOGIT_TOL, f"GGUF against the folder: max |logit diff| {err}"


def test_a_quantized_file_takes_the_fused_step_and_its_rotations(phi35, tmp_path):
    """Within the original context the fused decode step's tokens and logits are transformers' on the file's
    weights; across it its greedy tokens are Model.forward's (the same rotations, their scale included)."""
    from transformers import AutoModelForCausalLM

    folder, _, gguf, ids = phi35
    path = tmp_path / "phi35.Q8_0.gguf"
    import gguf as gg

    requantize(gguf, path, gg.GGMLQuantizationType.Q8_0)
    hf = hf_on_file_weights(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), path)
    model, tok = load_model(str(path), "gguf")
    gen = Generator(model, tok, EngineOptions())
    try:
        assert gen.engine.runner.decode_path == "fused", gen.engine.runner.decode_path_reason
        results = gen.batch_generate(ids, SamplingParams(temperature=0, max_new_tokens=LONG_STEPS, ignore_eos=True))
    finally:
        gen.close()
    for prompt, r in zip(ids, results, strict=True):
        tokens, ref = hf_decoding_logits(hf, prompt)
        assert r.token_ids[:STEPS] == tokens, tok.decode(prompt)
        ours = all_logits(model, prompt + tokens)[len(prompt) - 1:-1]
        assert (ours - ref).abs().max().item() < ROUNDING * ref.abs().max().item()
        forward = all_logits(model, prompt + r.token_ids)[len(prompt) - 1:-1]  # Model.forward, one pass
        assert forward.argmax(-1).tolist() == r.token_ids, tok.decode(prompt)


def test_a_partial_rotary_phi3_is_refused_by_name(tmp_path):
    """Phi-4-mini rotates 3/4 of each head: kvgen does not, and says so at load."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    write_family_folder(tmp_path, "phi3", smollm2_hf_tokenizer(), rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    with pytest.raises(UnsupportedModel, match="partial rotary factor 0.75"):
        model_files.load(str(tmp_path))
