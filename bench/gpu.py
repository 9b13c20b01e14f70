"""Flash-decode bandwidth on a GPU: writes bench/results/gpu-<device name>.md.

For batch 1..64 x context 512..32k (one layer, 32 query heads over 8 KV heads of 128 dims,
16-token blocks scattered through the pool), times kvgen.gpu.ops.flash_decode and reports the
KV bytes it must read (the format's bytes per token incl. scales, x batch x context) per
second as a percentage of the device-to-device copy bandwidth measured in the same run
(bytes read + written per second by a 1 GiB tensor copy). Next to it: torch's
scaled_dot_product_attention on the same K/V gathered into dense fp16 [B, KVH, ctx, HD]
(gathered outside the timing, so SDPA is shown its best case: contiguous memory), and the same SDPA
on the paged data as a torch server runs it: the blocks gathered (and dequantized) each call, then SDPA.

Timing: CUDA events around `iters` back-to-back calls after `warmup` calls; the median of
`repeats` such runs; each call a CUDA-graph replay of the op (as the engine's decode step runs
it), and the eager call beside it. The engine's decode tokens/s section is added by the lead later.

    .venv/bin/python bench/gpu.py [--formats fp16,fp8,q4] [--batches 1,4,16,64]
        [--contexts 512,4096,32768] [--check] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def _time_ms(fn, warmup: int, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean time (ms) of `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), warmup=3, iters=10, repeats=5)
    return 2 * nbytes / (ms * 1e-3)


def _graphed(fn):
    """fn captured in a CUDA graph, returned as its replay: how the engine runs a decode step,
    so host launch overhead (CuPy's, torch's) stays out of the kernel's time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _fill_random(fmt, store: dict[str, torch.Tensor]) -> None:
    """Plausible random cache contents without going through a write per token."""
    if fmt.name in ("fp32", "fp16", "bf16"):
        store["kv"].normal_()
    elif fmt.name == "fp8":
        codes = torch.randint(0, 0x7F, store["kv"].shape, dtype=torch.uint8, device="cuda")  # no nan code
        codes |= torch.randint(0, 2, store["kv"].shape, dtype=torch.uint8, device="cuda") << 7
        store["kv"].view(torch.uint8).copy_(codes)
        store["scale"].uniform_(0.001, 0.01)
    elif fmt.name == "q4":
        store["q"].random_(0, 256)
        store["vscale"].uniform_(0.05, 0.5)
        store["kscale"].uniform_(0.05, 0.5)
    else:
        raise ValueError(fmt.name)


def bench_case(name: str, batch: int, ctx: int, args, copy_bw: float) -> dict | None:
    from kvgen.engine.kv.formats import make_format
    from kvgen.gpu import ops

    bs, kvh, heads, hd = args.block_size, args.kv_heads, args.heads, args.head_dim
    fmt = make_format(name, 1, bs, kvh, hd, compute_dtype=torch.float16)
    blocks_per_seq = -(-ctx // bs)
    n_blocks = batch * blocks_per_seq
    kv_bytes = batch * ctx * fmt.bytes_per_token_per_layer()
    dense_bytes = batch * ctx * 2 * kvh * hd * 2  # the fp16 K and V SDPA reads
    free, _ = torch.cuda.mem_get_info()
    if n_blocks * fmt.bytes_per_block() + dense_bytes * 1.2 > 0.85 * free:
        return None  # does not fit next to the gathered copy

    store = fmt.allocate(n_blocks, "cuda")
    _fill_random(fmt, store)
    tables = torch.randperm(n_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, hd, device="cuda", dtype=torch.float16)
    splits = ops.choose_num_splits(batch, kvh, heads, blocks_per_seq * bs, bs,
                                   torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.empty_like(q)

    def fd():
        ops.flash_decode(q, fmt, store, 0, tables, ctx_lens, splits, out=out)

    fd_eager_ms = _time_ms(fd, args.warmup, args.iters, args.repeats)
    fd_ms = _time_ms(_graphed(fd), args.warmup, args.iters, args.repeats)

    # SDPA on the same data, gathered to dense fp16 once, a sequence at a time (not timed).
    k = torch.empty(batch, kvh, ctx, hd, dtype=torch.float16, device="cuda")
    v = torch.empty_like(k)
    for b in range(batch):
        kb, vb = fmt.read(store, 0, tables[b].long())  # [blocks, BS, KVH, HD]
        k[b] = kb.reshape(-1, kvh, hd)[:ctx].transpose(0, 1)
        v[b] = vb.reshape(-1, kvh, hd)[:ctx].transpose(0, 1)
        del kb, vb
    check = None
    if args.check:
        check = 0.0
        for i in range(batch):  # a row at a time: fp32 copies of the whole batch may not fit
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 1, :, None].float(), k[i:i + 1].float(), v[i:i + 1].float(), enable_gqa=True)[:, :, 0]
            check = max(check, (out[i:i + 1].float() - ref).abs().max().item())
    q4d = q[:, :, None]

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q4d, k, v, enable_gqa=True)

    sdpa_eager_ms = _time_ms(sdpa, args.warmup, args.iters, args.repeats)
    sdpa_ms = _time_ms(_graphed(sdpa), args.warmup, args.iters, args.repeats)
    ids = tables.long().flatten()

    def paged_sdpa():  # what a torch server does with paged K/V: gather (and dequantize) the blocks, then SDPA
        kb, vb = fmt.read(store, 0, ids)
        kd = kb.reshape(batch, -1, kvh, hd)[:, :ctx].transpose(1, 2)
        vd = vb.reshape(batch, -1, kvh, hd)[:, :ctx].transpose(1, 2)
        torch.nn.functional.scaled_dot_product_attention(q4d, kd.to(q.dtype), vd.to(q.dtype), enable_gqa=True)

    try:
        paged_ms = _time_ms(_graphed(paged_sdpa), args.warmup, args.iters, args.repeats)
    except RuntimeError:  # not capturable: eager
        torch.cuda.synchronize()
        paged_ms = _time_ms(paged_sdpa, args.warmup, args.iters, args.repeats)
    return {
        "format": name, "batch": batch, "context": ctx, "splits": splits,
        "fd_us": fd_ms * 1e3, "fd_eager_us": fd_eager_ms * 1e3, "kv_mb": kv_bytes / 1e6,
        "fd_gbs": kv_bytes / (fd_ms * 1e-3) / 1e9, "fd_pct": 100 * kv_bytes / (fd_ms * 1e-3) / copy_bw,
        "sdpa_us": sdpa_ms * 1e3, "sdpa_eager_us": sdpa_eager_ms * 1e3,
        "sdpa_pct": 100 * dense_bytes / (sdpa_ms * 1e-3) / copy_bw, "max_err": check, "paged_us": paged_ms * 1e3,
    }


def render(rows: list[dict], device: str, copy_bw: float, args) -> str:
    lines = [
        f"# Flash-decode on {device}",
        "",
        f"{datetime.date.today().isoformat()}; torch {torch.__version__}; one layer, {args.heads} query "
        f"heads / {args.kv_heads} KV heads x {args.head_dim} dims, {args.block_size}-token blocks, q fp16.",
        f"Device-to-device copy bandwidth (read + write): **{copy_bw / 1e9:.0f} GB/s**. "
        "`% copy` = KV bytes the kernel must read per second / that bandwidth. SDPA reads the same "
        "K/V gathered to dense fp16 (its bytes: 4 x KVH x HD per token).",
        "",
        "Times are CUDA-graph replays (as the engine runs a decode step); `eager` is the same call "
        "launched from Python each time (CuPy's and torch's launch overhead included).",
        "",
        "| format | batch | context | splits | flash-decode µs | eager µs | KV MB | GB/s | % copy | SDPA µs "
        "| SDPA eager µs | SDPA % copy | flash-decode / SDPA | paged SDPA µs | flash-decode / paged SDPA |"
        + (" max err |" if args.check else ""),
        "| --- |" + " ---: |" * (14 + bool(args.check)),
    ]
    for r in rows:
        line = (f"| {r['format']} | {r['batch']} | {r['context']} | {r['splits']} | {r['fd_us']:.1f} | "
                f"{r['fd_eager_us']:.1f} | {r['kv_mb']:.1f} | {r['fd_gbs']:.0f} | {r['fd_pct']:.0f}% | "
                f"{r['sdpa_us']:.1f} | {r['sdpa_eager_us']:.1f} | {r['sdpa_pct']:.0f}% | "
                f"{r['fd_us'] / r['sdpa_us']:.2f} | {r['paged_us']:.1f} | {r['fd_us'] / r['paged_us']:.2f} |")
        if args.check:
            line += f" {r['max_err']:.2e} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="fp16,fp8,q4")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check", action="store_true", help="also report max |flash-decode - fp32 SDPA|")
    p.add_argument("--out", default=None, help="default: bench/results/gpu-<device name>.md")
    args = p.parse_args(argv)

    import kvgen.gpu

    if not torch.cuda.is_available() or not kvgen.gpu.available():
        print("bench/gpu.py: needs a CUDA device with CuPy and Numba (pip install cupy-cuda12x numba-cuda); "
              "nothing measured", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0)
    copy_bw = copy_bandwidth()
    print(f"{device}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name in args.formats.split(","):
        for batch in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                r = bench_case(name, batch, ctx, args, copy_bw)
                torch.cuda.empty_cache()
                if r is None:
                    print(f"{name} batch {batch} context {ctx}: skipped (memory)", flush=True)
                    continue
                rows.append(r)
                print(f"{name} batch {batch:3d} ctx {ctx:6d} splits {r['splits']:3d}: {r['fd_us']:9.1f} us "
                      f"(eager {r['fd_eager_us']:7.1f}) {r['fd_pct']:5.1f}% of copy | SDPA {r['sdpa_us']:9.1f} us "
                      f"(eager {r['sdpa_eager_us']:7.1f}) {r['sdpa_pct']:5.1f}% | paged SDPA {r['paged_us']:9.1f} us",
                      flush=True)
    out = pathlib.Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"gpu-{re.sub(r'[^A-Za-z0-9._-]+', '-', device).strip('-')}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(rows, device, copy_bw, args))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
