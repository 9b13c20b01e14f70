"""`SamplingParams.speculative` over real gRPC: the same tokens with and without, on every RPC;
drafting shows in the Prometheus counters. (The shared server runs SPECULATIVE=off, so a request
that asks drafts by prompt lookup.)"""

from __future__ import annotations

import re
import urllib.request

from kvgen.v1 import generate_pb2 as pb

PROMPT = "Copy the list: red, green, blue, cyan, magenta, yellow, black, white. Copy: red, green, blue,"


def _sampling(speculative: bool | None) -> pb.SamplingParams:
    s = pb.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    if speculative is not None:
        s.speculative = speculative
    return s


def _counter(server, name: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.settings.metrics_port}/metrics", timeout=5).read()
    m = re.search(rf"^{name} (\S+)$", page.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def test_speculative_requests_give_the_same_tokens_on_every_rpc(server, stub):
    drafted = _counter(server, "kvgen_spec_draft_tokens_total")
    plain = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(None)))
    spec = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(True)))
    assert list(spec.token_ids) == list(plain.token_ids) and spec.text == plain.text
    streamed = [m for m in stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(True)))]
    assert [t for m in streamed for t in m.token_ids] == list(plain.token_ids)
    assert "".join(m.text for m in streamed) == plain.text
    batch = stub.BatchGenerate(pb.BatchGenerateRequest(requests=[
        pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(True)),
        pb.GenerateRequest(prompt=PROMPT, sampling=_sampling(False))]))
    assert [list(r.response.token_ids) for r in batch.results] == [list(plain.token_ids)] * 2
    after = _counter(server, "kvgen_spec_draft_tokens_total")
    assert after > drafted  # prompt lookup found the list and drafted from it
    assert _counter(server, "kvgen_spec_accepted_tokens_total") > 0
