"""Each model family kvgen runs besides the embedded Llama: a tiny random model that transformers writes
(config -> save_pretrained), and the GGUF llama.cpp's own convert_hf_to_gguf.py makes of it.

The oracle is transformers on the same folder, fp32. Per family: 8 prompts (raw text and chats) decoded
greedily for 32 tokens in one engine batch equal transformers' tokens; our logits at every position of a
prompt and its continuation agree with transformers' within LOGIT_TOL; the converter's GGUF runs the
same logits as the folder, and its chat template and stop tokens are the folder's.

llama carries Llama 3.x's rope scaling (rope_type llama3 in the folder, the converter's rope_freqs
tensor in the GGUF), with an original context (64) short enough that most frequencies are rescaled;
qwen3 its q/k RMS norms and a head_dim that is not hidden / heads; phi3 its fused qkv_proj and
gate_up_proj (one attn_qkv and one ffn_up in the GGUF); gemma3 (text) five layers with a window of 8 and
their own RoPE base, then a global one, (1 + w) norms before and after each block, q/k norms, scaled
embeddings, GELU-tanh and a final logit cap.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvgen.engine import model_files
from kvgen.engine.generator import Generator, load_model
from kvgen.engine.model_config import UnsupportedModel
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_model_files import all_logits
from tests.engine.test_oracle import CHATS, RAW, hf_greedy
from tests.tiny import convert_to_gguf, smollm2_hf_tokenizer, write_family_folder

FAMILIES = ["llama", "qwen3", "phi3", "gemma3"]
PROMPTS = [*RAW, "Once upon a time, in a small village by the sea,", *CHATS]  # 8
STEPS = 32
# Both sides run fp32 over the same fp32 weights and differ only in the order of operations (RoPE as one
# complex multiply on interleaved rows, RMSNorm as a layer norm, torch's SDPA against transformers'
# attention): measured within 1.7e-6 of transformers at logits up to 3.4 for llama, qwen3 and phi3 (2
# layers, 59 positions), 3.5e-5 for gemma3 (6 layers, embeddings scaled by 8, (1 + w) norms, logits under
# a cap of 5), and the converter's F32 GGUF exactly equal to the folder. 2e-4 leaves room for other CPUs'
# kernels; each error this file is there to catch moves the logits by 0.28 (llama3 scaling ignored) to 1.0
# (phi3's fused q rows not interleaved), 0.74 for qwen3's k norm skipped.
LOGIT_TOL = 2e-4


@pytest.fixture(scope="module")
def hf_tokenizer():
    return smollm2_hf_tokenizer()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, hf_tokenizer, tmp_path_factory):
    """(name, folder, transformers model, GGUF path) of one family's tiny model."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp(request.param)
    hf = write_family_folder(folder / "hf", request.param, hf_tokenizer, seed=3)
    gguf = convert_to_gguf(folder / "hf", folder / f"{request.param}.gguf")
    return request.param, folder / "hf", hf, gguf


def continuation(hf, ids: list[int]) -> list[int]:
    return ids + hf_greedy(hf, ids, STEPS)


def test_greedy_tokens_equal_transformers_in_one_batch(family):
    name, folder, hf, _ = family
    gen = Generator(*load_model(str(folder), "fp32"), EngineOptions())
    try:
        assert gen.model.cfg.architecture == name
        prompts = [gen.tokenize(p) for p in PROMPTS]
        results = gen.batch_generate(prompts, SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
    finally:
        gen.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(hf, ids, STEPS), gen.tokenizer.decode(ids)


def test_logits_close_to_transformers(family):
    name, folder, hf, _ = family
    model, tok = load_model(str(folder), "fp32")
    for prompt in (RAW[0], CHATS[1]):
        ids = continuation(hf, tok.encode(prompt) if isinstance(prompt, str) else tok.encode_chat(prompt))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        err = (all_logits(model, ids) - ref).abs().max().item()
        assert err < LOGIT_TOL, f"{name}: max |logit diff| {err}"


def test_the_converters_gguf_runs_the_folders_model(family):
    name, folder, hf, gguf = family
    ours, tok = load_model(str(folder), "fp32")
    theirs, gtok = load_model(str(gguf), "fp32")
    assert theirs.cfg.architecture == name
    ids = continuation(hf, tok.encode_chat(CHATS[0]))
    err = (all_logits(theirs, ids) - all_logits(ours, ids)).abs().max().item()
    assert err < LOGIT_TOL, f"{name}: GGUF against the folder: max |logit diff| {err}"
    # the file's own chat template and stop tokens, the same in both
    assert gtok.encode_chat(CHATS[1]) == tok.encode_chat(CHATS[1])
    assert theirs.cfg.eos_token_ids == ours.cfg.eos_token_ids == [2]


def test_llama3_rope_scaling_is_read_from_both_files(family):
    name, folder, _, gguf = family
    if name != "llama":
        pytest.skip("llama's scaling")
    cfg, _, _ = model_files.load(str(folder))
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    gcfg, _, _ = model_files.load(str(gguf))
    assert gcfg.rope_scaling["rope_type"] == "factors"  # the converter's rope_freqs tensor


def test_phi3_long_rope_is_refused_by_name(hf_tokenizer, tmp_path):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    half = 8  # head_dim 16 / 2
    write_family_folder(tmp_path, "phi3", hf_tokenizer, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
        "long_factor": [2.0] * half, "short_factor": [1.0] * half})
    with pytest.raises(UnsupportedModel, match="longrope"):
        model_files.load(str(tmp_path))
