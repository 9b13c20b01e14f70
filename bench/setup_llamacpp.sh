#!/usr/bin/env bash
# Build llama-cpp-python (the llama.cpp peer of bench/cpu.py) once per machine into its own
# venv, bench/.cache/llamacpp-venv, so it never touches .venv and never runs in `make test`.
#
#   nohup bash bench/setup_llamacpp.sh > /tmp/llamacpp-build.log 2>&1 &
#
# CPU build from the sdist (PyPI ships no Linux wheel), -march=native (GGML_NATIVE=ON),
# OpenMP threading, no CUDA/BLAS, no libcurl, no multimodal (mtmd) library: the worker
# only needs libllama + ggml. On 2 cores it compiles for roughly 10-20 minutes.
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
"$venv/bin/python" -c "import llama_cpp, sys; print('llama_cpp', llama_cpp.__version__, 'in', sys.prefix)"
echo "$want" > "$stamp"
echo "built in $(( $(date +%s) - start )) s"
