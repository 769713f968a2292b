"""The executed schedules, action by action, pinned in ``tests/plan/golden/*.txt``.

Each file is ``Schedule.to_text()`` of ``plan.schedule.executable`` (generated, lowered,
validated) for one shape: the shipped recipes' (tiny-cpu, llama2-7b-64k) and a few small ones.
A change to a generator or a lowering pass that moves any action shows up here as a diff.

Regenerate after an intended change, then review the diff before committing:

    MEGATRON_SLIM_UPDATE_GOLDEN=1 python -m pytest -q tests/plan/test_golden_schedules.py
"""

import os
from pathlib import Path

import pytest

from megatron_slim.plan.schedule import Schedule, validate
from megatron_slim.plan.schedule.executable import executable, executable_forward_only

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MEGATRON_SLIM_UPDATE_GOLDEN") == "1"

# name -> (kind, pp, vpp, microbatches, slices)
SHAPES = {
    "tiny-cpu": ("slimpipe", 4, 1, 8, 4),
    "tiny-cpu-1f1b": ("1f1b", 4, 1, 8, 1),
    "tiny-cpu-interleaved": ("interleaved", 4, 2, 8, 1),
    "llama2-7b-64k": ("slimpipe", 4, 1, 16, 8),
    "slimpipe-pp2-v2-m5-n1": ("slimpipe", 2, 2, 5, 1),  # one link carries F and B: receives reordered
    "slimpipe-pp3-v2-m4-n3": ("slimpipe", 3, 2, 4, 3),
    "slimpipe-pp2-v1-m2-n3": ("slimpipe", 2, 1, 2, 3),
    "slimpipe-pp1-v2-m3-n2": ("slimpipe", 1, 2, 3, 2),
    "1f1b-pp1-m3": ("1f1b", 1, 1, 3, 1),
}
FORWARD_ONLY = ("tiny-cpu", "slimpipe-pp3-v2-m4-n3")


def _cases():
    cases = {name: executable(*shape) for name, shape in SHAPES.items()}
    cases.update({f"{name}-forward": executable_forward_only(cases[name]) for name in FORWARD_ONLY})
    return cases


def _first_difference(got: str, want: str) -> str:
    for line, (g, w) in enumerate(zip(got.splitlines(), want.splitlines())):
        if g != w:
            if line == 0:
                return f"header {g!r} != {w!r}"
            steps = [(i, a, b) for i, (a, b) in enumerate(zip(g.split(","), w.split(","))) if a != b]
            step, a, b = steps[0] if steps else (min(len(g), len(w)), "(end)", "(end)")
            return f"rank {line - 1} step {step}: {a} (now) != {b} (golden)"
    return "a different number of ranks"


@pytest.mark.parametrize("name", sorted(_cases()))
def test_schedule_matches_its_golden_file(name):
    text = _cases()[name].to_text()
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing; write it with MEGATRON_SLIM_UPDATE_GOLDEN=1"
    want = path.read_text()
    assert text == want, (
        f"{name}: the schedule differs from {path.name}, {_first_difference(text, want)}; "
        "if intended, regenerate with MEGATRON_SLIM_UPDATE_GOLDEN=1 and review the diff"
    )


@pytest.mark.parametrize(
    "name,recipe,kind",
    [
        ("tiny-cpu", "tiny-cpu", "slimpipe"),
        ("tiny-cpu-1f1b", "tiny-cpu", "1f1b"),
        ("tiny-cpu-interleaved", "tiny-cpu", "interleaved"),
        ("llama2-7b-64k", "llama2-7b-64k", "slimpipe"),
    ],
)
def test_recipe_shapes_are_the_shipped_recipes(name, recipe, kind):
    from megatron_slim.plan.recipe import load_recipe
    from megatron_slim.plan.variants import schedule_variant

    r = schedule_variant(load_recipe(recipe), kind)
    p = r.parallel
    assert SHAPES[name] == (r.schedule.kind, p.pp, p.vpp, r.num_microbatches, r.schedule.num_slices)


def test_every_golden_file_is_a_checked_valid_schedule():
    names = {p.stem for p in GOLDEN.glob("*.txt")}
    assert names == set(_cases()), f"stale or missing golden files: {sorted(names ^ set(_cases()))}"
    for name in names:
        validate(Schedule.from_text((GOLDEN / f"{name}.txt").read_text()))
