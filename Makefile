# Quickstart: `make demo` (installs, then runs the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
OUT ?= out

PYTHON312 ?= /root/.pyenv/versions/3.12.1/bin/python3
# What the Python 3.12 environment installs: torch (PyPI's CUDA build, which runs on CPU), megatron-core
# 0.19 and, for argument parsing only, 0.17 and 0.18 beside it.
TORCH312 := 2.14.1
MCORE312 := 0.19.2
MCORE312_EXTRA := 0.17.1 0.18.2
# It lives outside the checkout so that repeat runs (CI clones the repository afresh every time)
# reuse it, named by a hash of what it installs: the pins above and pyproject.toml's dependency
# lists (scripts/ci/dependency_key.py), not the whole file, so an edit to tool settings keeps it.
# It holds megatron-slim's dependencies only: the tests import megatron_slim from this checkout.
DEPS312 := $(shell $(PYTHON) scripts/ci/dependency_key.py pyproject.toml test metrics megatron-lm -- torch==$(TORCH312) megatron-core==$(MCORE312) $(MCORE312_EXTRA))
ifeq ($(DEPS312),)
$(error scripts/ci/dependency_key.py printed no key for the Python 3.12 environment)
endif
VENV312 ?= $(HOME)/.cache/megatron-slim/venv-py312-$(DEPS312)
STAMP312 := $(VENV312)/.installed-stamp
# megatron-core releases whose Megatron-LM tag (../shared/megatron-lm) is checked for argument
# parsing only; each is installed beside the venv's 0.19 and put first on PYTHONPATH by the tests.
EXTRA_MCORE := $(shell echo $(foreach v,$(MCORE312_EXTRA),core_v$(v)=$(VENV312)/mcore-$(v)) | tr ' ' ',')

.PHONY: install demo train-demo simulate-demo test test-plan test-slow test-nccl-rules test-all test-megatron test-megatron-py312 test-megatron-py312-slow lint check-wheel clean

# torch is pinned: the local CPU wheel; any other spec pulls several GB of CUDA packages.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,lint,metrics,megatron-lm,plot]"
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

# pytest-xdist workers for the test targets: 2 fills a 2-core machine (measured in docs/testing.md);
# each worker holds a fork server with torch and megatron-core imported, about 0.5 GB.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope

# The default suite (docs/testing.md): plan tests, one exactness test per feature, and the real
# Megatron-LM tier's smoke cases; `make test-megatron` runs the rest of that tier.
test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not gpu and (not real_megatron or smoke)" --durations=25

# The contract tier against Megatron-LM core_v0.16.1 (megatron-core 0.16.1, Python 3.11), less the
# smoke cases `make test` runs; its slow cases run in `make test-slow`.
test-megatron: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "real_megatron and not gpu and not slow and not smoke" --durations=10

# The pure planning tier (tests/conftest.py assigns the plan / single / multi markers): no torch, no
# ranks. Collected from tests/plan only, where the tier lives: collecting the other folders imports torch.
test-plan: $(STAMP)
	$(BIN)/python -m pytest -q -m "plan and not slow" tests/plan

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "slow and not gpu"

# The multi-rank tests of the default tier with NCCL's matching rules enforced over gloo
# (megatron_slim/runtime/nccl_rules); not in CI. Known failures are listed in docs/testing.md.
test-nccl-rules: $(STAMP)
	MEGATRON_SLIM_NCCL_RULES=1 $(BIN)/python -m pytest -q $(XDIST) -m "multi and not slow and not gpu and (not real_megatron or smoke)"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

# The contract tier against Megatron-LM core_v0.19.0 (and 0.17/0.18 argument parsing): megatron-core
# 0.17+ needs Python 3.12, whose PyPI torch is a CUDA build (about 5 GB, pinned; it runs on CPU).
# No prerequisite on pyproject.toml: VENV312's name already carries its hash, and a fresh clone's
# pyproject.toml is always newer than an existing environment's stamp (CI would rebuild every time).
$(STAMP312):
	rm -rf $(VENV312)
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --quiet --upgrade pip
	$(VENV312)/bin/python -m pip install --quiet torch==$(TORCH312) megatron-core==$(MCORE312)
	$(VENV312)/bin/python -m pip install --quiet ".[test,metrics,megatron-lm]"
	$(VENV312)/bin/python -m pip uninstall --quiet --yes megatron-slim
	$(foreach v,$(MCORE312_EXTRA),$(VENV312)/bin/python -m pip install --quiet --no-deps --target $(VENV312)/mcore-$(v) megatron-core==$(v) &&) true
	touch $(STAMP312)

# Every case of the contract tier on core_v0.19 (the smoke cases too: `make test` ran them on 0.16).
test-megatron-py312: $(STAMP312)
	PYTHONPATH=$(CURDIR) MEGATRON_SLIM_EXTRA_MCORE=$(EXTRA_MCORE) $(VENV312)/bin/python -m pytest -q $(XDIST) -m "real_megatron and not slow" --durations=10

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
