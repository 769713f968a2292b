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
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing.context
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
    torch_before = "torch" in sys.modules
    yield
    if tier == "plan" and not torch_before and "torch" in sys.modules:
        pytest.fail(f"{node.nodeid} imported torch but is in the plan tier: mark it single", pytrace=False)
