# Quickstart: `make demo` (installs, then runs the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
OUT ?= out

.PHONY: install demo train-demo simulate-demo test test-slow test-all check-wheel clean

# torch is pinned: the local CPU wheel; any other spec pulls several GB of CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job: train tiny-cpu on 4 CPU ranks with SlimPipe, then simulate the 70B@512K comparison.
demo: train-demo simulate-demo

train-demo: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/megatron-slim train --json $(OUT)/train.json

simulate-demo: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/megatron-slim simulate --recipe llama2-70b-512k --compare 1f1b,interleaved,slimpipe \
		--json $(OUT)/simulate.json --trace $(OUT)/simulate.trace.json --plot $(OUT)/simulate.png

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not gpu"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# A normal install works: build a wheel, install it (not editable) into a fresh venv and run
# recipes, simulate and a 2-iteration train from outside the checkout (scripts/ci/check_wheel.sh).
check-wheel:
	PYTHON=$(PYTHON) bash scripts/ci/check_wheel.sh

clean:
	rm -rf $(OUT) .pytest_cache
