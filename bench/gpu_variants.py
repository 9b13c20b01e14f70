"""Flash-decode kernel variants on a GPU, timed in one run: a sweep for tuning, not a result.

Each variant rewrites #defines of kernels/flash_decode.cu (as ops.kernel_source hands it to
CuPy) and recompiles; bench/gpu.py's bench_case times it (CUDA-graph replay, next to torch SDPA
on the same data) and checks it against an fp32 SDPA reference. Variants are separated by ';',
each a comma list of NAME=VALUE #defines ("base": none), e.g. "base;KVG_FD_MAX_G=8"
(ops.MAX_HEADS_PER_CTA follows KVG_FD_MAX_G: name it for a src=DIR whose value differs);
src=DIR, which takes flash_decode.cu and the headers it includes from DIR instead (another
design with the same entry points, e.g. an earlier revision's:
`git show REV:kvgen/gpu/kernels/flash_decode.cu > DIR/flash_decode.cu`, and its headers); and
ops.NAME=VALUE, which sets one of ops.py's integer constants (the split heuristic's
CTAS_PER_SM, MIN_TOKENS_PER_SPLIT) for the variant.

    python bench/gpu_variants.py --variants "base;KVG_FD_MAX_G=8" [--cases fp16:16:8192,q4:16:32768]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu as bench_gpu  # noqa: E402
from kvgen.gpu import ops  # noqa: E402

CASES = "fp16:1:32768,fp16:16:8192,fp16:64:8192,fp16:16:32768,fp8:16:32768,q4:16:32768,fp16:4:2048"
_SOURCE = ops.kernel_source
_MAX_G = ops.MAX_HEADS_PER_CTA  # the source's own KVG_FD_MAX_G


def use_variant(defines: dict[str, str]) -> None:
    """Compile flash_decode with these #define values (and sources, src=DIR) from now on."""
    defines = dict(defines)
    folder = defines.pop("src", None)
    for name in [k for k in defines if k.startswith("ops.")]:
        setattr(ops, name[4:], int(defines.pop(name)))

    def source(name: str) -> str:
        if name == "flash_decode" and folder:
            d = pathlib.Path(folder)
            text = ops.paste_includes((d / "flash_decode.cu").read_text(), d)
        else:
            text = _SOURCE(name)
        if name == "flash_decode":
            for key, value in defines.items():
                text, n = re.subn(rf"#define {re.escape(key)}\b.*", f"#define {key} {value}", text, count=1)
                if not n:
                    raise ValueError(f"flash_decode.cu has no #define {key}")
        return text

    ops.kernel_source = source
    ops.MAX_HEADS_PER_CTA = int(defines.get("KVG_FD_MAX_G", _MAX_G))
    ops._module.cache_clear()
    ops._function.cache_clear()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="base")
    p.add_argument("--cases", default=CASES, help="format:batch:context, comma separated")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_variants.py: needs a CUDA device", file=sys.stderr)
        return 1
    shape = argparse.Namespace(block_size=16, kv_heads=8, heads=32, head_dim=128, warmup=3, iters=20,
                               repeats=5, check=True)
    copy_bw = bench_gpu.copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    defaults = {name: getattr(ops, name) for name in ("CTAS_PER_SM", "MIN_TOKENS_PER_SPLIT")}
    for variant in args.variants.split(";"):
        for name, value in defaults.items():
            setattr(ops, name, value)
        defines = dict(kv.split("=", 1) for kv in variant.split(",") if "=" in kv)
        use_variant(defines)
        for case in args.cases.split(","):
            name, batch, ctx = case.split(":")
            try:
                r = bench_gpu.bench_case(name, int(batch), int(ctx), shape, copy_bw)
                print(f"{variant:30s} {name:5s} b={batch:>3s} ctx={ctx:>6s}: {r['fd_us']:9.1f} us "
                      f"{r['fd_pct']:3.0f}% of copy | SDPA {r['sdpa_us']:7.1f} us | splits {r['splits']:3d} "
                      f"| err {r['max_err']:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, not fatal
                print(f"{variant:30s} {case}: failed: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
