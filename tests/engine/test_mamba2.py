"""Mamba-2, the state-space family: a tiny random Mamba2ForCausalLM that transformers writes (config ->
save_pretrained, with the embedded SmolLM2's tokenizer), and the GGUF llama.cpp's own convert_hf_to_gguf.py
makes of it. The oracle is transformers on the same folder, fp32 (its torch path: the chunked scan for a
prompt, the one-token recurrence after).

Checked: logits at every position of a prompt and its continuation against transformers', whether computed
in one chunk or in pieces continued from the state (a prompt chunk then one token at a time); the GGUF's logits
equal the folder's, and its Q8_0 file's are theirs to Q8_0's rounding on the block kernels. Through the engine,
for both files: 8 prompts' 32 greedy tokens in one batch equal transformers'; so do prompts cut into chunks by
a small token budget (with their prompt logprobs), parallel samples forked from one prompt's state, sequences
preempted (a pool too small for them) and recomputed, the others beside one cancelled, and a session's second
turn continued from the first turn's state, with every state freed at the end. GetModelInfo over gRPC.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvgen.client import Client
from kvgen.engine.generator import Generator, load_model
from kvgen.engine.kv.states import POSITION_POOL_SHARE
from kvgen.engine.model_mamba2 import Mamba2
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.sequence import FinishReason
from tests.conftest import ServerThread
from tests.engine.test_oracle import CHATS, RAW, hf_greedy
from tests.tiny import convert_to_gguf, smollm2_hf_tokenizer

PROMPTS = [*RAW, "Once upon a time, in a small village by the sea,", *CHATS]  # 8
STEPS = 32
# Both sides fp32 over the same weights, differing in the order of operations (the scan in chunks of 64 here,
# transformers' of chunk_size; RMS norm as a layer norm): measured within 2e-6 at logits up to ~3. The errors
# this file is there to catch (a state not carried, the conv state off by one input, the gated norm over the
# whole width instead of per group, A taken as log(-A)) move them by 0.1 or more.
LOGIT_TOL = 2e-4
# Small enough for a test, with every part's shape distinct: 8 heads of 16 in 2 groups, a state of 16 per
# channel, conv over 4 inputs; chunk_size 16 so that transformers' own scan crosses chunks on these prompts
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2,
             conv_kernel=4, chunk_size=16, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)


def mamba2_model(vocab: int, seed: int = 0):
    """A transformers Mamba2ForCausalLM with random weights at scales that make its logits spread (its own init
    leaves them near flat) and its states matter: decay rates A in -[0.5, 4.5], dt around softplus(-1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mamba2", vocab_size=vocab, **SHAPE)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embeddings" in name else 0.08))
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(folder, GGUF path, transformers model)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = smollm2_hf_tokenizer()
    root = tmp_path_factory.mktemp("mamba2")
    hf = mamba2_model(len(tok), seed=5)
    hf.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    gguf = convert_to_gguf(root / "hf", root / "mamba2.gguf")
    return root / "hf", gguf, hf


@pytest.fixture(scope="module", params=["hf", "gguf"])
def loaded(request, files):
    """(which file, model, tokenizer) of the folder or its GGUF."""
    folder, gguf, _ = files
    model, tok = load_model(str(folder if request.param == "hf" else gguf), "fp32")
    return request.param, model, tok


_EXPECTED: dict = {}


def expected(hf, ids: list[int]) -> list[int]:
    """transformers' STEPS greedy tokens after ids (computed once per prompt: several tests ask)."""
    key = (id(hf), tuple(ids))
    if key not in _EXPECTED:
        _EXPECTED[key] = hf_greedy(hf, ids, STEPS)
    return _EXPECTED[key]


def prompt_ids(tok, prompt) -> list[int]:
    return tok.encode(prompt) if isinstance(prompt, str) else tok.encode_chat(prompt)


def logits_in_pieces(model: Mamba2, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """The logits of every position of ids, computed piece by piece (pieces ending at cuts, then one token at a
    time), each continuing from the state the one before left: what the engine's steps do."""
    state = [t[None] for t in model.new_state()]
    out, at = [], 0
    for end in [*cuts, *range(cuts[-1] + 1, len(ids) + 1)]:
        logits, state = model.forward(torch.tensor([ids[at:end]]), state, torch.arange(end - at))
        out.append(logits[0])
        at = end
    return torch.cat(out)


def test_the_folder_loads_as_mamba2(files):
    folder, _, _ = files
    model, _ = load_model(str(folder), "fp32")
    cfg = model.cfg
    assert isinstance(model, Mamba2) and cfg.architecture == "mamba2"
    assert (cfg.num_heads, cfg.head_dim, cfg.ssm_state, cfg.ssm_groups, cfg.conv_kernel) == (8, 16, 16, 2, 4)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Mamba2ForCausalLM"]


def test_logits_close_to_transformers_in_one_chunk_and_in_pieces(files, loaded):
    _, _, hf = files
    name, model, tok = loaded
    for prompt in (RAW[0], CHATS[1]):
        ids = prompt_ids(tok, prompt)
        ids = ids + expected(hf, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        whole = model.forward(torch.tensor([ids]), [t[None] for t in model.new_state()], torch.arange(len(ids)))[0]
        assert (whole[0] - ref).abs().max().item() < LOGIT_TOL, f"{name}: one chunk"
        # a prompt cut at 5 and 70 (the second piece longer than the scan's 64-row sub-chunks), then decoding
        pieces = logits_in_pieces(model, ids, [5, min(70, len(ids) - 4)])
        assert (pieces - ref).abs().max().item() < LOGIT_TOL, f"{name}: in pieces"


def test_the_converters_gguf_is_the_folders_model(files):
    folder, gguf, _ = files
    ours, tok = load_model(str(folder), "fp32")
    theirs, gtok = load_model(str(gguf), "fp32")
    assert theirs.cfg.architecture == "mamba2"
    for field in ("num_layers", "num_heads", "head_dim", "ssm_state", "ssm_groups", "conv_kernel", "ssm_inner"):
        assert getattr(theirs.cfg, field) == getattr(ours.cfg, field), field
    ids = prompt_ids(tok, CHATS[0])
    a = theirs.forward(torch.tensor([ids]), [t[None] for t in theirs.new_state()], torch.arange(len(ids)))[0]
    b = ours.forward(torch.tensor([ids]), [t[None] for t in ours.new_state()], torch.arange(len(ids)))[0]
    assert (a - b).abs().max().item() < LOGIT_TOL
    assert gtok.encode_chat(CHATS[1]) == tok.encode_chat(CHATS[1])
    assert theirs.cfg.eos_token_ids == ours.cfg.eos_token_ids == [2]


def test_a_q8_0_gguf_runs_its_projections_on_the_block_kernels(files, tmp_path):
    """The converter's Q8_0 file at WEIGHT_DTYPE auto: in_proj, out_proj, the head and the embedding stay in the
    file's blocks (the embedding read a row at a time), the rest (conv, A, D, dt, norms) F32. Its logits are the
    F32 model's to Q8_0's rounding: bounds as test_model_files_quants.py's for Q8_0 (measured here over a chat
    and its continuation, 71 positions: relative error 1.4e-2, max |diff| 0.069 at logits up to 3.3, argmax
    agreement 0.97)."""
    folder, _, hf = files
    q8 = convert_to_gguf(folder, tmp_path / "q8_0.gguf", outtype="q8_0")
    ref, tok = load_model(str(folder), "fp32")
    model, _ = load_model(str(q8), "auto")
    assert model.weight_dtype == "gguf" and model.cfg.tensor_types["Q8_0"] == 6  # 2 layers x 2, embedding, head
    assert all(type(x).__name__ == "BlockLinear" for x in (model.layers[0].in_proj, model.lm_head))
    assert model.embed.table is None
    ids = prompt_ids(tok, CHATS[0])
    ids = ids + expected(hf, ids)
    got, want = (m.forward(torch.tensor([ids]), [t[None] for t in m.new_state()], torch.arange(len(ids)))[0][0]
                 for m in (model, ref))
    assert ((got - want).norm() / want.norm()).item() < 6e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_greedy_tokens_equal_transformers_in_one_batch(files, loaded):
    _, _, hf = files
    name, model, tok = loaded
    gen = Generator(model, tok, EngineOptions())
    try:
        prompts = [gen.tokenize(p) for p in PROMPTS]
        results = gen.batch_generate(prompts, SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True))
        states = gen.scheduler.kv.states
        assert len(states) == 0 and gen.scheduler.kv.used == 0  # every state and block freed with its request
    finally:
        gen.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == expected(hf, ids), f"{name}: {tok.decode(ids)!r}"


def test_prompts_cut_into_chunks_continue_their_state_and_give_prompt_logprobs(files, loaded):
    """A token budget of 24 cuts the longer prompts into chunks, each continued from the state the last one left,
    in steps shared with other sequences' decode rows; the prompt logprobs asked for come from every chunk."""
    _, _, hf = files
    name, model, tok = loaded
    prompts = [prompt_ids(tok, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True, prompt_logprobs=0)
    gen = Generator(model, tok, EngineOptions(token_budget=24))
    try:
        assert max(len(ids) for ids in prompts) > 24
        results = gen.batch_generate(prompts, params)
    finally:
        gen.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == expected(hf, ids), f"{name}: {tok.decode(ids)!r}"
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1)
        want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = torch.tensor([s.logprob for s in r.prompt_logprobs[1:]])
        assert len(r.prompt_logprobs) == len(ids) and (got - want).abs().max().item() < LOGIT_TOL


def test_parallel_samples_start_from_a_copy_of_the_prompts_state(files, loaded):
    _, _, hf = files
    name, model, tok = loaded
    ids = prompt_ids(tok, CHATS[0])
    gen = Generator(model, tok, EngineOptions())

    async def run():
        reqs = await gen.requests(ids, SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True, n=3))
        out = [await r.result() for r in reqs]
        for r in reqs:
            await r.released()
        return out

    try:
        out = gen.bridge.run(run())
        assert len(gen.scheduler.kv.states) == 0
    finally:
        gen.close()
    assert [o.token_ids for o in out] == [expected(hf, ids)] * 3, name
    assert [o.usage.cached_tokens for o in out[1:]] == [len(ids)] * 2  # the prompt computed once, its state forked


def test_get_model_info_names_the_family_its_state_layout_and_its_path(files):
    """What the server tells a client: the family, its layout ("state": no K/V), the torch decode path and why,
    and no prefix cache (a state is not shared by blocks); the engine runs no drafter (a state is not rewound)."""
    folder, _, _ = files
    server = ServerThread(Generator(*load_model(str(folder), "fp32"), EngineOptions()))
    try:
        with server.channel() as ch:
            info = Client(channel=ch).model_info(timeout=30)  # the Python client's ModelInfo carries each field
        assert server.gen.engine.drafter is None
    finally:
        server.stop()
    assert info.architecture == "mamba2" and info.attention_layout == "state"
    assert info.decode_path == "torch" and "state-space" in info.decode_path_reason
    assert not info.prefix_cache and info.layer_windows == (0, 0)
    assert "no K/V" in info.kv_compress_unsupported


def test_preempted_sequences_equal_transformers(files, loaded):
    """Six greedy streams in a pool of 8 blocks of 16 positions (each needs 2-4): the scheduler preempts some,
    their states go with their blocks, and they are recomputed from their tokens."""
    _, _, hf = files
    name, model, tok = loaded
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    prompts = [prompt_ids(tok, p) for p in PROMPTS[:6]]
    probe = Generator(model, tok, EngineOptions())
    block_mb = probe.pool.fmt.bytes_per_block() / 2**20
    probe.close()
    tight = Generator(model, tok, EngineOptions(kv_cache_mb=8 * block_mb * POSITION_POOL_SHARE))
    try:
        assert tight.pool.capacity == 8 and tight.pool.block_size == 16
        results = tight.batch_generate(prompts, params)
        assert tight.scheduler.preemptions > 0, f"{name}: nothing was preempted"
        assert len(tight.scheduler.kv.states) == 0
    finally:
        tight.close()
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == expected(hf, ids), f"{name} (preempted run): {tok.decode(ids)!r}"


def test_a_cancelled_sequence_frees_its_state_and_the_others_run_on(files, loaded):
    _, _, hf = files
    name, model, tok = loaded
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    prompts = [prompt_ids(tok, p) for p in PROMPTS[:3]]
    gen = Generator(model, tok, EngineOptions())

    async def run():
        reqs = [await gen.request(ids, params) for ids in prompts]
        seen = []
        async for ev in reqs[1]:  # the middle one, cancelled after a few tokens while the others decode
            seen += ev.token_ids
            if len(seen) >= 5:
                reqs[1].cancel()
                break
        out = [await r.result() for r in reqs]
        for r in reqs:
            await r.released()
        return seen, out

    try:
        seen, out = gen.bridge.run(run())
        assert len(gen.scheduler.kv.states) == 0 and gen.scheduler.kv.used == 0
    finally:
        gen.close()
    assert out[1].finish_reason == FinishReason.CANCELLED
    assert seen == expected(hf, prompts[1])[:len(seen)]
    for i in (0, 2):
        assert out[i].token_ids == expected(hf, prompts[i]), f"{name}: {tok.decode(prompts[i])!r}"


def test_a_sessions_second_turn_continues_from_its_state(files, loaded):
    """The session's state is its memory: the second turn computes only its new tokens (the first turn's
    cached_tokens come from the state kept with the parked table), and equals transformers on the whole
    conversation. Closing the session frees the state."""
    _, _, hf = files
    name, model, tok = loaded
    params = SamplingParams(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
    gen = Generator(model, tok, EngineOptions())
    try:
        s = gen.new_session()
        first = s.generate(RAW[0], params)
        second = s.generate(" And then, later that day,", params)
        conversation = s.tokens
        freed = []
        gen.close_session(s.session_id, on_freed=lambda: freed.append(True))
        gen.bridge.run(_until(lambda: freed))
        assert len(gen.scheduler.kv.states) == 0
    finally:
        gen.close()
    turn1 = conversation[:first.usage.prompt_tokens]
    assert first.token_ids == expected(hf, turn1)
    prompt2 = conversation[:len(conversation) - len(second.token_ids)]
    assert prompt2[:len(turn1) + STEPS] == turn1 + first.token_ids
    assert second.usage.cached_tokens == len(turn1) + STEPS - 1  # all but the last sampled token: from the state
    assert second.token_ids == expected(hf, prompt2), f"{name}: the session's second turn"


async def _until(done) -> None:
    import asyncio

    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the session's blocks were not freed")
