"""The OpenAI-compatible API through the real openai SDK, against a tiny-model server on loopback:
whole and streamed replies for both APIs, n, seeds, stop, logprobs, usage, and the errors the SDK
raises for each status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.conftest import free_port

from .conftest import base_url, sdk, wait_released

CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
PROMPT = "Once upon a time there was a lighthouse keeper"


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list()] == [model]


def test_chat_completion(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True})
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.model == model and r.id.startswith("chatcmpl-")
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_stream_adds_up_to_the_whole_reply(client, model):
    kw = dict(model=model, messages=CHAT, max_completion_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # include_usage: last, alone
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_whole_streamed_and_echoed(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == PROMPT + whole.choices[0].text


def test_token_id_prompts(client, model):
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    r = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 7 and [c.index for c in r.choices] == [0, 1]
    alone = client.completions.create(model=model, prompt=ids[1], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[1].text.endswith(alone.choices[0].text)


def test_chat_without_max_tokens_stops_at_the_context(client, model, http_server):
    gen = http_server.gen
    size = lambda n: len(gen.tokenize([{"role": "user", "content": "ab " * n}]))  # noqa: E731
    per_word = (size(200) - size(100)) / 100
    words = int(100 + (gen.cfg.context_length - 150 - size(100)) / per_word)  # ~150 tokens of room
    messages = [{"role": "user", "content": "ab " * words}]
    room = gen.cfg.context_length - len(gen.tokenize(messages))
    assert 0 < room < 256  # the engine's default would not fit
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"


def test_completion_defaults_to_sixteen_tokens_as_openai_does(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_several_prompts_each_get_their_choices(client, model):
    prompts = [PROMPT, "The sea was calm", "A third one"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=4, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    alone = [client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    for i, one in enumerate(alone):  # greedy: both choices of prompt i are its reply alone
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == one.choices[0].text
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
    assert r.usage.completion_tokens == 6 * 4


def test_n_choices_share_the_prompt_and_count_it_once(client, model, http_server):
    long_chat = [{"role": "user", "content": PROMPT * 4}]
    one = client.chat.completions.create(model=model, messages=long_chat, max_tokens=6, seed=3, temperature=1.0,
                                         extra_body={"ignore_eos": True, "user": "n-test-once"})
    r = client.chat.completions.create(model=model, messages=long_chat, max_tokens=6, n=3, seed=3, temperature=1.0,
                                       extra_body={"ignore_eos": True, "user": "n-test"})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once, not three times
    assert r.usage.completion_tokens == 18
    # the prompt was prefilled once: the choices found its full blocks in the prefix cache
    block = http_server.gen.pool.block_size
    assert r.usage.prompt_tokens_details.cached_tokens == (r.usage.prompt_tokens - 1) // block * block > 0
    # choice 0 runs with the call's seed: it is the same request as the call with n=1
    assert r.choices[0].message.content == one.choices[0].message.content
    wait_released(http_server)


def test_n_streamed_choices_are_indexed(client, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=5, n=3, seed=11, stream=True,
                                            extra_body={"ignore_eos": True}))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, n=3, seed=11,
                                      extra_body={"ignore_eos": True})
    assert texts == {c.index: c.text for c in whole.choices}
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


def test_seed_reproducibility(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=3.0, extra_body={"ignore_eos": True})
    a, b = (client.completions.create(**kw, seed=1234).choices[0].text for _ in range(2))
    assert a == b
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # another seed, another sample


def test_stop_strings_cut_before_the_match(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[4:7]
    assert stop.strip(), text
    r = client.completions.create(**kw, stop=[stop, "never-seen-here"])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the top token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert t.logprob == t.top_logprobs[0].logprob and bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, logprobs=True, temperature=0)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)  # top_logprobs 0: the token alone


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top, key=top.get) == tok
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_echo_with_logprobs_scores_the_prompt(client, model):
    """What lm-eval's loglikelihood asks: the prompt's own tokens with their logprobs."""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT) and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens + 1


def test_logit_bias_forces_a_token(client, model, http_server):
    tok = http_server.gen.tokenizer
    tokens = lambda **kw: client.completions.create(  # noqa: E731
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, extra_body={"ignore_eos": True},
        **kw).choices[0].logprobs.tokens
    plain = tokens()
    forced = tok.token_text(42)
    assert forced not in plain  # the tiny model repeats one other token
    assert tokens(logit_bias={"42": 100}) == [forced] * 4
    (greedy,) = tok.encode(plain[0], add_bos=False)
    assert plain[0] not in tokens(logit_bias={str(greedy): -100})  # and a banned one never comes


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [999_999]}, "prompt"),
    ({"suffix": "tail"}, "suffix"),
    ({"stop": 5}, "stop"),
])
def test_bad_values_are_400_naming_the_parameter(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": model, "prompt": PROMPT, **kw})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_chat_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format"


def test_the_alias_kvgen_names_the_served_model(client, model):
    r = client.completions.create(model="kvgen", prompt=PROMPT, max_tokens=2)
    assert r.model == model


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"


def test_wrong_or_missing_api_key_is_401(start_server):
    srv = start_server(http_port=free_port(), api_key="key-a,key-b")
    name = srv.gen.cfg.name
    with sdk(srv, api_key="wrong") as c, pytest.raises(openai.AuthenticationError) as e:
        c.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as e:  # no key at all (the SDK always sends one)
        urllib.request.urlopen(base_url(srv) + "/models")
    assert e.value.code == 401 and json.load(e.value)["error"]["code"] == "invalid_api_key"
    with sdk(srv, api_key="key-b") as c:
        assert c.completions.create(model=name, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_full_queue_is_429_with_retry_after(start_server):
    srv = start_server(http_port=free_port(), engine={"max_waiting": 0})
    with sdk(srv) as c, pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=srv.gen.cfg.name, prompt="hi", max_tokens=2)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["code"] == "rate_limit_exceeded"


def test_draining_is_503(http_server, client, model):
    routes = http_server.server.http.routes
    routes.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        routes.draining = False
