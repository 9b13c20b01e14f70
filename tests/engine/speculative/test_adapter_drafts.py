"""Speculative decoding under a LoRA adapter (issue #44: "speculative drafts verify under the request's
adapter"): with SPECULATIVE set, requests on each adapter and on the base model, all in one batch, give
exactly the greedy tokens they give without speculation, and their drafts were verified under their
own adapter.

tests/engine/test_lora.py's tiny Llama (an HF folder at fp32: Model.forward's LoRA path; its Q8_0 GGUF:
the fused step's) and its four random PEFT adapters, each of which changes the greedy output (that file
checks them against transformers + PEFT). The drafters: prompt lookup; a draft model that is the base
model itself, without any adapter, so under an adapter its drafts are the base model's tokens and only
a verification under the adapter rejects them; an EAGLE head (random) over the target's features."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from kvgen.engine.generator import Generator, load_model
from kvgen.engine.options import EngineOptions
from kvgen.engine.sampling import SamplingParams
from tests.engine.speculative.test_lossless import eagle_head
from tests.engine.test_lora import ADAPTERS, PROMPTS, STEPS, base  # noqa: F401  (base: a fixture)

NAMES = ["", *ADAPTERS]  # "": the base model


def _engine(base, kind: str, **opts) -> Generator:  # noqa: F811
    folder, gguf_path, adapters = base
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    path = str(folder if kind == "hf" else gguf_path)
    return Generator(*load_model(path, "fp32" if kind == "hf" else "auto"), EngineOptions(lora_adapters=spec, **opts),
                     model_path=path)


def _run_together(gen: Generator, jobs: list[tuple[list[int], str]]) -> list[tuple[list[int], int, int]]:
    """Each (prompt ids, adapter) as one greedy request, all submitted before any is read (one batch):
    (tokens, drafted, kept) per request."""
    sp = SamplingParams(temperature=0, max_new_tokens=3 * STEPS, ignore_eos=True)

    async def go():
        reqs = [gen.submit(ids, sp, adapter=name) for ids, name in jobs]
        out = [(await r.result()).token_ids for r in reqs]
        for r in reqs:
            await r.released()
        return [(list(t), r.seq.drafted, r.seq.accepted) for t, r in zip(out, reqs, strict=True)]

    return gen.bridge.run(go())


@pytest.fixture(scope="module", params=["hf", "gguf"])
def plain(request, base):  # noqa: F811
    """(kind, jobs, each job's tokens without speculation)."""
    gen = _engine(base, request.param)
    try:
        # prompts that repeat themselves, so prompt lookup finds n-grams to propose
        jobs = [(gen.tokenize(" ".join([p] * 3)), name) for p in PROMPTS for name in NAMES]
        tokens = [t for t, _, _ in _run_together(gen, jobs)]
        assert gen.engine.drafted_tokens == 0
    finally:
        gen.close()
    for i in range(0, len(jobs), len(NAMES)):  # every adapter changes what its prompt gives
        assert len({tuple(t) for t in tokens[i:i + len(NAMES)]}) == len(NAMES)
    return request.param, jobs, tokens


@pytest.mark.parametrize("drafter", ["ngram", "draft", "eagle"])
def test_drafts_verified_under_each_requests_adapter_change_no_token(base, plain, drafter, gate_open,  # noqa: F811
                                                                     tmp_path):
    kind, jobs, want = plain
    head = ""
    if drafter == "eagle":
        head = str(tmp_path / "head.safetensors")
        save_file(eagle_head(load_model(str(base[0]), "fp32")[0].cfg), head)
    # everyone drafts: the batch (10 requests) is under the size above which nobody would
    gen = _engine(base, kind, speculative=drafter, eagle_head=head, speculative_max_batch=len(jobs))
    try:
        got = _run_together(gen, jobs)
        assert gen.scheduler.kv.used == 0
    finally:
        gen.close()
    assert [t for t, _, _ in got] == want
    for name in NAMES:  # every adapter's requests drafted, and had drafts checked
        assert sum(d for (_, n), (_, d, _) in zip(jobs, got, strict=True) if n == name) > 0, name
    if drafter == "draft":
        # The draft model is the base model: under an adapter it proposes the base model's tokens, which
        # the adapter's output mostly is not. Drafts rejected there show the verification ran the adapter
        # (run without it, every such draft would pass, and the tokens would be the base model's).
        on_adapters = [(d, k) for (_, n), (_, d, k) in zip(jobs, got, strict=True) if n]
        assert sum(k for _, k in on_adapters) < sum(d for d, _ in on_adapters)
