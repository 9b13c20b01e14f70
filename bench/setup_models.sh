#!/usr/bin/env bash
# Set up `make bench-models` (bench/models.py): llama.cpp's `llama-quantize` and `llama-bench`, and
# the embedded model re-encoded as Q4_K_M, Q5_K_M, Q6_K, Q8_0 and the low-bit Q3_K_M, Q2_K, IQ4_XS,
# IQ4_NL, all offline and under
# bench/.cache (git-ignored). Never runs in `make test`.
#
#   bash bench/setup_models.sh        (idempotent: each step is skipped when done; FORCE=1 redoes all)
#   MODELS=families bash bench/setup_models.sh   (steps 1, 2 and 5 only: the family files)
#
# 1. llama.cpp's tools, from the llama.cpp sources vendored in the llama-cpp-python sdist that
#    bench/setup_llamacpp.sh and bench/setup_llama_server.sh build (so every llama.cpp peer is
#    the same llama.cpp), with their flags: CPU only, -march=native without AMX (see
#    setup_llamacpp.sh for why), OpenMP, static, no libcurl. The sdist's vendor/llama.cpp is kept
#    in bench/.cache/llamacpp-src (its convert_hf_to_gguf.py and gguf-py are step 3's); the tools
#    go to bench/.cache/llama-tools/bin. About 6 minutes on 2 cores the first time.
#    LLAMACPP_SDIST=<path of llama_cpp_python-VERSION.tar.gz> uses a downloaded sdist instead of
#    `pip download`.
# 2. bench/.cache/convert-venv: a venv with sentencepiece (the converter imports it for Llama
#    models), seeing .venv's packages (torch, transformers, numpy) through a .pth file, so
#    nothing is installed into .venv.
# 3. bench/.cache/models/: the embedded Q4_1 GGUF (kvgen.engine.model_files.embedded_model_path())
#    loaded by transformers (dequantised to float32) and saved as an HF folder with its tokenizer,
#    converted to an F16 GGUF by the sdist's convert_hf_to_gguf.py, then quantized by
#    llama-quantize to each type. The files are made from the Q4_1 weights, so they are copies of
#    the same network at different precisions, not of the original bf16 SmolLM2. The Q4_1 itself
#    is benchmarked where it is installed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cache="$here/.cache"
venv_py="${VENV_PY:-$root/.venv/bin/python}"
version="${LLAMACPP_VERSION:-0.3.36}"
jobs="$( (nproc 2>/dev/null || echo 2) | head -n1)"
src="$cache/llamacpp-src"
tools="$cache/llama-tools"
conv="$cache/convert-venv"
models="$cache/models"
types=(${MODEL_TYPES:-Q4_K_M Q5_K_M Q6_K Q8_0 Q3_K_M Q2_K IQ4_XS IQ4_NL})
only="${MODELS:-all}"
[[ "$only" == families ]] && types=()
force="${FORCE:-0}"
start=$(date +%s)
mkdir -p "$cache"

# 1a. the sources
if [[ "$force" == 1 || ! -f "$src/.version" || "$(cat "$src/.version")" != "$version" ]]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    sdist="${LLAMACPP_SDIST:-}"
    if [[ -z "$sdist" ]]; then
        python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
        sdist="$(echo "$work"/llama_cpp_python-*.tar.gz)"
    fi
    tar -xzf "$sdist" -C "$work" --wildcards "llama_cpp_python-$version/vendor/llama.cpp/*"
    rm -rf "$src"
    mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$src"
    echo "$version" > "$src/.version"
    rm -rf "$tools"  # built from other sources
fi

# 1b. the tools
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake_args=(-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF
            -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
cpu_sig="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12 || true)"
want="llama-quantize llama-bench from llama-cpp-python==$version|${cmake_args[*]}|$(uname -m)|$(hostname 2>/dev/null || true)|$cpu_sig"
if [[ "$force" != 1 && -f "$tools/.built" && "$(cat "$tools/.built")" == "$want" \
      && -x "$tools/bin/llama-quantize" && -x "$tools/bin/llama-bench" ]]; then
    echo "llama-quantize and llama-bench already built in $tools/bin; skipping"
else
    command -v cmake >/dev/null || { echo "cmake not found (apt-get install cmake)" >&2; exit 1; }
    command -v g++ >/dev/null || { echo "g++ not found (apt-get install g++)" >&2; exit 1; }
    t=$(date +%s)
    echo "building llama-quantize and llama-bench ($version) into $tools with $jobs jobs"
    cmake -S "$src" -B "$tools/build" "${cmake_args[@]}" >/dev/null
    cmake --build "$tools/build" --target llama-quantize llama-bench -j "$jobs"
    mkdir -p "$tools/bin"
    cp "$tools/build/bin/llama-quantize" "$tools/build/bin/llama-bench" "$tools/bin/"
    echo "$want" > "$tools/.built"
    echo "tools built in $(( $(date +%s) - t )) s"
fi
"$tools/bin/llama-bench" --version 2>&1 | tail -2 || true

# 2. the converter's venv
site="$("$venv_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ "$force" == 1 || ! -x "$conv/bin/python" ]] || ! "$conv/bin/python" -c "import sentencepiece, torch, transformers" 2>/dev/null; then
    rm -rf "$conv"
    "$venv_py" -m venv "$conv"
    conv_site="$("$conv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$site" > "$conv_site/kvgen-venv.pth"  # .venv's packages, after the venv's own
    "$conv/bin/python" -m pip install -q sentencepiece
    "$conv/bin/python" -c "import sentencepiece, torch, transformers; print('convert-venv: sentencepiece', sentencepiece.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
fi

# 3. the files
mkdir -p "$models"
q41="$("$venv_py" -c 'from kvgen.engine.model_files import embedded_model_path as p; print(p())')"
f16="$models/SmolLM2-135M-Instruct.F16.gguf"
need=0
for ty in "${types[@]}"; do [[ -s "$models/SmolLM2-135M-Instruct.$ty.gguf" ]] || need=1; done
if [[ "$force" == 1 || ( "$need" == 1 && ! -s "$f16" ) ]]; then
    t=$(date +%s)
    hf="$models/hf-from-q4_1"
    rm -rf "$hf"
    echo "exporting $q41 as an HF folder (transformers, float32)"
    "$venv_py" - "$q41" "$hf" <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
folder, name = os.path.dirname(path), os.path.basename(path)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# The GGUF is dequantised into plain float32 Linears, but transformers still marks the model as
# gguf-quantized and refuses to save it: drop the marker (and the config's quantization_config, so
# the converter sees an ordinary float checkpoint).
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
print("saved", out, sorted(os.listdir(out)))
PY
    echo "converting to F16 GGUF"
    "$conv/bin/python" "$src/convert_hf_to_gguf.py" "$hf" --outtype f16 --outfile "$f16.tmp" 2>&1 | tail -n 15
    mv "$f16.tmp" "$f16"
    rm -rf "$hf"
    echo "F16 GGUF in $(( $(date +%s) - t )) s"
fi
for ty in "${types[@]}"; do
    out="$models/SmolLM2-135M-Instruct.$ty.gguf"
    if [[ "$force" == 1 || ! -s "$out" ]]; then
        "$tools/bin/llama-quantize" "$f16" "$out.tmp" "$ty" "$jobs" > "$models/quantize-$ty.log" 2>&1 \
            || { tail -n 20 "$models/quantize-$ty.log" >&2; exit 1; }
        mv "$out.tmp" "$out"
        grep -E "model size|quant size" "$models/quantize-$ty.log" | sed "s/^/$ty: /" || true
    fi
done
# 4. the large files (SHAPED="1.7b 8b" by default; SHAPED= skips them): random weights in a real
#    model's shape (bench/make_shaped_model.py, one layer at a time), converted to BF16 by the same
#    converter, quantized by llama-quantize; the HF folder and the BF16 file are removed after.
#    1.7B: Q4_0 and Q4_K_M (~1 GB each), the low-bit Q3_K_M, Q2_K and IQ4_XS (0.7-0.9 GB); 8B: Q4_K_M
#    (~4.3 GB), the file that shows whether kvgen
#    loads and serves an 8B model on a 24 GB machine. About 10 minutes on 2 cores the first time.
# shaped_files SHAPE STEM TYPE...: make_shaped_model.py's SHAPE as an HF folder, converted to BF16, then
# quantized to each TYPE as $models/STEM.TYPE.gguf (log: quantize-STEM-TYPE.log); the folder and the
# BF16 file are removed after
shaped_files() {
    local shape=$1 stem=$2 ty out
    shift 2
    local hf="$models/hf-$stem" bf16="$models/$stem.BF16.gguf"
    rm -rf "$hf"
    "$venv_py" "$here/make_shaped_model.py" "$shape" "$hf"
    "$conv/bin/python" "$src/convert_hf_to_gguf.py" "$hf" --outtype bf16 --outfile "$bf16.tmp" \
        ${convert_args[@]+"${convert_args[@]}"} 2>&1 | tail -n 3
    mv "$bf16.tmp" "$bf16"
    rm -rf "$hf"
    for ty in "$@"; do
        out="$models/$stem.$ty.gguf"
        "$tools/bin/llama-quantize" "$bf16" "$out.tmp" "$ty" "$jobs" > "$models/quantize-$stem-$ty.log" 2>&1 \
            || { tail -n 20 "$models/quantize-$stem-$ty.log" >&2; exit 1; }
        mv "$out.tmp" "$out"
    done
    rm -f "$bf16"
}
convert_args=()  # extra convert_hf_to_gguf.py arguments for shaped_files (step 5's phi3)
shaped=(${SHAPED-1.7b 8b})
[[ "$only" == families ]] && shaped=()
for shape in "${shaped[@]}"; do
    case "$shape" in 1.7b) qtypes=(Q4_0 Q4_K_M Q3_K_M Q2_K IQ4_XS) ;; 8b) qtypes=(Q4_K_M) ;;
        *) echo "unknown shape $shape" >&2; exit 1 ;; esac
    need=0
    for ty in "${qtypes[@]}"; do [[ "$force" == 1 || ! -s "$models/shaped-$shape.$ty.gguf" ]] && need=1; done
    [[ "$need" == 1 ]] || continue
    t=$(date +%s)
    shaped_files "$shape" "shaped-$shape" "${qtypes[@]}"
    echo "$shape-shaped files in $(( $(date +%s) - t )) s"
done
# 5. the family files (FAMILIES="llama mistral qwen2 qwen3 gemma2 gemma3 phi3 mamba2" by default; FAMILIES= skips
#    them; FAMILIES=mamba2 makes that one only): each family at its real model's widths, layers reduced to ~1B
#    where the real one is larger (mamba2: Mamba-2 1.3B's widths, 24 of its 48 layers),
#    SmolLM2's vocabulary (bench/make_shaped_model.py's FAMILY_SHAPES), random weights, made the same way
#    as step 4's and quantized to Q4_K_M (~0.3-0.7 GB each). About 2 minutes a family on 2 cores.
#    phi3's file is named without "phi3" or "phi-3": where a file's general.name has either, llama.cpp's
#    vocabulary loader (llama-vocab.cpp) sets attributes on Phi-3's sentencepiece tokens "<s>", "</s>" and
#    "<unk>", and fails on a vocabulary without them, as SmolLM2's ("error loading model vocabulary:
#    unordered_map::at"); the converter would name the file after its folder, hf-family-phi3.
families=(${FAMILIES-llama qwen3 qwen2 gemma3 phi3 mistral gemma2 mamba2})
for family in "${families[@]}"; do
    out="$models/family-$family.Q4_K_M.gguf"
    [[ "$force" == 1 || ! -s "$out" ]] || continue
    t=$(date +%s)
    convert_args=()
    [[ "$family" == phi3 ]] && convert_args=(--model-name "Phi 3 mini widths, SmolLM2 vocabulary")
    shaped_files "$family" "family-$family" Q4_K_M
    echo "$family family file in $(( $(date +%s) - t )) s"
done
[[ "$only" == families ]] || ls -l "$q41"
ls -l "$models"/*.gguf
echo "setup_models done in $(( $(date +%s) - start )) s"
