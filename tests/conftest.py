"""Test tiers as markers, assigned here so that every collected test carries exactly one of them.

* ``plan``: the pure planning layer (everything under ``tests/plan`` unless marked otherwise); no
  torch, no ranks. ``make test-plan`` runs it.
* ``multi``: starts rank processes (gloo ranks through ``run_ranks``, torchrun, or a ``train`` run).
  A test that calls ``run_ranks`` itself, or through a fixture, is marked automatically; one that
  starts ranks another way (a CLI ``train`` run, a subprocess) is marked in its module.
* ``single``: every other test (single-process torch, Megatron-LM objects built in-process).

``real_megatron`` and ``real_bridge`` keep their own tiers. Two guards keep the tiers honest: a
``plan`` test that imports torch, and a ``plan`` or ``single`` test that starts a spawned process,
fail and name the marker to use.

Rank processes start from a fork server that has imported torch and megatron-core once
(``megatron_slim.runtime.rank_start.use_forkserver``): each rank is still a fresh process, but it no
longer re-imports them (about 4 s of CPU per rank, most of a short multi-rank test).
``MEGATRON_SLIM_TEST_START=spawn`` starts every rank the way ``megatron-slim train`` does.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing.context
import os
import sys
from pathlib import Path

import pytest

TIERS = ("plan", "single", "multi")
OWN_TIERS = ("real_megatron", "real_bridge")
PLAN_DIR = Path(__file__).parent / "plan"


@functools.cache
def _starts_ranks(fn) -> bool:
    """``fn``'s source calls ``run_ranks`` (cached: parametrized tests and shared fixtures repeat)."""
    try:
        return "run_ranks(" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def _calls_run_ranks(item: pytest.Item) -> bool:
    functions = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is not None:
        functions += [d.func for defs in fixture_info.name2fixturedefs.values() for d in defs]
    return any(_starts_ranks(fn) for fn in functions if fn is not None)


def _tier(item: pytest.Item) -> str | None:
    if any(item.get_closest_marker(name) for name in TIERS + OWN_TIERS):
        return None  # marked explicitly
    if _calls_run_ranks(item):
        return "multi"
    return "plan" if PLAN_DIR in Path(str(item.path)).parents else "single"


# What a rank's work imports; the fork server imports it once (light enough that a run of plan
# tests, which start no ranks, never starts the server: it starts with the first rank).
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron_slim.runtime.pipeline",
    "megatron_slim.megatron",
    "megatron_slim.train.loop",
]
START_METHODS = ("forkserver", "spawn")


def _start_method() -> str:
    method = os.environ.get("MEGATRON_SLIM_TEST_START", "forkserver")
    if method not in START_METHODS:
        raise pytest.UsageError(f"MEGATRON_SLIM_TEST_START={method!r}: allowed {', '.join(START_METHODS)}")
    return method


def pytest_configure(config):
    _start_method()  # a bad value fails before any test runs


@functools.cache
def _use_forkserver_once() -> None:
    """Called by the first test that starts ranks (so a plan-only run never imports torch here)."""
    if _start_method() == "forkserver":
        from megatron_slim.runtime.rank_start import use_forkserver

        use_forkserver(RANK_PRELOAD)


def session_dir(tmp_path_factory, name: str):
    """A folder shared by the whole test session: under pytest-xdist, by all its workers (each has a
    base temporary folder of its own inside the session's). For build-once caches (corpora and
    tokenizers are built under a lock and published whole: ``megatron_slim.data.cache``)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    path.mkdir(exist_ok=True)
    return path


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("multi"):  # before its fixtures, some of which start ranks
        _use_forkserver_once()


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(tier)


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    node = request.node
    if node.get_closest_marker("multi") or any(node.get_closest_marker(name) for name in OWN_TIERS):
        yield
        return
    tier = "plan" if node.get_closest_marker("plan") else "single"

    def refuse(self):
        raise AssertionError(f"{node.nodeid} starts a spawned process but is in the {tier} tier: mark it multi")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", refuse)
    torch_before = "torch" in sys.modules
    yield
    if tier == "plan" and not torch_before and "torch" in sys.modules:
        pytest.fail(f"{node.nodeid} imported torch but is in the plan tier: mark it single", pytrace=False)
