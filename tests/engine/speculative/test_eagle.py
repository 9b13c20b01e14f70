"""The EAGLE drafter (kvgen/engine/speculative/eagle.py) where it meets the rest of the engine:
over the default gguf weights it drafts from the fused decode step's features (the step does not
fall back to Model.forward), and a prompt whose start came from the prefix cache is drafted for.
Its losslessness over many prompts and concurrencies is test_lossless.py's."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.model_files import embedded_model_path
from kvgen.engine.sampling import SamplingParams
from tests.engine.speculative.test_lossless import _generate, _prompts, eagle_head
from tests.engine.test_batch_invariance import small_model
from tests.engine.test_oracle import RAW

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)


def _head(model, tmp_path) -> str:
    path = tmp_path / "head.safetensors"
    save_file(eagle_head(model.cfg), str(path))
    return str(path)


@pytest.mark.heavy
def test_eagle_over_the_default_weights_drafts_from_the_fused_step(tmp_path, monkeypatch):
    """Greedy tokens equal plain decoding alone and among 4 streams, drafts were verified, every
    step ran fused (none through Model.forward), and no block is left behind."""
    model = load_model(embedded_model_path(), "auto")
    assert model[0].weight_dtype == "gguf"
    prompts = ["Copy: red, green, blue, cyan, magenta, yellow, black. Copy: red, green,", RAW[1], RAW[4], RAW[0]]
    plain = Generator(*model, EngineOptions())
    eagle = Generator(*model, EngineOptions(speculative="eagle", eagle_head=_head(model[0], tmp_path)))
    unfused = []
    forward = eagle.engine.runner._forward
    monkeypatch.setattr(eagle.engine.runner, "_forward", lambda *a: unfused.append(a) or forward(*a))
    try:
        for concurrent in (1, 4):
            want = _generate(plain, prompts, GREEDY, concurrent)
            assert _generate(eagle, prompts, GREEDY, concurrent) == want
        assert eagle.engine.drafted_tokens > 0
        assert not unfused
        assert eagle.scheduler.kv.used == 0 and eagle.engine.drafter.sequences == 0
    finally:
        plain.close()
        eagle.close()


@pytest.fixture(scope="module")
def small():
    return small_model()


def test_a_prompt_whose_start_came_from_the_prefix_cache_is_drafted_for(small, tmp_path):
    """The second request shares the first's long start: the prefix cache supplies it, the head
    starts its own cache at the first position the model computed, drafts, and the tokens are
    plain decoding's (which runs with the prefix cache off)."""
    first, second = _prompts(2)
    second = first + " " + second
    plain = Generator(*small, EngineOptions(prefix_cache=False))
    eagle = Generator(*small, EngineOptions(speculative="eagle", eagle_head=_head(small[0], tmp_path)))
    try:
        assert eagle.generate(first, GREEDY).token_ids == plain.generate(first, GREEDY).token_ids
        drafted = eagle.engine.drafted_tokens
        got = eagle.generate(second, GREEDY)
        assert got.usage.cached_tokens >= 16  # the start came from the cache
        assert eagle.engine.drafted_tokens > drafted
        assert got.token_ids == plain.generate(second, GREEDY).token_ids
        assert eagle.scheduler.kv.used == 0 and eagle.engine.drafter.sequences == 0
    finally:
        plain.close()
        eagle.close()
