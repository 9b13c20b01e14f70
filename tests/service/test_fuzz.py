"""Fuzzing through a real channel: GenerateRequests drawn from the proto's descriptors, and raw
garbage bodies on every method. Never UNKNOWN or INTERNAL, never a hang; the server answers a
normal request afterwards."""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgen.client import request
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc

from .protofuzz import messages
from .wire import METHODS, code_of

# what a request, however odd, may get; anything else (UNKNOWN, INTERNAL, DEADLINE_EXCEEDED: a
# hang) is a bug
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
TIMEOUT_S = 20
# derandomized: CI runs the same cases every time (a failure reproduces); no example database on disk
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

S = "kvgen.v1.SamplingParams."


def mostly(valid, *extremes):
    """Mostly values from `valid` (so requests reach the engine), sometimes the field's extremes."""
    return st.sampled_from(range(8)).flatmap(lambda i: st.one_of(*extremes) if i == 5 else valid)


# Keep each generated request's work small (max_new_tokens is always set, mostly tiny), and aim
# most values at the valid range so that requests get past validation into the engine too.
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT = st.floats(width=32)
OVERRIDES = {
    S + "max_new_tokens": mostly(st.integers(1, 4), st.integers(-2, 0), st.sampled_from([2**31 - 1, -(2**31), 5000])),
    S + "logprobs": mostly(st.integers(0, 3), st.integers(-1, 21), INT32),
    S + "temperature": mostly(st.sampled_from([0.0, 0.7, 1.0]), FLOAT),
    S + "top_p": mostly(st.sampled_from([1.0, 0.9, 0.01]), FLOAT),
    S + "top_k": mostly(st.integers(0, 50), INT32),
    S + "repetition_penalty": mostly(st.sampled_from([1.0, 1.3, 0.5]), FLOAT),
    S + "stop_token_ids": st.lists(mostly(st.integers(0, 299), INT32), max_size=3),
    # all three inputs are drawn, one_input keeps one of them
    "kvgen.v1.GenerateRequest.prompt": mostly(st.text(min_size=1, max_size=40), st.text(max_size=400)),
    "kvgen.v1.GenerateRequest.prompt_token_ids": st.lists(mostly(st.integers(0, 299), INT32), min_size=1, max_size=6),
    S + "stop_strings": st.lists(mostly(st.text(min_size=1, max_size=4), st.text(max_size=300)), max_size=3),
    "kvgen.v1.GenerateRequest.session_id": mostly(st.just(""), st.text(max_size=140)),
    "kvgen.v1.GenerateRequest.request_id": mostly(st.text(max_size=16), st.text(max_size=200)),
    "kvgen.v1.ChatMessage.role": mostly(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=8)),
}
INPUTS = ("prompt", "messages", "prompt_token_ids")


def one_input(req: pb.GenerateRequest, keep: str | None) -> pb.GenerateRequest:
    """Mostly a single input (keep), as a caller sends; None leaves whatever was drawn."""
    for name in INPUTS:
        if keep is not None and name != keep:
            req.ClearField(name)
    return req


# sampling always set, so that max_new_tokens is too (its default, 256, would make each case slow)
REQUESTS = st.builds(one_input, messages(pb.GenerateRequest, {
    **OVERRIDES, "kvgen.v1.GenerateRequest.sampling": messages(pb.SamplingParams, OVERRIDES),
    "kvgen.v1.GenerateRequest.messages": st.lists(messages(pb.ChatMessage, OVERRIDES), min_size=1, max_size=3)}),
    mostly(st.sampled_from(INPUTS), st.none()))


@pytest.fixture(scope="module")
def channel(tiny_server):
    with tiny_server.channel() as ch:
        yield ch


@settings(max_examples=150, **FUZZ)
@given(req=REQUESTS, streaming=st.booleans())
def test_generated_requests_get_a_clean_answer(channel, req, streaming):
    method = "/kvgen.v1.Generator/GenerateStream" if streaming else "/kvgen.v1.Generator/Generate"
    code = code_of(channel, method, req.SerializeToString(), streaming, timeout=TIMEOUT_S)
    assert code in ANSWERS, (code, req)


def damaged(raw: bytes):
    """raw cut somewhere and followed by a few random bytes: mostly valid framing, then noise."""
    return st.builds(lambda cut, noise: raw[:cut] + noise, st.integers(0, len(raw)), st.binary(max_size=8))


GARBAGE = st.one_of(st.binary(max_size=64), REQUESTS.map(lambda r: r.SerializeToString()).flatmap(damaged))


@settings(max_examples=300, **FUZZ)
@given(body=GARBAGE, method=st.sampled_from(sorted(METHODS)))
def test_garbage_bodies_get_a_clean_answer(channel, body, method):
    code = code_of(channel, method, body, METHODS[method], timeout=TIMEOUT_S)
    assert code in ANSWERS, (code, method, body)


def test_server_answers_after_the_fuzz(tiny_server, channel):
    r = pb_grpc.GeneratorStub(channel).Generate(request("Hello", max_new_tokens=3, temperature=0.0, ignore_eos=True),
                                                timeout=TIMEOUT_S)
    assert len(r.token_ids) == 3
    deadline = time.time() + 10  # the engine lets the last request go just after answering it
    while not tiny_server.gen.engine.idle and time.time() < deadline:
        time.sleep(0.02)
    assert tiny_server.gen.engine.idle
