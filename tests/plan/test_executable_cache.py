"""A run plans each schedule shape once: ``executable`` and ``executable_forward_only`` are cached
per (kind, pp, vpp, microbatches, slices), so every training iteration after the first reuses the
lowered, validated schedule instead of generating, lowering and validating it again."""

import pytest

from megatron_slim.plan.schedule import executable as module
from megatron_slim.plan.schedule.executable import PLANS_KEPT, executable, executable_forward_only


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of the generator and of the forward-only derivation behind the caches."""
    calls = {"generate": 0, "forward_only": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(module, "generate", counting("generate", module.generate))
    monkeypatch.setattr(module, "forward_only", counting("forward_only", module.forward_only))
    executable.cache_clear()
    module._FORWARD_ONLY.clear()
    yield calls
    executable.cache_clear()
    module._FORWARD_ONLY.clear()


def test_one_shape_is_planned_once(counted):
    first = executable("slimpipe", 2, 2, 4, 3)
    again = executable("slimpipe", 2, 2, 4, 3)
    assert again is first
    assert counted["generate"] == 1
    other = executable("slimpipe", 2, 2, 4, 2)  # another slice count is another shape
    assert other is not first and other.num_slices == 2
    assert counted["generate"] == 2


def test_forward_only_is_planned_once_per_schedule(counted):
    schedule = executable("interleaved", 2, 2, 4, 1)
    evaluation = executable_forward_only(schedule)
    assert executable_forward_only(schedule) is evaluation
    assert evaluation.forward_only and not schedule.forward_only
    assert counted["forward_only"] == 1


def test_the_cache_is_bounded(counted):
    shapes = [("1f1b", 2, 1, m, 1) for m in range(2, 2 + PLANS_KEPT + 1)]
    for shape in shapes:
        executable_forward_only(executable(*shape))
    assert executable.cache_info().currsize == PLANS_KEPT
    assert len(module._FORWARD_ONLY) == PLANS_KEPT
    executable(*shapes[0])  # the oldest was evicted: planned again
    assert counted["generate"] == PLANS_KEPT + 2
