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
embeddings, GELU-tanh and a final logit cap; gemma2 the same sandwich norms, scaled embeddings and GELU-tanh,
windowed and global layers alternating, and its attention scores soft-capped (torch attention only: the
kernels do not cap, so such a model never takes them) as well as its logits.

mistral has a sliding window on every layer (4096, past these sequences); qwen2 q/k/v biases. The converter
writes a Mistral as llama, as Mistral's own GGUFs are.

gemma2's and qwen2's GGUFs: llama.cpp's converter takes a gemma2 vocabulary only from a sentencepiece
tokenizer.model, and refuses SmolLM2's BPE in a qwen2 folder (tests/tiny.py SENTENCEPIECE_GGUF), so those
files' vocabularies are not the folders': their weights and metadata are checked against the folder's by
token ids (their sentencepiece vocabulary: test_tokenizer_sentencepiece.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvgen.engine import model_files
from kvgen.engine.attention import KernelStep
from kvgen.engine.generator import Generator, load_model
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from tests.engine.test_model_files import all_logits
from tests.engine.test_model_runner import RefKernels
from tests.engine.test_oracle import CHATS, RAW, hf_greedy
from tests.tiny import SENTENCEPIECE_GGUF, convert_to_gguf, smollm2_hf_tokenizer, write_family_folder

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gemma2"]
PROMPTS = [*RAW, "Once upon a time, in a small village by the sea,", *CHATS]  # 8
STEPS = 32
# Both sides run fp32 over the same fp32 weights and differ only in the order of operations (RoPE as one
# complex multiply on interleaved rows, RMSNorm as a layer norm, torch's SDPA against transformers'
# attention): measured within 1.7e-6 of transformers at logits up to 3.4 for llama, qwen3 and phi3 (2
# layers, 59 positions), 3.5e-5 for gemma3 (6 layers, embeddings scaled by 8, (1 + w) norms, logits under
# a cap of 5), 1.7e-5 for gemma2 (4 layers, scores capped at 1.5 by tanh in place of SDPA), and the
# converter's F32 GGUF exactly equal to the folder. 2e-4 leaves room for other CPUs'
# kernels; each error this file is there to catch moves the logits by 0.28 (llama3 scaling ignored) to 1.0
# (phi3's fused q rows not interleaved), 0.74 for qwen3's k norm skipped, 7.4 for gemma2's score cap
# skipped and 7.2 for its windows ignored.
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
    # the converter writes a Mistral as llama, as Mistral's own GGUFs are
    assert theirs.cfg.architecture == ("llama" if name == "mistral" else name)
    if name == "gemma2":
        cfg = theirs.cfg
        assert cfg.layer_windows == ours.cfg.layer_windows == [8, 0, 8, 0]
        assert cfg.attn_logit_softcap == ours.cfg.attn_logit_softcap == 1.5
        assert cfg.final_logit_softcap == ours.cfg.final_logit_softcap == 5.0
    if name in SENTENCEPIECE_GGUF:  # a vocabulary of its own, the sentencepiece tokenizer.model's (module doc)
        assert gtok.bos_id is not None and gtok.tok.id_to_token(gtok.bos_id) == "<s>"
        ids = continuation(hf, tok.encode_chat(CHATS[0]))
        err = (all_logits(theirs, ids) - all_logits(ours, ids)).abs().max().item()
        assert err < LOGIT_TOL, f"{name}: GGUF against the folder: max |logit diff| {err}"
        return
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


def test_a_windowed_or_capped_model_never_takes_the_kernels(family):
    """The GPU decode kernels attend to every cached key with plain scores: gemma's per-layer windows and
    gemma2's score cap are torch attention's only. ModelRunner keeps torch attention for such a model where
    the kernels would serve its KV format (stand-in kernels here, as tests/engine/test_model_runner.py), and
    Model.forward refuses a kernel step rather than run it without them."""
    name, folder, _, _ = family
    model, _ = load_model(str(folder), "fp32")
    cfg = model.cfg
    fmt = make_format("fp32", cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 8)
    runner = ModelRunner(model, fmt, pool.store, kernels=RefKernels, fused=False)
    if not name.startswith("gemma"):
        assert model.torch_attention_why is None and runner.kernel_attention is not None
        return
    assert runner.kernel_attention is None
    assert "per-layer sliding windows [8]" in model.torch_attention_why
    assert ("soft-capping at 1.5" in model.torch_attention_why) == (name == "gemma2")
    step = KernelStep.of(torch.zeros((1, 4), dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="the torch attention path only"):
        model.forward(torch.tensor([5]), step, fmt, pool.store)


def test_preempted_sequences_and_a_sessions_second_turn_equal_transformers(family):
    """Six greedy streams in a pool too small to hold them at once (8 blocks of 16 positions; each needs
    3-4): the scheduler preempts and recomputes some, and every stream still equals transformers'. Then
    a session's second turn, which attends over the first turn's cached K/V (gemma's windows sliding over
    it), equals transformers on the whole conversation."""
    name, folder, hf, _ = family
    model, tok = load_model(str(folder), "fp32")
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    prompts = [tok.encode(p) if isinstance(p, str) else tok.encode_chat(p) for p in PROMPTS[:6]]
    probe = Generator(model, tok, EngineOptions())
    block_mb = probe.pool.fmt.bytes_per_block() / 2**20
    probe.close()
    tight = Generator(model, tok, EngineOptions(kv_cache_mb=8 * block_mb, prefix_cache=False))
    try:
        assert tight.pool.capacity == 8 and tight.pool.block_size == 16
        results = tight.batch_generate(prompts, params)
        assert tight.scheduler.preemptions > 0, f"{name}: nothing was preempted"
    finally:
        tight.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(hf, ids, STEPS), f"{name} (preempted run): {tok.decode(ids)!r}"

    gen = Generator(model, tok, EngineOptions())
    try:
        s = gen.new_session()
        first = s.generate(RAW[0], params)
        second = s.generate(" And then, later that day,", params)
        conversation = s.tokens
    finally:
        gen.close()
    turn1 = conversation[:first.usage.prompt_tokens]
    assert first.token_ids == hf_greedy(hf, turn1, STEPS)
    prompt2 = conversation[:len(conversation) - len(second.token_ids)]
    assert prompt2[:len(turn1) + STEPS] == turn1 + first.token_ids  # the second turn continues the first
    assert second.token_ids == hf_greedy(hf, prompt2, STEPS), f"{name}: the session's second turn"
