# Quickstart: `make demo` (installs, then runs the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
OUT ?= out

PYTHON312 ?= /root/.pyenv/versions/3.12.1/bin/python3
# The Python 3.12 environment lives outside the checkout so that repeat runs (CI clones the
# repository afresh every time) reuse it; it is rebuilt whenever pyproject.toml changes. It holds
# megatron-slim's dependencies only: the tests import megatron_slim from this checkout.
VENV312 ?= $(HOME)/.cache/megatron-slim/venv-py312-$(shell sha1sum pyproject.toml | cut -c1-12)
STAMP312 := $(VENV312)/.installed-stamp
# megatron-core releases whose Megatron-LM tag (../shared/megatron-lm) is checked for argument
# parsing only; each is installed beside the venv's 0.19 and put first on PYTHONPATH by the tests.
EXTRA_MCORE := core_v0.17.1=$(VENV312)/mcore-0.17.1,core_v0.18.2=$(VENV312)/mcore-0.18.2

.PHONY: install demo train-demo simulate-demo test test-plan test-slow test-all test-megatron test-megatron-py312 test-megatron-py312-slow lint check-wheel clean

# torch is pinned: the local CPU wheel; any other spec pulls several GB of CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,lint,metrics,megatron-lm]"
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

# The default suite keeps the real Megatron-LM tier's smoke cases; `make test-megatron` runs the whole tier.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu and (not real_megatron or smoke)" --durations=25

# The contract tier against Megatron-LM core_v0.16.1 (megatron-core 0.16.1, Python 3.11); its slow
# cases run in `make test-slow`.
test-megatron: $(STAMP)
	$(BIN)/python -m pytest -q -m "real_megatron and not gpu and not slow"

# The pure planning tier (tests/conftest.py assigns the plan / single / multi markers): no torch, no
# ranks. Collected from tests/plan only, where the tier lives: collecting the other folders imports torch.
test-plan: $(STAMP)
	$(BIN)/python -m pytest -q -m "plan and not slow" tests/plan

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not gpu"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# The contract tier against Megatron-LM core_v0.19.0 (and 0.17/0.18 argument parsing): megatron-core
# 0.17+ needs Python 3.12, whose PyPI torch is a CUDA build (about 5 GB, pinned; it runs on CPU).
# No prerequisite on pyproject.toml: VENV312's name already carries its hash, and a fresh clone's
# pyproject.toml is always newer than an existing environment's stamp (CI would rebuild every time).
$(STAMP312):
	rm -rf $(VENV312)
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --quiet --upgrade pip
	$(VENV312)/bin/python -m pip install --quiet torch==2.14.1 megatron-core==0.19.2
	$(VENV312)/bin/python -m pip install --quiet ".[test,metrics,megatron-lm]"
	$(VENV312)/bin/python -m pip uninstall --quiet --yes megatron-slim
	$(VENV312)/bin/python -m pip install --quiet --no-deps --target $(VENV312)/mcore-0.17.1 megatron-core==0.17.1
	$(VENV312)/bin/python -m pip install --quiet --no-deps --target $(VENV312)/mcore-0.18.2 megatron-core==0.18.2
	touch $(STAMP312)

test-megatron-py312: $(STAMP312)
	PYTHONPATH=$(CURDIR) MEGATRON_SLIM_EXTRA_MCORE=$(EXTRA_MCORE) $(VENV312)/bin/python -m pytest -q -m "real_megatron and not slow"

# The same tier's slow cases on Python 3.12 (not in .ci/run).
test-megatron-py312-slow: $(STAMP312)
	PYTHONPATH=$(CURDIR) MEGATRON_SLIM_EXTRA_MCORE=$(EXTRA_MCORE) $(VENV312)/bin/python -m pytest -q -m "real_megatron and slow"

# ruff (lint, then formatting) and mypy (strict on megatron_slim.plan), configured in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# A normal install works: build a wheel, install it (not editable) into a fresh venv and run
# recipes, simulate and a 2-iteration train from outside the checkout (scripts/ci/check_wheel.sh).
check-wheel:
	PYTHON=$(PYTHON) bash scripts/ci/check_wheel.sh

clean:
	rm -rf $(OUT) .pytest_cache
