# ShardSpeed: every target does its own set-up on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PEERS_VENV ?= .venv-peers
# The CPU build of torch that this machine kind keeps on disk (small, no CUDA wheels); every
# number in docs/ was measured on it. `make TORCH=torch` takes whatever pip resolves instead.
TORCH ?= torch==2.13.0

.PHONY: all demo test test-slow test-gpu lint format bench bench-peers clean compat

all: test

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	# Triton for the sparse-attention kernel tests, unless torch brought its own (CUDA builds)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[triton]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check shardspeed tests benchmarks examples compat
	$(BIN)/ruff format --check shardspeed tests benchmarks examples compat

format: $(STAMP)
	$(BIN)/ruff format shardspeed tests benchmarks examples compat
	$(BIN)/ruff check --fix shardspeed tests benchmarks examples compat

test: lint
	$(BIN)/python -m pytest -q tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests

# The compatibility distribution (compat/deepspeed): a `deepspeed` package backed by
# shardspeed, so transformers/accelerate find "DeepSpeed". Refuses to replace a real one.
compat: $(STAMP)
	$(BIN)/python compat/install.py

demo: $(STAMP)
	$(BIN)/python examples/train_gpt.py

# DeepSpeed lives in its own venv: a peer for benchmarks, never a dependency of the library.
# deepspeed does not pin torch: pin the peers' torch to the build .venv uses, so every
# benchmark row runs on the same torch.
$(PEERS_VENV)/.installed: pyproject.toml $(STAMP)
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q -e '.[test,peers]' "torch==$$($(BIN)/python -c 'import torch; print(torch.__version__)')"
	touch $(PEERS_VENV)/.installed

bench-peers: $(PEERS_VENV)/.installed

bench: bench-peers
	$(PEERS_VENV)/bin/python benchmarks/train_bench.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info
