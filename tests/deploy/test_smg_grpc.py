"""The real smg binary (`smg launch`) over kvgen's vLLM gRPC worker service (grpc:// worker URL),
on loopback: smg fetches the tokenizer bundle, applies the chat template itself, sends token ids,
and its chat completions, completions and streams give the greedy text of kvgen.v1's own Generate
on the same server; policy cache_aware, which reads the worker's KV events and loads."""

from __future__ import annotations

import openai
import pytest

from deploy.mesh import Smg
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smg(server, tmp_path_factory):
    worker = f"grpc://127.0.0.1:{server.port}"
    gateway = Smg([worker], tmp_path_factory.mktemp("smg-grpc"), policy="cache_aware")
    gateway.start()
    try:
        gateway.wait_workers({worker: True}, timeout=120)
        yield gateway
    finally:
        gateway.stop()


def _direct(server, **req) -> str:
    """kvgen.v1 Generate's greedy text for the same request."""
    with server.channel() as ch:
        r = pb_grpc.GeneratorStub(ch).Generate(pb.GenerateRequest(
            sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS), **req), timeout=120)
    return r.text


def _sdk(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_smg_serves_chat_and_completions_from_the_grpc_worker(server, smg):
    client = _sdk(smg)
    model = client.models.list().data[0].id
    assert model == server.gen.cfg.name  # GetModelInfo's served_model_name
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = _direct(server, messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens == len(server.gen.tokenizer.encode_chat(messages))
    streamed = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                              stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == want

    prompt = "The three primary colors are"
    want = _direct(server, prompt=prompt)
    done = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert done.choices[0].text == want
    streamed = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_a_resent_conversation_is_served_from_the_prefix_cache(server, smg):
    """A stateless client's second turn resends the first: the worker's prefix cache serves it
    (smg reports the worker's cached_tokens)."""
    client = _sdk(smg)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Write one sentence about the sea and the sky above it."}]
    first = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And one more, please."}]
    second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    assert second.usage.prompt_tokens_details.cached_tokens >= server.gen.pool.block_size
