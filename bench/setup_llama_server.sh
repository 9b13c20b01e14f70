#!/usr/bin/env bash
# Build llama.cpp's own server (`llama-server`), the serving peer of bench/serving.py, from the
# llama.cpp sources vendored in the same llama-cpp-python sdist that bench/setup_llamacpp.sh
# builds (so both peers are the same llama.cpp), into bench/.cache/llama-server/. Never runs in
# `make test`. CPU only, -march=native without AMX (see setup_llamacpp.sh for why), no libcurl.
#
#   bash bench/setup_llama_server.sh        (idempotent; FORCE=1 rebuilds)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/.cache/llama-server"
version="${LLAMACPP_VERSION:-0.3.36}"
jobs="$( (nproc 2>/dev/null || echo 2) | head -n1)"
py="${PYTHON:-python3}"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake_args=(-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
            -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
cpu_sig="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12 || true)"
want="llama-server from llama-cpp-python==$version|${cmake_args[*]}|$(uname -m)|$(hostname 2>/dev/null || true)|$cpu_sig"
stamp="$out/.built"
if [[ "${FORCE:-0}" != 1 && -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$out/llama-server" ]]; then
    echo "llama-server already built in $out; skipping (FORCE=1 rebuilds)"
    exit 0
fi
command -v cmake >/dev/null || { echo "cmake not found (apt-get install cmake)" >&2; exit 1; }

start=$(date +%s)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
cmake -S "$src" -B "$work/build" "${cmake_args[@]}" >/dev/null
cmake --build "$work/build" --target llama-server -j "$jobs"
mkdir -p "$out"
cp "$work/build/bin/llama-server" "$out/llama-server"
"$out/llama-server" --version 2>&1 | head -3 || true
echo "$want" > "$stamp"
echo "built in $(( $(date +%s) - start )) s"
