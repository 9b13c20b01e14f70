"""vllm.grpc.engine.VllmEngine (smg's grpc:// worker service) beside kvgen.v1 on one port: real
gRPC on loopback against real servers (tiny models; the embedded one for the tokenizer bundle)."""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.v1 import generate_pb2 as pb
from kvgen.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import ServerThread

KEY = "worker-key"
PROMPT = "the cat sat on the mat and the dog sat on the log, " * 3


@pytest.fixture(scope="module")
def plain(start_server):
    return start_server()


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server(api_key=KEY)


def stub(ch):
    return vllm_engine_pb2_grpc.VllmEngineStub(ch)


def greedy(max_tokens=12, **kw):
    return vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def completes(responses):
    return [r.complete for r in responses if r.WhichOneof("response") == "complete"]


def kvgen_tokens(ch, **req) -> list[int]:
    """kvgen.v1 Generate's tokens for the same greedy request."""
    r = pb_grpc.GeneratorStub(ch).Generate(pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=12), **req), timeout=60)
    return list(r.token_ids)


def test_text_and_token_ids_give_kvgen_v1s_greedy_tokens(plain):
    with plain.channel() as ch:
        want = kvgen_tokens(ch, prompt=PROMPT)
        ids = plain.gen.tokenizer.encode(PROMPT)
        by_text = completes(stub(ch).Generate(vpb.GenerateRequest(request_id="t", text=PROMPT,
                                                                  sampling_params=greedy()), timeout=60))
        by_ids = completes(stub(ch).Generate(vpb.GenerateRequest(
            request_id="i", tokenized=vpb.TokenizedInput(input_ids=ids), sampling_params=greedy()), timeout=60))
    assert len(want) == 12
    for done in (by_text, by_ids):
        assert len(done) == 1
        assert list(done[0].output_ids) == want
        assert done[0].prompt_tokens == len(ids)
        assert done[0].completion_tokens == 12
        assert done[0].finish_reason == "length"


def test_streaming_sends_deltas_then_the_ending(plain):
    with plain.channel() as ch:
        want = kvgen_tokens(ch, prompt=PROMPT)
        out = list(stub(ch).Generate(vpb.GenerateRequest(request_id="s", text=PROMPT, stream=True,
                                                         sampling_params=greedy()), timeout=60))
    chunks = [r.chunk for r in out if r.WhichOneof("response") == "chunk"]
    assert len(chunks) > 1  # token by token, not one message at the end
    assert [t for c in chunks for t in c.token_ids] == want
    assert out[-1].WhichOneof("response") == "complete"
    assert out[-1].complete.finish_reason == "length" and out[-1].complete.completion_tokens == 12


def test_a_stop_token_is_reported_as_matched(plain):
    with plain.channel() as ch:
        first = kvgen_tokens(ch, prompt=PROMPT)[3]
        done = completes(stub(ch).Generate(vpb.GenerateRequest(
            text=PROMPT, sampling_params=greedy(stop_token_ids=[first])), timeout=60))[0]
    assert done.finish_reason == "stop"
    assert done.matched_token_id == first and done.output_ids[-1] == first


def test_abort_ends_a_running_stream(plain):
    with plain.channel() as ch:
        calls = stub(ch).Generate(vpb.GenerateRequest(
            request_id="long-one", text=PROMPT, stream=True,
            sampling_params=greedy(max_tokens=1500, ignore_eos=True)), timeout=60)
        first = next(calls)
        assert first.chunk.token_ids
        stub(ch).Abort(vpb.AbortRequest(request_ids=["long-one"]), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            for _ in calls:
                pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert not plain.gen.scheduler.running


def test_what_the_engine_lacks_is_refused_by_name(plain):
    with plain.channel() as ch:
        for params, field in [(greedy(structural_tag="{}"), "structural_tag"),
                              (greedy(truncate_prompt_tokens=4), "truncate_prompt_tokens"),
                              (greedy(logprobs=-1), "logprobs")]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub(ch).Generate(vpb.GenerateRequest(text="hi", sampling_params=params), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in e.value.details()


def test_loads_move_with_load(plain):
    with plain.channel() as ch:
        s = stub(ch)
        idle = s.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
        calls = s.Generate(vpb.GenerateRequest(request_id="busy", text=PROMPT, stream=True,
                                               sampling_params=greedy(max_tokens=1500, ignore_eos=True)), timeout=60)
        next(calls)
        busy = s.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
        s.Abort(vpb.AbortRequest(request_ids=["busy"]), timeout=10)
        with pytest.raises(grpc.RpcError):
            list(calls)
        after = s.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    assert idle.num_running_reqs == 0 and after.num_running_reqs == 0
    assert busy.num_running_reqs == 1
    assert busy.num_used_tokens > idle.num_used_tokens and busy.token_usage > idle.token_usage
    assert busy.max_total_num_tokens == plain.gen.pool.capacity * plain.gen.pool.block_size


def test_model_and_server_info(plain):
    with plain.channel() as ch:
        m = stub(ch).GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
        info = stub(ch).GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
        health = stub(ch).HealthCheck(vpb.HealthCheckRequest(), timeout=10)
    cfg = plain.gen.cfg
    assert (m.served_model_name, m.max_context_length, m.vocab_size) == (cfg.name, cfg.context_length, cfg.vocab_size)
    assert list(m.eos_token_ids) == cfg.eos_token_ids and m.is_generation
    assert info.block_size == plain.gen.pool.block_size and info.max_num_seqs == plain.gen.scheduler.max_running
    assert health.healthy


class KvReader:
    """A SubscribeKvEvents stream read on a thread, rebuilding the replica's prefix index (block
    hash -> parent, tokens) from the events alone, as a router does."""

    def __init__(self, ch):
        self.call = stub(ch).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        self.index: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.stored = self.removed = 0
        self.last = 0
        self.error: BaseException | None = None  # what went wrong on the reading thread
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for batch in self.call:
                with self.lock:
                    assert batch.sequence_number == self.last + 1 or batch.HasField("snapshot")  # no gap
                    self.last = batch.sequence_number
                    for ev in batch.events:
                        kind = ev.WhichOneof("data")
                        if kind == "stored":
                            parent = ev.stored.parent_block_hash if ev.stored.HasField("parent_block_hash") else None
                            for b in ev.stored.blocks:
                                assert parent is None or parent in self.index  # parents come first
                                self.index[b.block_hash] = (parent, tuple(b.token_ids))
                                parent = b.block_hash
                                self.stored += 1
                        elif kind == "removed":
                            for h in ev.removed.block_hashes:
                                del self.index[h]
                                self.removed += 1
                        else:
                            self.index.clear()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
        except AssertionError as e:
            self.error = e

    def wait_for(self, cond, timeout=20.0, raise_on_timeout=True):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.error:
                    raise self.error
                if cond(self):
                    return
            time.sleep(0.02)
        if raise_on_timeout:
            raise AssertionError("the events never came")

    def close(self):
        self.call.cancel()
        self.thread.join(5)
        if self.error:
            raise self.error


def cache_blocks(server) -> dict[int, tuple[int, ...]]:
    """The prefix cache's own full blocks, by hash (the engine's tree, read directly)."""
    prefix = server.gen.scheduler.kv.prefix
    return {n.hash: n.key for n in list(prefix._nodes) if len(n.key) == prefix.block_size}


def test_kv_events_rebuild_the_prefix_cache_exactly(start_server):
    server = start_server()
    bs = server.gen.pool.block_size
    with server.channel() as ch:
        reader = KvReader(ch)
        time.sleep(0.2)  # subscribed before the request runs
        ids = server.gen.tokenizer.encode(PROMPT)
        list(stub(ch).Generate(vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                                                   sampling_params=greedy()), timeout=60))
        # the events may trail the engine by a step: wait until they add up to the tree, or time out
        reader.wait_for(lambda r: {h: t for h, (_, t) in r.index.items()} == cache_blocks(server) != {},
                        raise_on_timeout=False)
        reader.close()
    with reader.lock:
        assert {h: t for h, (_, t) in reader.index.items()} == cache_blocks(server)
        # the prompt's blocks, in order, chained by their parents
        chain, parent = [], None
        for _ in range(len(ids) // bs):
            child = next(h for h, (p, _) in reader.index.items() if p == parent and
                         reader.index[h][1] == tuple(ids[len(chain) * bs:(len(chain) + 1) * bs]))
            chain.append(child)
            parent = child
        assert len(chain) == len(ids) // bs >= 2


def test_kv_events_report_removed_blocks_after_eviction(tiny_pair):
    # a pool of a few blocks and no tier space: the cache drops old blocks for new prompts
    server = ServerThread(Generator(*tiny_pair, EngineOptions(kv_cache_mb=0.1, prefix_cache_tier_mb=0)))
    try:
        _evict_and_read(server)
    finally:
        server.stop()


def _evict_and_read(server):
    with server.channel() as ch:
        late = stub(ch)
        list(late.Generate(vpb.GenerateRequest(text=PROMPT, sampling_params=greedy(4)), timeout=60))
        reader = KvReader(ch)  # joins late: a snapshot of what the cache holds first
        reader.wait_for(lambda r: r.index and r.index.keys() == cache_blocks(server).keys())
        for i in range(6):
            list(late.Generate(vpb.GenerateRequest(text=f"{i} different words {i} " * 8,
                                                   sampling_params=greedy(4)), timeout=60))
        reader.wait_for(lambda r: r.removed > 0 and r.index.keys() == cache_blocks(server).keys())
        reader.close()
    with reader.lock:
        assert {h: t for h, (_, t) in reader.index.items()} == cache_blocks(server)


def test_tokenizer_bundle_builds_the_servers_tokenizer(server):
    """The embedded GGUF's tokenizer, as a gateway gets it: the zip loads in tokenizers and in
    transformers, encodes as the server does, and carries the chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    with server.channel() as ch:
        chunks = list(stub(ch).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    import hashlib

    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    files = zipfile.ZipFile(io.BytesIO(data))
    tok = Tokenizer.from_str(files.read("tokenizer.json").decode())
    cfg = json.loads(files.read("tokenizer_config.json"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: cfg[k] for k in ("bos_token", "eos_token") if cfg[k]})
    hf.chat_template = cfg["chat_template"]
    ours = server.gen.tokenizer
    text = "Numbers 12345 and 2024-06-01, déjà vu, <|im_start|>user\n spaces  here"
    assert tok.encode(text).ids == ours.encode(text)
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    messages = [{"role": "user", "content": "What is 17 * 23?"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)


def test_every_method_needs_the_key_when_keys_are_set(keyed):
    key = (("authorization", f"Bearer {KEY}"),)
    with keyed.channel() as ch:
        s = stub(ch)
        calls = [lambda md: list(s.Generate(vpb.GenerateRequest(text="hi", sampling_params=greedy(2)),
                                            metadata=md, timeout=30)),
                 lambda md: s.GetLoads(vpb.GetLoadsRequest(), metadata=md, timeout=10),
                 lambda md: s.HealthCheck(vpb.HealthCheckRequest(), metadata=md, timeout=10),
                 lambda md: list(s.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=md, timeout=30))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call(None)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call(key)
        events = s.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            next(events)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_lists_the_service(plain):
    with plain.channel() as ch:
        reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"vllm.grpc.engine.VllmEngine", "kvgen.v1.Generator"} <= names
