"""The engine on CUDA (`make test-gpu`; skipped without a CUDA device, CuPy and Numba).

* ModelRunner's kernel decode step (Model.forward with KernelAttention: kv_append, flash_decode,
  increment, CUDA graphs) against Model.forward with torch attention on the GPU, every kernel
  format, graphs on and off;
* ModelRunner on the GPU (prefill, chunked prefill, decode through flash_decode, and the torch
  decode path for q3 and with a window) against Model.forward on the CPU;
* greedy generation of the oracle prompts (tests/test_oracle.py), fp32 weights, against the
  CPU engine with the same KV format: equal, or the first difference is a near-tie on the CPU
  (top-2 logit gap < 1e-2); fp8 / q4 agree for most tokens (the agreement is printed, -s);
* graphs on == graphs off token for token at batch 1, 3 and 8 (padded to buckets 1, 4, 8, and
  smaller buckets as sequences finish);
* the prefix cache (a shared prompt's blocks reused, same tokens as without), speculative
  decoding (prompt lookup, a draft model) and constrained decoding (JSON Schema, with the mask
  computed during the CUDA forward) on CUDA;
* GetModelInfo reports the device.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

from kvgen.engine.attention import Step
from kvgen.engine.constraint import Constraint
from kvgen.engine.generator import EngineOptions, Generator, load_model
from kvgen.engine.kv.compress import KVCompression
from kvgen.engine.kv.formats import make_format
from kvgen.engine.kv.paged import PagedKVCache
from kvgen.engine.kv.pool import BlockPool
from kvgen.engine.model import Model
from kvgen.engine.model_files import embedded_model_path
from kvgen.engine.model_runner import ModelRunner
from kvgen.engine.sampling import SamplingParams
from tests.conftest import run_together
from tests.engine.speculative.test_lossless import eagle_head
from tests.engine.test_model_runner import _compare_decode, _prefill, _sequences
from tests.engine.test_oracle import CHATS, RAW
from tests.tiny import tiny_config, tiny_weights


def _ready() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return False
    import kvgen.gpu

    return kvgen.gpu.available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _ready(), reason="needs a CUDA device, CuPy and Numba")]

N_NEW = 32
GREEDY = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_model():
    """(model, tokenizer) of the embedded model, fp32 weights on the GPU."""
    return load_model(embedded_model_path(), "fp32", "cuda")


@pytest.fixture(scope="module")
def tiny_cuda():
    cfg = tiny_config(layers=2, hidden=128, heads=4, kv_heads=2, ffn=128, vocab=512, context=256)
    return Model(cfg, tiny_weights(cfg, seed=5), device="cuda")


@pytest.fixture(scope="module")
def oracle_ids(embedded):
    tok = embedded[1]
    return [tok.encode(p) for p in RAW] + [tok.encode_chat(c) for c in CHATS]


@pytest.fixture(scope="module")
def cpu_greedy(embedded, oracle_ids):
    """kv dtype -> the CPU engine's greedy tokens for the oracle prompts (computed once)."""
    done = {}

    def get(kv: str) -> list[list[int]]:
        if kv not in done:
            gen = Generator(*embedded, EngineOptions(kv_dtype=kv))
            try:
                done[kv] = [r.token_ids for r in gen.batch_generate(oracle_ids, GREEDY)]
            finally:
                gen.close()
        return done[kv]

    return get


def _cuda_greedy(cuda_model, prompts, params=GREEDY, **options) -> tuple[list[list[int]], Generator]:
    gen = Generator(*cuda_model, EngineOptions(device="cuda", **options))
    try:
        results = gen.batch_generate(prompts, params)
    finally:
        gen.close()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return [r.token_ids for r in results], gen


def _cpu_top2_gap(model, kv: str, prompt: list[int], generated: list[int]) -> float:
    """Top-1 minus top-2 logit, on the CPU, of the token after prompt + generated, computed the
    way the engine does: the prompt in one chunk, then one token at a time (with a quantized
    cache a one-chunk prefill of everything gives different logits)."""
    cfg = model.cfg
    fmt = make_format(kv, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    ids = prompt + generated
    pool = BlockPool(fmt, -(-len(ids) // 16))
    cache, pos = PagedKVCache(pool), 0
    for n in [len(prompt)] + [1] * len(generated):
        cache.reserve(n)
        blocks, offsets = cache.slots(pos, n)
        step = Step(positions=torch.arange(pos, pos + n), write_blocks=blocks, write_offsets=offsets,
                    query_lens=[n], context_lens=[pos + n], block_tables=torch.tensor([cache.blocks]),
                    logits_rows=torch.tensor([n - 1]), is_decode=n == 1)
        logits = model.forward(torch.tensor(ids[pos:pos + n]), step, fmt, pool.store)[0]
        cache.advance(n)
        pos += n
    top = logits.topk(2).values
    return (top[0] - top[1]).item()


def _teacher_forced(model, kv: str, prompts: list[list[int]], forced: list[list[int]]) -> list[list[int]]:
    """Prefill each prompt (Model.forward on the GPU), then feed it the given tokens one step
    for all rows at a time through ModelRunner's kernel decode step (CUDA graphs); per row, the
    argmax after each forced token."""
    cfg = model.cfg
    fmt = make_format(kv, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim)
    width = -(-max(len(p) + len(f) for p, f in zip(prompts, forced, strict=True)) // 16)
    pool = BlockPool(fmt, len(prompts) * width, model.device)
    caches = _prefill(model, fmt, pool, prompts)
    runner = ModelRunner(model, fmt, pool.store, width=width)
    assert runner.kernel_attention is not None
    seqs = _sequences([p + f for p, f in zip(prompts, forced, strict=True)], caches)
    picked: list[list[int]] = [[] for _ in prompts]
    for t in range(max(len(f) for f in forced)):
        rows = [i for i, f in enumerate(forced) if t < len(f)]
        for i in rows:
            caches[i].reserve(1)
        logits = runner.run([(seqs[i], 1) for i in rows])  # seqs[i].tokens[cache.length] = forced[i][t]
        for i, top in zip(rows, logits.argmax(-1).tolist(), strict=True):
            picked[i].append(top)
            caches[i].advance(1)
    return picked


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


# ---- the decode step against Model.forward, both on the GPU ----------------------------------


@pytest.mark.parametrize("graphs", (True, False))
@pytest.mark.parametrize("kv", ("fp32", "fp16", "bf16", "fp8", "q4"))
def test_decode_step_matches_forward(tiny_cuda, kv, graphs):
    from kvgen.gpu import ops

    # Both sides read through flash_decode; they differ in the batch shape (5 rows padded to 8)
    # and kv_append vs KVFormat.write (byte-identical), so only GEMM rounding separates them.
    tol = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 5e-3}.get(kv, 2e-2)
    _compare_decode(tiny_cuda, kv, ops, graphs, atol=tol)


def test_decode_step_runs_from_graphs(tiny_cuda):
    cfg = tiny_cuda.cfg
    fmt = make_format("fp32", cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 16, "cuda")
    runner = ModelRunner(tiny_cuda, fmt, pool.store, width=8)
    caches = [PagedKVCache(pool) for _ in range(3)]
    for c in caches:
        c.reserve(1)
    runner.run([(s, 1) for s in _sequences([[7]] * 3, caches)])
    assert runner.graphs.captured == (4,)
    assert runner.seq_lens.tolist() == [1, 1, 1]  # advanced on the device, copied back from the graph
    assert pool.store["kv"][caches[2].blocks[0], :, :, 0].abs().sum() > 0  # rows written
    assert not pool.store["kv"][[b for b in range(16) if b not in {c.blocks[0] for c in caches}]].any()


# ---- Model.forward on the GPU against the CPU -----------------------------------------------


def _run_chunks(model, kv: str, window: int, ids: list[int], expect_kernels: bool) -> torch.Tensor:
    """Logits of a prefill of 10, a chunk of 7 (masked prefill), then single tokens (flash_decode;
    the torch decode path for q3 and with a sliding window): ModelRunner, the way the engine runs
    steps (on the CPU: torch attention)."""
    cfg = model.cfg
    fmt = make_format(kv, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    pool = BlockPool(fmt, 16, model.device)
    cache = PagedKVCache(pool)
    runner = ModelRunner(model, fmt, pool.store, window=window, width=16)
    assert (runner.kernel_attention is not None) == expect_kernels
    seq = _sequences([ids], [cache])[0]
    out = []
    for n in [10, 7] + [1] * (len(ids) - 17):
        cache.reserve(n)
        out.append(runner.run([(seq, n)])[0])
        cache.advance(n)
    return torch.stack(out)


@pytest.mark.parametrize(("kv", "window"), (("fp32", 0), ("fp16", 0), ("fp32", 8)))
def test_forward_on_cuda_matches_cpu(embedded, cuda_model, kv, window):
    cpu, tok = embedded
    ids = tok.encode("The capital of France is Paris, the capital of Germany is Berlin, and the capital of "
                     "Italy is Rome. The capital of Spain is")
    assert len(ids) > 24
    want = _run_chunks(cpu, kv, window, ids, expect_kernels=False)
    got = _run_chunks(cuda_model[0], kv, window, ids, expect_kernels=not window)
    # fp32: summation order only. Stored K/V can round either way where the GPU's value is a
    # last bit off the CPU's (one fp16 ulp); a misread block would be O(1).
    tol = {"fp32": 2e-3, "fp16": 5e-2}[kv]
    err = (got.cpu() - want).abs().max().item()
    assert err < tol, f"max |logit diff| {err}"


@pytest.mark.parametrize("kv", ("q4", "q3"))
def test_quantized_forward_on_cuda_matches_cpu(tiny_cuda, kv):
    """q4 / q3 on a 2-layer model. On the embedded model's 30 layers a last-bit difference
    flips a key code, the block's per-channel key scales re-encode it, and the flips compound:
    on the CPU alone, embeddings perturbed by 3e-7 (relative) moved its q4 logits by up to 2.2
    and q3's by up to 5.3, while a block zeroed after the prefill moved them by 8 -- too close
    to tell a misread from rounding (H100 against the CPU: 1.0 and 4.4). Two layers amplify
    little: perturbed by 1e-5 (far more than GPU vs CPU fp32), this model's logits moved by at
    most 0.08 (q4) and 0.003 (q3) of a std of 6."""
    cpu = Model(tiny_cuda.cfg, tiny_weights(tiny_cuda.cfg, seed=5))
    ids = torch.randint(0, tiny_cuda.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    want = _run_chunks(cpu, kv, 0, ids, expect_kernels=False)
    got = _run_chunks(tiny_cuda, kv, 0, ids, expect_kernels=kv != "q3")
    err = (got.cpu() - want).abs().max().item()
    assert err < 0.25, f"max |logit diff| {err}"


# ---- greedy generation, CUDA engine against the CPU engine ------------------------------------


@pytest.mark.parametrize("kv", ("fp32", "fp16", "bf16"))
def test_greedy_matches_cpu(embedded, cuda_model, oracle_ids, cpu_greedy, kv):
    """Against the CPU engine with the same KV format (for fp16 / bf16 both store the same
    rounded K/V, give or take one ulp where the GPU's fp32 value sits on a rounding edge)."""
    want = cpu_greedy(kv)
    got, gen = _cuda_greedy(cuda_model, oracle_ids, kv_dtype=kv)
    assert gen.engine.runner.graphs is not None and gen.engine.runner.graphs.captured
    for ids, a, b in zip(oracle_ids, got, want, strict=True):
        assert len(a) == N_NEW
        i = _first_difference(a, b)
        if i is None:
            continue
        gap = _cpu_top2_gap(embedded[0], kv, ids, b[:i])
        assert gap < 1e-2, (f"{kv}: token {i} differs ({a[i]} on CUDA, {b[i]} on the CPU) where the CPU's "
                            f"top-2 gap is {gap:.4f}: not a near-tie. {embedded[1].decode(ids)!r}")


@pytest.mark.parametrize("kv", ("fp8", "q4"))
def test_quantized_kv_mostly_agrees_with_cpu(embedded, cuda_model, oracle_ids, cpu_greedy, kv):
    """fp8 / q4 amplify last-bit differences (a value on a rounding edge takes the other code,
    fp8 block scales follow), and free-running greedy paths part for good at the first flip:
    on the CPU alone, batched against one-at-a-time runs already part within a few tokens for
    most q4 prompts. So the check is teacher-forced: the CUDA engine's step (ModelRunner), fed
    the CPU's tokens, picks the CPU's next token at most steps (on the CPU, the same check with
    reference kernels and prompts prefilled one by one instead of together: fp8 96%, q4 94%:
    an fp8 block's scale is its absmax, so a last-bit change there moves every code of the
    block). Free-running agreement is printed (-s) as a report."""
    want = cpu_greedy(kv)
    picked = _teacher_forced(cuda_model[0], kv, oracle_ids, [w[:-1] for w in want])
    steps = sum(len(p) for p in picked)
    same = sum(x == y for p, w in zip(picked, want, strict=True) for x, y in zip(p, w[1:], strict=True))
    print(f"{kv}: teacher-forced, CUDA picks the CPU's token at {same}/{steps} steps")
    got, _ = _cuda_greedy(cuda_model, oracle_ids, kv_dtype=kv)
    parts = [_first_difference(a, b) for a, b in zip(got, want, strict=True)]
    agree = [N_NEW if i is None else i for i in parts]
    print(f"{kv}: free-running, tokens before the first difference per prompt: {agree} of {N_NEW}")
    assert same >= 0.85 * steps


# ---- graphs on == graphs off -------------------------------------------------------------------


@pytest.mark.parametrize("kv", ("fp32", "fp8"))
@pytest.mark.parametrize("batch", (1, 3, 8, 100))
def test_graphs_on_equals_off(cuda_model, oracle_ids, kv, batch):
    pool = oracle_ids + [oracle_ids[0][:3]]
    prompts = [pool[i % len(pool)] for i in range(batch)]
    # different lengths: the batch shrinks as sequences finish, crossing buckets
    params = [SamplingParams(temperature=0, max_new_tokens=max(1, N_NEW - 3 * i % N_NEW), ignore_eos=True)
              for i in range(batch)]
    on, gen_on = _cuda_greedy(cuda_model, prompts, params, kv_dtype=kv, cuda_graphs=True, max_running=128)
    off, gen_off = _cuda_greedy(cuda_model, prompts, params, kv_dtype=kv, cuda_graphs=False, max_running=128)
    assert gen_on.engine.runner.graphs.captured and not gen_off.engine.runner.graphs.captured
    assert {1: 1, 3: 4, 8: 8, 100: 128}[batch] in gen_on.engine.runner.graphs.captured
    assert gen_on.engine.device_argmax  # plain greedy rows: argmaxes taken on the GPU
    assert on == off


def test_a_session_on_cuda_continues_as_one_request(cuda_model):
    """A raw session's second turn computes only its new tokens over the first turn's cached KV, and
    gives the tokens a fresh request of the whole conversation gives."""
    tok = cuda_model[1]
    first_ids, second_ids = tok.encode("The history of the printing press"), tok.encode(" In short,")
    gen = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=64, kv_dtype="fp32", prefix_cache=False))
    try:
        s = gen.new_session()
        first = s.generate(first_ids, GREEDY)
        second = s.generate(second_ids, GREEDY)
        assert second.usage.cached_tokens >= len(first_ids) + N_NEW - 1
        fresh = gen.generate(first_ids + first.token_ids + second_ids, GREEDY)
        assert fresh.usage.cached_tokens == 0
        assert second.token_ids == fresh.token_ids
    finally:
        gen.close()


def test_auto_weights_on_cuda_are_bf16_for_a_bf16_folder(tmp_path):
    """WEIGHT_DTYPE auto on CUDA: an HF bf16 folder runs bf16 (half the bytes a step reads) through
    the kernel decode step."""
    from tests.tiny import tiny_bpe_tokenizer, write_hf_folder

    cfg = tiny_config(layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=300, context=256)
    write_hf_folder(tmp_path, cfg, {k: v.to(torch.bfloat16) for k, v in tiny_weights(cfg, seed=9).items()},
                    tiny_bpe_tokenizer(300))
    model, tok = load_model(str(tmp_path), "auto", "cuda")
    assert model.weight_dtype == "bf16" and model.act_dtype == torch.bfloat16
    gen = Generator(model, tok, EngineOptions(device="cuda", kv_cache_mb=32))
    try:
        assert gen.engine.runner.decode_path == "cuda-kernels"
        assert len(gen.generate(tok.encode("hello there"), GREEDY).token_ids) == N_NEW
        assert gen.engine.runner.graphs.captured
    finally:
        gen.close()


# ---- the prefix cache and constrained decoding on CUDA ------------------------------------------


def test_prefix_cache_on_cuda(cuda_model):
    tok = cuda_model[1]
    system = tok.encode("You are a careful assistant. Answer briefly and cite the manual. " * 12)
    prompts = [system + tok.encode(f" Question {q}: what is in section {q}?") for q in ("one", "two")]
    on = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=64))
    off = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=64, prefix_cache=False))
    try:
        first, second = (on.generate(p, GREEDY) for p in prompts)
        assert first.usage.cached_tokens == 0
        assert second.usage.cached_tokens >= len(system) // 16 * 16 - 16
        assert on.scheduler.kv.prefix.stats.hits >= 1
        assert second.token_ids == off.generate(prompts[1], GREEDY).token_ids
    finally:
        on.close()
        off.close()


def test_constrained_json_on_cuda(cuda_model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=64,
                            constraint=Constraint("json_schema", json.dumps(schema)))
    gen = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=64))
    try:
        gen.bridge.run(gen.compile(params))
        out = gen.batch_generate([[{"role": "user", "content": "Describe Paris as JSON."}]] * 3
                                 + ["The capital of France is"], [params] * 3 + [GREEDY])
        for r in out[:3]:
            value = json.loads(r.text)
            assert set(value) == {"city", "population"} and isinstance(value["population"], int)
            assert r.finish_reason.name == "STOP_TOKEN"
        assert len(out[3].token_ids) == N_NEW  # the unconstrained row in the same batch
    finally:
        gen.close()


def test_kv_compression_on_cuda(cuda_model):
    """KV_COMPRESS on CUDA: a compressed table's steps run torch attention (the kernels read `length` rows
    of a block table, which a compressed one no longer holds), the rest the kernels. A long prompt's
    compressed request and an exact one in the same batch both finish, the first through compression."""
    tok = cuda_model[1]
    long = tok.encode("The printing press spread across Europe within decades. " * 40)[:320]
    gen = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=64, kv_dtype="fp32", prefix_cache=False,
                                               kv_compress="sink-heavy", kv_compress_window=64))
    try:
        assert gen.kv_compress_unsupported == ""
        compressed: dict[int, int] = {}  # each sequence's most compressed rows, seen at its steps

        def on_step(batch, dt):
            for seq, _ in batch:
                compressed[id(seq)] = max(compressed.get(id(seq), 0), seq.cache.kv_start)

        gen.engine.on_step = on_step
        out = run_together(gen, [(long, GREEDY, {}), (long[:100], GREEDY, {"kv_compress": KVCompression("off")})])
        assert [len(r.token_ids) for r in out] == [N_NEW, N_NEW]
        assert sorted(compressed.values()) == [0, max(compressed.values())] and max(compressed.values()) > 0
    finally:
        gen.close()



@pytest.mark.parametrize("mode", ("ngram", "draft", "eagle"))
def test_speculative_decoding_on_cuda_equals_plain(cuda_model, oracle_ids, mode, tmp_path):
    """Prompt lookup, a draft model (the target itself: every draft is kept, so every check
    verifies k + 1 tokens over the paged cache) and an EAGLE head (a random one: it reads the
    target's hidden states from the CUDA steps, and keeps few drafts) on CUDA: the greedy tokens
    of the oracle prompts, 4 streams at a time, equal plain decoding on CUDA; drafts were made
    (and kept, but for the random head). (The draft model also takes fewer steps; prompt lookup
    keeps drafts for some prompts only, and a batch of 4 takes as many steps as its slowest
    stream: 64 both ways on an H100.)"""
    head = ""
    if mode == "eagle":
        head = str(tmp_path / "head.safetensors")
        save_file(eagle_head(cuda_model[0].cfg), head)
    plain = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=256))
    spec = Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=256, speculative=mode, eagle_head=head),
                     draft_model=cuda_model[0] if mode == "draft" else None)
    try:
        tokens = {}
        for gen in (plain, spec):
            tokens[gen] = []
            for i in range(0, len(oracle_ids), 4):
                out = gen.batch_generate(oracle_ids[i:i + 4], GREEDY)
                assert not any(isinstance(r, Exception) for r in out), out
                tokens[gen] += [r.token_ids for r in out]
        assert tokens[spec] == tokens[plain]
        assert spec.engine.drafted_tokens > 0
        if mode != "eagle":
            assert spec.engine.accepted_tokens > 0
        if mode == "draft":
            assert spec.engine.steps < plain.engine.steps
    finally:
        plain.close()
        spec.close()


# ---- the server --------------------------------------------------------------------------------


def test_model_info_reports_cuda(cuda_model):
    from kvgen.v1 import generate_pb2 as pb
    from kvgen.v1 import generate_pb2_grpc as pb_grpc
    from tests.conftest import ServerThread

    s = ServerThread(Generator(*cuda_model, EngineOptions(device="cuda", kv_cache_mb=64)))
    try:
        with s.channel() as ch:
            stub = pb_grpc.GeneratorStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).device.startswith("cuda")
            r = stub.Generate(pb.GenerateRequest(prompt="The capital of France is",
                                                 sampling=pb.SamplingParams(temperature=0, max_new_tokens=8)))
            assert len(r.token_ids) > 0
    finally:
        s.stop()
