"""The engine at real model sizes on a GPU: 1B- and 8B-shaped Llama models served by the Generator
(the engine as the server drives it), against the roofline and transformers on the same GPU.

The models are made where they run (bench/make_shaped_model.py: random bf16 weights from seed 0, the
embedded SmolLM2's tokenizer, so its 49152-token vocabulary): "1b" is Llama 3.2 1B's layers (16 x
2048, GQA 32/8, head 64, tied embeddings), "8b" Llama 3.1 8B's (32 x 4096, GQA 32/8, head 128).
Weights run bf16 and the KV cache bf16 (KV_DTYPE auto). Per size:

- batch-1 greedy decode tokens/s (EOS ignored): 128 / (time of 129 new tokens - time of 1), median of 3;
  its roofline: the bytes a step must read (the weights as held, less an untied embedding table, of
  which a step reads one row; plus the KV cache at the run's mean length) over the device-to-device
  copy bandwidth measured in the same run (bytes read + written, as bench/gpu.py);
- the GPU's share of a decode step: CUDA events around each graph replay (GraphRunner.timings) against
  the time between steps on the host; idle = 1 - busy / step;
- aggregate tokens/s at 1, 16, 64 and 256 streams (128 new tokens each, prefill included; distinct
  prompts), and at each load the decode step's period and the GPU's idle share in it;
- time to first token of a 2048-token prompt (token ids, distinct per run, max_new_tokens 1), median of 3;
- transformers' `generate` on the same folder and GPU, bf16: with its default (dynamic) cache, and with
  `cache_implementation="static"`, which compiles the decode step with torch.compile; decode tokens/s
  from per-step timestamps (a logits processor), steps 2..129 of a 129-token greedy run, after a
  warm-up run (the compile).

Writes <out>/<stem>.json (every figure) and <out>/<stem>.md (the tables), a section at a time, so
a run stopped by its time limit keeps what it measured.

    python bench/gpu_models.py [--sizes 1b,8b] [--models DIR] [--out DIR] [--deadline UNIX_TIME]
        [--peer eager,compiled] [--peer-only] [--stem NAME]
    python bench/gpu_models.py --dry-run      # on the CPU, a tiny model: runs every section, means nothing
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_engine import NEW, PROMPT, decode_rate, story_prompts, sync, timed  # noqa: E402
from kvgen.engine.generator import EngineOptions, Generator, load_model  # noqa: E402
from kvgen.engine.sampling import SamplingParams  # noqa: E402

# size -> make_shaped_model.py's shape name
SIZES = {"1b": "llama", "8b": "8b"}
STREAMS = (1, 16, 64, 256)
PROMPT_TOKENS = 2048


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy (bench/gpu.py's measure)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [timed(lambda: [dst.copy_(src) for _ in range(10)], device) / 10 for _ in range(5)]
    return 2 * nbytes / statistics.median(times)


class Report:
    """Tables written to <out>/gpu_models.md and figures to gpu_models.json as they come."""

    def __init__(self, out: pathlib.Path, stem: str):
        self.out, self.stem = out, stem
        out.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []
        self.data: dict = {}

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)
        self.flush()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.flush()

    def flush(self) -> None:
        (self.out / f"{self.stem}.md").write_text("\n".join(self.lines) + "\n")
        (self.out / f"{self.stem}.json").write_text(json.dumps(self.data, indent=1))


class StepClock:
    """The engine's step times (host) and its graph replays' GPU times, while installed."""

    def __init__(self, gen: Generator):
        self.engine, self.graphs = gen.engine, gen.engine.runner.graphs
        self.steps: list[tuple[int, float]] = []  # (rows, host time at the step's end)
        self._prev = self.engine.on_step

    def __enter__(self):
        def on_step(batch, dt):
            self.steps.append((len(batch), time.perf_counter()))
            if self._prev:
                self._prev(batch, dt)
        self.engine.on_step = on_step
        if self.graphs is not None:
            self.graphs.timings = []
        return self

    def __exit__(self, *exc):
        self.engine.on_step = self._prev
        if self.graphs is not None:
            self.replays = self.graphs.timings
            self.graphs.timings = None
        else:
            self.replays = []

    def period_ms(self, rows: int) -> float | None:
        """Median time between consecutive steps of `rows` rows (the decode steps at that load)."""
        gaps = [(b - a) * 1e3 for (na, a), (nb, b) in zip(self.steps, self.steps[1:], strict=False) if na == nb == rows]
        return statistics.median(gaps) if gaps else None

    def busy_ms(self, rows: int) -> float | None:
        """Median GPU time of a replayed step of `rows` rows (its bucket)."""
        bucket = self.graphs.bucket_for(rows) if self.graphs is not None else None
        times = []
        for b, start, end in self.replays:
            if b == bucket:
                end.synchronize()
                times.append(start.elapsed_time(end))
        return statistics.median(times) if times else None


def idle_share(busy: float | None, period: float | None) -> float | None:
    return None if busy is None or not period else max(0.0, 1 - busy / period)


def fmt(x, spec: str = ".1f", none: str = "n/a", unit: str = "") -> str:
    return none if x is None else format(x, spec) + unit


def read_bytes_per_step(model, ctx: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) a batch-1 decode step reads at mean context ctx."""
    weights = model.weight_bytes()
    if not model.cfg.tie_word_embeddings and model.embed.table is not None:
        weights -= model.embed.table.nbytes  # a step looks up one row of an untied table
    cfg = model.cfg
    kv = int(ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * model.act_dtype.itemsize)
    return weights, kv


def kvgen_section(rep: Report, size: str, folder: str, device: str, copy_bw: float, deadline: float,
                  streams: tuple[int, ...]) -> None:
    t0 = time.perf_counter()
    model, tok = load_model(folder, "bf16", device)
    sync(device)
    load_s = time.perf_counter() - t0
    cfg = model.cfg
    params = sum(layer.qkv.w.numel() + layer.o.w.numel() + layer.gate_up.w.numel() + layer.down.w.numel()
                 for layer in model.layers) + model.embed.table.numel() + (
        0 if cfg.tie_word_embeddings else model.lm_head.w.numel())
    rep.put(f"{size}.model", {"params": params, "weight_bytes": model.weight_bytes(), "load_s": load_s,
                              "layers": cfg.num_layers, "hidden": cfg.hidden_size, "weight_dtype": model.weight_dtype})
    rep.line(f"### {size}: {params / 1e9:.2f}B parameters, {model.weight_bytes() / 2**30:.2f} GiB of "
             f"{model.weight_dtype} weights, loaded in {load_s:.1f} s")
    rep.line()
    opts = EngineOptions(device=device, kv_cache_mb=16384 if device.startswith("cuda") else 256,
                         max_running=max(streams), max_waiting=max(1024, max(streams)))
    gen = Generator(model, tok, opts)
    try:
        greedy = lambda n: SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)  # noqa: E731

        def run(n):
            out = gen.generate(PROMPT, greedy(n))
            assert len(out.token_ids) == n

        run(2)  # bucket 1 captured before the clock starts
        with StepClock(gen) as clock:
            rate = decode_rate(run, device, repeats=3)
        prompt_len = len(tok.encode(PROMPT))
        w, kv = read_bytes_per_step(model, prompt_len + NEW / 2)
        roof = copy_bw / (w + kv)
        busy, period = clock.busy_ms(1), clock.period_ms(1)
        rep.put(f"{size}.decode", {"tok_s": rate, "weight_read": w, "kv_read": kv,
                                   "roofline_tok_s": roof, "busy_ms": busy, "period_ms": period})
        rep.line("| batch-1 decode tok/s | roofline tok/s | % of roofline | step ms (host) | GPU busy ms | "
                 "GPU idle |")
        rep.line("| ---: | ---: | ---: | ---: | ---: | ---: |")
        idle = idle_share(busy, period)
        rep.line(f"| {rate:.1f} | {roof:.1f} | {100 * rate / roof:.1f}% | {fmt(period, '.3f')} | "
                 f"{fmt(busy, '.3f')} | {fmt(idle and 100 * idle, '.1f', unit='%')} |")
        rep.line()

        rep.line("| streams | aggregate tok/s | x 1 stream | decode step ms | GPU busy ms | GPU idle |")
        rep.line("| ---: | ---: | ---: | ---: | ---: | ---: |")
        base = None
        for n in streams:
            if time.time() > deadline:
                rep.line(f"| {n} | not run: out of time | | | | |")
                continue
            prompts = story_prompts(n)
            gen.batch_generate(prompts, greedy(4))  # this load's bucket captured
            with StepClock(gen) as clock:
                wall = timed(lambda p=prompts: gen.batch_generate(p, greedy(NEW)), device)
            agg = n * NEW / wall
            base = base or agg
            busy, period = clock.busy_ms(n), clock.period_ms(n)
            idle = idle_share(busy, period)
            rep.put(f"{size}.streams.{n}", {"tok_s": agg, "wall_s": wall, "period_ms": period, "busy_ms": busy})
            rep.line(f"| {n} | {agg:.1f} | {agg / base:.2f} | {fmt(period, '.3f')} | {fmt(busy, '.3f')} | "
                     f"{fmt(idle and 100 * idle, '.1f', unit='%')} |")
        rep.line()

        if time.time() < deadline:
            rng = random.Random(0)
            vocab = cfg.vocab_size

            def first_token():
                ids = [rng.randrange(1000, vocab) for _ in range(PROMPT_TOKENS)]  # distinct: no prefix reuse
                return timed(lambda: gen.generate(ids, greedy(1)), device)

            first_token()
            ttft = statistics.median(first_token() for _ in range(3))
            rep.put(f"{size}.ttft_2k_s", ttft)
            rep.line(f"Time to first token, {PROMPT_TOKENS}-token prompt (TOKEN_BUDGET {opts.token_budget} a "
                     f"step): **{ttft * 1e3:.1f} ms** ({PROMPT_TOKENS / ttft:.0f} prompt tok/s)")
            rep.line()
    finally:
        gen.close()


PEER_MODES = {"eager": ("dynamic cache, eager", {}),
              "compiled": ("static cache + torch.compile", {"cache_implementation": "static"})}


def hf_section(rep: Report, size: str, folder: str, device: str, deadline: float, modes: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids.to(device)

    class Stamps(LogitsProcessor):  # called once a step, after its forward; generate syncs every step
        def __init__(self):
            self.t: list[float] = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    def rate(**kw) -> float:
        stamps = Stamps()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW + 1, min_new_tokens=NEW + 1, do_sample=False,
                                 pad_token_id=tok.eos_token_id, logits_processor=LogitsProcessorList([stamps]), **kw)
        assert out.shape[1] == ids.shape[1] + NEW + 1
        t = stamps.t
        return (len(t) - 2) / (t[-1] - t[1])  # steps 2..: decode only

    try:
        for name, kw in (PEER_MODES[m] for m in modes):
            if time.time() > deadline:
                rep.line(f"| transformers generate, {name} | not run: out of time | |")
                continue
            t0 = time.perf_counter()
            try:
                rate(**kw)  # warm-up (the compile)
                warm = time.perf_counter() - t0
                r = statistics.median(rate(**kw) for _ in range(2))
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                rep.line(f"| transformers generate, {name} | failed: {type(e).__name__}: {str(e)[:200]} | |")
                continue
            rep.put(f"{size}.hf.{name}", {"tok_s": r, "warmup_s": warm})
            rep.line(f"| transformers generate, {name} | {r:.1f} | {warm:.0f} s |")
    finally:
        model.to("meta")  # its memory back before the next size (the closures above hold the module)


def make_folder(size: str, models: pathlib.Path, device: str, tokenizer: str | None) -> str:
    """The size's folder under models, made if missing (while bench/gpu_session.sh's maker runs, until it
    writes models/done, a folder it is making is waited for: the index is written last)."""
    folder = models / size
    index = folder / "model.safetensors.index.json"
    for _ in range(150):
        if index.exists() or not folder.exists() or (models / "done").exists():
            break
        time.sleep(2)
    if not index.exists():
        cmd = [sys.executable, str(ROOT / "bench" / "make_shaped_model.py"), SIZES[size], str(folder),
               "--device", device] + (["--tokenizer", tokenizer] if tokenizer else [])
        subprocess.run(cmd, check=True)
    return str(folder)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1b,8b")
    p.add_argument("--models", default="/tmp/kvgen-models", help="where the shaped folders are (made if missing)")
    p.add_argument("--tokenizer", default=None, help="make_shaped_model.py's --tokenizer")
    p.add_argument("--out", default="bench/results/gpu-models")
    p.add_argument("--deadline", type=float, default=float("inf"), help="unix time after which sections are skipped")
    p.add_argument("--peer", default="eager,compiled", help="transformers' modes: eager, compiled (empty: none)")
    p.add_argument("--peer-only", action="store_true", help="transformers alone (the engine measured before)")
    p.add_argument("--stem", default="gpu_models", help="the output files' name: <out>/<stem>.md, .json")
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny model: checks every section runs")
    args = p.parse_args(argv)
    rep = Report(pathlib.Path(args.out), args.stem)
    device = "cpu" if args.dry_run else "cuda"
    streams = (1, 4) if args.dry_run else STREAMS
    if args.dry_run:
        SIZES["tiny"] = "qwen3"  # (the smallest family shape; only that every section runs is checked)
        sizes = ["tiny"]
    else:
        sizes = args.sizes.split(",")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run)"
    copy_bw = copy_bandwidth(device)
    rep.put("device", name)
    rep.put("copy_gbs", copy_bw / 1e9)
    rep.line(f"## The engine at real sizes on {name}")
    rep.line()
    rep.line(f"torch {torch.__version__}; bf16 weights and KV; device-to-device copy {copy_bw / 1e9:.0f} GB/s "
             "(read + written), the roofline's bandwidth.")
    rep.line()
    for size in sizes:
        if time.time() > args.deadline:
            rep.line(f"### {size}: not run, out of time")
            continue
        folder = make_folder(size, pathlib.Path(args.models), device, args.tokenizer)
        if not args.peer_only:
            kvgen_section(rep, size, folder, device, copy_bw, args.deadline, streams)
        modes = [m for m in args.peer.split(",") if m and not (args.dry_run and m == "compiled")]
        if modes:
            rep.line(f"| {size} peer | decode tok/s | warm-up |")
            rep.line("| --- | ---: | ---: |")
            hf_section(rep, size, folder, device, args.deadline, modes)
        if device == "cuda":
            torch.cuda.empty_cache()
        rep.line()
    return 0


if __name__ == "__main__":
    sys.exit(main())
