"""Torch's profiler and the CP simulator's Chrome trace name the same work alike.

The 4 gloo ranks run each plan's attention once forward and backward under the profiler
(``_workers.profiled_cases``): every step runs inside ``record_function`` of its
``GroupTask.step_name``. Per rank, the names of the simulated attention and transfer events on
that rank's streams (the spans ``plan.sim.cp.trace`` writes as trace events, one to one) equal the
profiled labels of the steps the simulator gives events of their own, and each group's labels
come in its program's step order.
"""

import pytest

from megatron_slim.plan.cp.program import lower_cp
from megatron_slim.plan.sim.cp.layer import simulate_pass
from tests.runtime.cp import _plans, _workers
from tests.runtime.cp.conftest import WORLD


def _simulated_names(plan, routing) -> dict[int, set[str]]:
    """Per rank, the names of the simulated CP attention events on its compute and link streams
    (the pre/post/mlp tasks around attention are not CP steps)."""
    names: dict[int, set[str]] = {r: set() for r in range(WORLD)}
    for backward in (False, True):
        result = simulate_pass(plan, _plans.topology(), _plans.costs(), backward=backward, routing=routing, record=True)
        for span in result.spans:
            if span.category != "linear":
                names[span.rank].add(span.name)
    return names


def _has_an_event(label: str) -> bool:
    """WAITs are dependencies in the simulator, not events; an all-gather member's kernels against
    the gathered blocks are priced as one event, at ``C0``."""
    kind, step = label.split()[3].split("/")[0], label.rsplit(" ", 1)[1]
    return not step.startswith("WAIT") and not (kind == "allgather" and step.startswith("C") and step != "C0")


@pytest.mark.parametrize("name", _workers.PROFILED_CASES)
def test_profiled_labels_are_the_simulated_trace_names(engine_results, name):
    plan, routing = _plans.case(name)
    program = lower_cp(plan, routing)
    simulated = _simulated_names(plan, routing)
    for rank in range(WORLD):
        labels = engine_results[rank]["profiled"][name]
        ran = 0
        for task in program.ranks[rank].tasks:
            for backward in (False, True):
                want = [task.step_name(s, backward) for s in task.steps(backward) if s.op != "ROUND"]
                assert [n for n in labels if n in set(want)] == want, f"{name} rank {rank} {task}: profiled steps"
                ran += len(want)
        assert len(labels) == ran, f"{name} rank {rank}: labels of steps that are not in its program"
        profiled = {n for n in labels if _has_an_event(n)}
        assert simulated[rank] == profiled, f"{name} rank {rank}: simulated trace names differ from profiled labels"
