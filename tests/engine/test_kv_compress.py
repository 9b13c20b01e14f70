"""KV_COMPRESS (kvgen/engine/kv/compress.py) on a tiny real model through the whole engine: rows
older than the window are pooled (mean) or picked (sink-heavy) into fewer blocks; the prefix cache
only ever shares exact blocks; sessions, tiers, preemption and cancellation keep working; with
compression off (or never due) the output is what it was."""

from __future__ import annotations

import pytest
import torch

from kvgen.engine.generator import EngineOptions, Generator
from kvgen.engine.kv.compress import CHUNK_BLOCKS, SINKS, KVCompression
from kvgen.engine.model import Model
from kvgen.engine.sampling import SamplingParams
from kvgen.engine.tokenizer import TextTokenizer
from tests.conftest import run_together
from tests.tiny import CHATML_TEMPLATE, tiny_bpe_tokenizer, tiny_config, tiny_weights

BS = 16
WINDOW = 64
TEXT = "the cat sat on a mat and then the dog ran to the cat while it sat on the mat again "


def _model(context: int = 1024):
    tok = TextTokenizer(tiny_bpe_tokenizer(300), CHATML_TEMPLATE, bos_id=None, add_bos=False,
                        special_ids={0, 1, 2}, eos_token="<|im_end|>")
    cfg = tiny_config(vocab=300, layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, context=context)
    return Model(cfg, tiny_weights(cfg, seed=23)), tok


MODEL, TOK = _model()
PROMPT = TOK.encode(TEXT * 12)[:400]


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kw)


def _gen(method: str = "off", **kw) -> Generator:
    opts = dict(kv_dtype="fp32", kv_compress=method, kv_compress_window=WINDOW)
    opts.update(kw)
    return Generator(MODEL, TOK, EngineOptions(**opts))


def _rows(gen: Generator, blocks: list[int], n: int, layer: int = 0) -> torch.Tensor:
    """Layer `layer`'s K/V of the first n rows held in `blocks`: [2, n, kv heads, head dim]."""
    x = gen.pool.store["kv"][torch.tensor(blocks)][:, layer]  # [blocks, 2, BS, KVH, HD]
    return x.permute(1, 0, 2, 3, 4).reshape(2, -1, *x.shape[-2:])[:, :n].clone()


def _exact_kv(ids: list[int]) -> torch.Tensor:
    """Layer 0's K/V of ids from an uncompressed prefill: [2, len(ids), kv heads, head dim]."""
    gen = _gen(prefix_cache=False)
    try:
        s = gen.new_session()
        s.generate(ids, greedy(1))
        return _rows(gen, s.cache.blocks, len(ids))
    finally:
        gen.close()


@pytest.mark.parametrize("method", ["mean", "sink-heavy"])
def test_each_method_holds_fewer_blocks_per_token(method):
    """A 400-token prompt + 16 tokens: everything older than the 64-token window, in whole chunks
    of 4 blocks, is held in half the rows; the window stays exact."""
    gen = _gen(method, prefix_cache=False)
    try:
        s = gen.new_session()
        s.generate(PROMPT, greedy())
        c = s.cache
        n = c.length
        assert n == len(PROMPT) + 15  # the last token is not cached yet
        chunk = CHUNK_BLOCKS * BS
        assert c.compressed_to == (n - WINDOW) // chunk * chunk == 320
        assert c.removed == c.compressed_to // 2 and c.rows == n - 160
        held = len([b for b in c.blocks if b >= 0])
        assert held == -(-c.rows // BS) == 16  # uncompressed: 26 blocks
        assert held / n < 0.65 * -(-n // BS) / n
        # layer 0's K/V do not depend on attention: the compressed rows are exactly the method's
        # rows of an uncompressed prefill's, and the rows after them are the uncompressed rows
        exact = _exact_kv(s.tokens[:n])
        got = _rows(gen, c.blocks, c.rows)
        old = exact[:, :c.compressed_to]
        if method == "mean":
            want = old.reshape(2, -1, 2, *old.shape[-2:]).mean(2)
            torch.testing.assert_close(got[:, :160], want, rtol=1e-5, atol=1e-6)
        else:
            for chunk_at in range(0, c.compressed_to, chunk):
                part, kept = old[:, chunk_at:chunk_at + chunk], got[:, chunk_at // 2:(chunk_at + chunk) // 2]
                norms = part[0].norm(dim=-1)  # [64, KVH]
                for h in range(part.shape[2]):
                    rows = [(part[0, :, h] - kept[0, j, h]).abs().sum(-1).argmin().item() for j in range(32)]
                    torch.testing.assert_close(kept[:, :, h], part[:, rows, h])  # rows of the chunk, unchanged
                    assert rows == sorted(rows) and len(set(rows)) == 32
                    must = list(range(SINKS)) if chunk_at == 0 else []
                    assert all(r in rows for r in must)  # the attention sinks
                    rest = [r for r in range(chunk) if r not in rows]
                    free = [r for r in rows if r not in must]
                    assert norms[free, h].max() <= norms[rest, h].min()  # the lowest key norms
        torch.testing.assert_close(got[:, 160:], exact[:, c.compressed_to:])
    finally:
        gen.close()


def test_off_and_never_due_are_todays_output():
    """Compression off, and compression on with a window longer than the sequence (never due),
    give the same greedy tokens and logprobs as each other, and touch nothing."""
    params = greedy(24, logprobs=3)
    outs = []
    for method, window in (("off", WINDOW), ("mean", 4096), ("sink-heavy", 4096)):
        gen = _gen(method, kv_compress_window=window)
        try:
            s = gen.new_session()
            outs.append(s.generate(PROMPT, params))
            assert s.cache.removed == 0 and s.cache.rows == s.cache.length
        finally:
            gen.close()
    for out in outs[1:]:
        assert out.token_ids == outs[0].token_ids
        assert [a.top for a in out.logprobs] == [b.top for b in outs[0].logprobs]


def test_a_compressed_sequence_generates_what_it_attends_to():
    """The compressed rows are read: a compressed request's logits differ from the uncompressed
    one's (and mean differs from sink-heavy), its tokens are all there."""
    lps = {}
    for method in ("off", "mean", "sink-heavy"):
        gen = _gen(method, prefix_cache=False)
        try:
            out = gen.generate(PROMPT, greedy(8, logprobs=3))
            assert len(out.token_ids) == 8
            lps[method] = torch.tensor([[x for _, x in a.top] for a in out.logprobs])
        finally:
            gen.close()
    assert not torch.equal(lps["off"], lps["mean"]) and not torch.equal(lps["mean"], lps["sink-heavy"])


@pytest.mark.parametrize("method", ["mean", "sink-heavy"])
def test_the_prefix_cache_never_shares_a_compressed_block(method):
    """A long request indexes its prompt blocks while they are exact, then compresses into blocks
    of its own: a second request with the same prompt shares only exact blocks (equal to an
    uncompressed prefill's, every layer), none of the compressed ones."""
    gen = _gen(method)
    events = []
    gen.scheduler.kv.listen(lambda ev: events.append((ev.name, list(ev.blocks or []), dict(ev.attrs))))
    try:
        gen.generate(PROMPT, greedy())
        assert any(name == "kv.compress" and attrs["rows_after"] < attrs["rows_before"] for name, _, attrs in events)
        events.clear()
        second = gen.generate(PROMPT, greedy())
        hits = [blocks for name, blocks, _ in events if name == "kv.prefix_hit"]
        assert hits and second.usage.cached_tokens >= 384
        shared = hits[0][:24]  # the whole blocks before the prompt's last token, which the request computes
        # every shared block holds a fresh, uncompressed prefill's K/V of its tokens, every layer
        ref = _gen(prefix_cache=False)
        try:
            s = ref.new_session()
            s.generate(PROMPT, greedy(1))
            for layer in range(MODEL.cfg.num_layers):
                torch.testing.assert_close(_rows(gen, shared, len(shared) * BS, layer),
                                           _rows(ref, s.cache.blocks, len(shared) * BS, layer), rtol=0, atol=0)
        finally:
            ref.close()
    finally:
        gen.close()


def test_a_compressed_table_is_never_indexed():
    from kvgen.engine.kv.prefix import PrefixCache

    gen = _gen("mean")
    try:
        s = gen.new_session()
        s.generate(PROMPT, greedy())
        assert s.cache.compressed_to
        prefix: PrefixCache = gen.scheduler.kv.prefix
        assert prefix.insert("other salt", s.tokens, s.cache) == 0
    finally:
        gen.close()


@pytest.mark.parametrize("method", ["mean", "sink-heavy"])
def test_a_compressed_session_keeps_its_rows_turn_after_turn(method):
    """Each turn reuses the whole compressed history (cached_tokens = the history), compresses
    what left the window, and a session whose blocks went to the warm tier between turns gives
    the same tokens as one whose blocks stayed."""
    outs = []
    for demote in (False, True):
        gen = _gen(method, prefix_cache=False)
        try:
            s = gen.new_session()
            turns, last = [], 0
            for turn in range(4):
                if demote and s.cache.length:
                    for i in range(-(-s.cache.rows // BS)):
                        gen.tiers.demote(s.cache, i)
                    assert gen.tiers.parked(s.cache)
                out = s.generate(PROMPT[:150] if turn == 0 else TOK.encode(f" turn {turn} ") + PROMPT[:100],
                                 greedy())
                assert out.usage.cached_tokens == last  # the history's rows were all kept
                last = s.cache.length
                assert s.cache.compressed_to >= s.cache.length - WINDOW - CHUNK_BLOCKS * BS
                turns.append(out.token_ids)
            assert s.cache.rows < s.cache.length - 200
            assert not gen.tiers.parked(s.cache)
            outs.append(turns)
        finally:
            gen.close()
    assert outs[0] == outs[1]


def test_a_preempted_compressed_sequence_recomputes_and_blocks_come_back():
    """Two long requests in a pool too small for both: one is preempted (its compressed rows go
    back, it is recomputed from its tokens and compressed again) and both finish; then, and after
    a cancellation midway, every block is back in the pool."""
    gen = _gen("mean", prefix_cache=False, kv_cache_mb=0.625, token_budget=128)  # 40 blocks
    try:
        # each needs 40 blocks uncompressed, ~24 compressed at its end: together they do not fit
        outs = run_together(gen, [(PROMPT, greedy(230), {}), (list(reversed(PROMPT)), greedy(230), {})])
        assert all(len(o.token_ids) == 230 for o in outs)
        assert gen.scheduler.preemptions > 0
        assert gen.pool.used == 0
        stream = gen.generate_stream(PROMPT, greedy(230))
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
        gen.bridge.run(_quiet(gen))
        assert gen.pool.used == 0
    finally:
        gen.close()



async def _quiet(gen):
    import asyncio

    for _ in range(500):
        if gen.engine.idle and gen.pool.used == 0:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("method", ["mean", "sink-heavy"])
def test_on_the_kernel_path_a_compressed_table_steps_through_torch_attention(method):
    """On a GPU the decode kernels read `length` rows from a block table, which a compressed table no
    longer holds: its steps go to torch attention (model_runner), the others' to the kernels. Here the
    kernels are model_runner's torch references (tests/engine/test_model_runner.py), so the path runs on
    the CPU: the same tokens as the CPU engine, and the kernels took the steps before compression only."""
    from kvgen.engine.model_runner import ModelRunner
    from tests.engine.test_model_runner import RefKernels

    class Counted(RefKernels):
        starts: list[int] = []

    def run(swap: bool) -> list[int]:
        gen = _gen(method, prefix_cache=False)
        try:
            if swap:
                runner = ModelRunner(MODEL, gen.pool.fmt, gen.pool.store, width=64, kernels=Counted)
                seen = runner._decode_with_kernels
                runner._decode_with_kernels = lambda batch: (
                    Counted.starts.extend(seq.cache.kv_start for seq, _ in batch), seen(batch))[1]
                gen.engine.runner = runner
            return gen.generate(PROMPT[:WINDOW + 40], greedy(40)).token_ids
        finally:
            gen.close()

    assert run(True) == run(False)
    assert Counted.starts and set(Counted.starts) == {0}  # the kernels took uncompressed steps only
    assert len(Counted.starts) < 40  # and the compressed ones went to torch attention


def test_what_it_cannot_serve_is_refused_at_start():
    with pytest.raises(ValueError, match="KV_DTYPE"):
        _gen("mean", kv_dtype="q4")
    with pytest.raises(ValueError, match="sliding window"):
        _gen("mean", attention_window=128)
    with pytest.raises(ValueError, match="expected one of"):
        _gen("h2o")


# per request: a request (or a session) chooses its own KV compression, the server's by default


def _run(gen: Generator, *requests: tuple[list[int], KVCompression | None], n: int = 16) -> list:
    """The requests submitted together (one engine batch), each one's events added up."""
    return run_together(gen, [(ids, greedy(n, logprobs=2), {"kv_compress": choice}) for ids, choice in requests])


def _same(a, b, exact: bool = True) -> None:
    """Same tokens, and the same logprobs: bit for bit, or (not exact: a compressed request runs
    through Model.forward, whose batched rows may round differently alone) to float32 rounding."""
    assert a.token_ids == b.token_ids
    if exact:
        assert [x.top for x in a.logprobs] == [y.top for y in b.logprobs]
    else:
        assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in y.top] for y in b.logprobs]
        torch.testing.assert_close(torch.tensor([[v for _, v in x.top] for x in a.logprobs]),
                                   torch.tensor([[v for _, v in y.top] for y in b.logprobs]), rtol=0, atol=1e-4)


def test_a_batch_mixes_a_compressed_and_an_exact_request():
    """On a plain server, a request asking for mean compression runs in one batch with exact
    requests, one of the same prompt (it shares the compressed request's prompt blocks through the
    prefix cache, in the batch, as does a request after it). The exact requests' outputs are a plain
    server's, bit for bit, with the same calls all exact; the compressed one's are its own alone
    and a KV_COMPRESS=mean server's (tokens; logprobs to float32 rounding: its rows run through
    Model.forward, batched differently); only its table was compressed."""
    mean = KVCompression("mean", window=WINDOW)
    other = list(reversed(PROMPT))
    outs = {}
    for name, choice in (("mixed", mean), ("plain", None)):
        gen = _gen()
        tables = []
        gen.scheduler.kv.listen(lambda ev, t=tables: t.append(ev.table) if ev.name == "kv.compress" else None)
        try:
            batch = _run(gen, (PROMPT, choice), (PROMPT, None), (other, KVCompression("off")))
            after = _run(gen, (PROMPT, None))[0]
            alone = _run(gen, (PROMPT, choice))[0]
            assert batch[1].usage.cached_tokens > 0 and after.usage.cached_tokens >= 384  # shared prompt blocks
            assert len(set(map(id, tables))) == (2 if choice else 0)  # the compressed request's, twice
            outs[name] = batch, after, alone
        finally:
            gen.close()
    server = _gen("mean")
    try:
        server_compressed = _run(server, (PROMPT, None))[0]
    finally:
        server.close()
    (mixed, mixed_after, alone), (plain, plain_after, _) = outs["mixed"], outs["plain"]
    # Once compressed, the compressed row leaves the fused decode step (model_runner: kv_start != 0),
    # so the fused step runs 2 rows where the plain server's runs 3, which rounds its last bits
    # differently: the exact requests' logprobs agree to 1e-4, a hundred times closer than what
    # compression moves (below), which reading one pooled block would show.
    for got, want in ((mixed[1], plain[1]), (mixed[2], plain[2]), (mixed_after, plain_after)):
        _same(got, want, exact=False)
    assert mixed_after.token_ids == plain_after.token_ids
    moved = (_top_values(mixed[0]) - _top_values(plain[0])).abs().max().item()
    assert moved > 1e-2  # compression moved the compressed request's logprobs
    _same(mixed[0], alone, exact=False)
    _same(server_compressed, alone, exact=False)


def _top_values(ev) -> torch.Tensor:
    return torch.tensor([[v for _, v in x.top] for x in ev.logprobs])


def test_exact_requests_on_a_compressing_server():
    """On a KV_COMPRESS=sink-heavy server, a request asking for off keeps every row (and equals a
    plain server's), in a batch with one that compresses by the server's setting."""
    gen = _gen("sink-heavy")
    tables = []
    gen.scheduler.kv.listen(lambda ev: tables.append(ev.table) if ev.name == "kv.compress" else None)
    try:
        got = _run(gen, (PROMPT, KVCompression("off")), (list(reversed(PROMPT)), None))
        assert len(set(map(id, tables))) == 1
    finally:
        gen.close()
    plain = _gen()
    try:
        _same(got[0], _run(plain, (PROMPT, None))[0], exact=False)  # the fused step ran 1 row, not 2
    finally:
        plain.close()


def test_a_session_keeps_its_compression_turn_after_turn():
    """A session created with sink-heavy compression on a plain server compresses every turn (as a
    KV_COMPRESS=sink-heavy server's session does, token for token); a turn may name the same
    compression, not another."""
    from kvgen.errors import InvalidRequest

    heavy = KVCompression("sink-heavy", window=WINDOW)
    outs = []
    for server, choice in (("off", heavy), ("sink-heavy", None)):
        gen = _gen(server, prefix_cache=False)
        try:
            s = gen.new_session(kv_compress=choice)
            turns = []
            for turn in range(3):
                prompt = PROMPT[:200] if turn == 0 else TOK.encode(f" turn {turn} ") + PROMPT[:100]
                out = gen.bridge.run(gen.collect(s.request(prompt, greedy(), kv_compress=choice)))
                turns.append(out.token_ids)
            assert s.cache.removed > 0
            with pytest.raises(InvalidRequest) as e:
                gen.bridge.run(gen.collect(s.request(" more", greedy(), kv_compress=KVCompression("mean"))))
            assert e.value.violations[0][0] == "kv_compress"
            outs.append(turns)
        finally:
            gen.close()
    assert outs[0] == outs[1]


def test_what_a_request_cannot_ask_for_is_refused_naming_its_field():
    from kvgen.errors import InvalidRequest

    def refused(gen, choice) -> list[tuple[str, str]]:
        with pytest.raises(InvalidRequest) as e:
            gen.bridge.run(gen.collect(gen.request(PROMPT[:20], greedy(2), kv_compress=choice)))
        return e.value.violations

    q4 = _gen(kv_dtype="q4")
    try:
        [(field, why)] = refused(q4, KVCompression("mean"))
        assert field == "kv_compress" and "KV_DTYPE" in why and "q4" in why
        assert q4.kv_compress_unsupported
        assert len(_run(q4, (PROMPT[:20], KVCompression("off")), n=2)[0].token_ids) == 2  # off is fine anywhere
    finally:
        q4.close()
    plain = _gen()
    try:
        assert plain.kv_compress_unsupported == ""
        assert refused(plain, KVCompression("h2o"))[0][0] == "kv_compress"
        assert refused(plain, KVCompression("mean", ratio=0.3))[0][0] == "kv_compress_ratio"
        assert refused(plain, KVCompression("mean", window=-1))[0][0] == "kv_compress_window"
        with pytest.raises(InvalidRequest):
            plain.new_session(kv_compress=KVCompression("h2o"))
        assert not plain.sessions
    finally:
        plain.close()
