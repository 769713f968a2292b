"""The runtime executes exactly the steps the simulator prices: both walk ``plan.cp.program``.

Per rank, group and direction, the step strings the 4-rank gloo engine ran (recorded by the
engine) equal those ``simulate_pass`` priced, and both equal the lowered program, for every test
plan: ring (routed or not, relays included), zeppelin, hierarchical (a2a+p2p), ulysses, allgather.
"""

import pytest

from megatron_slim.plan.cp.program import lower_cp
from megatron_slim.plan.sim.cp.layer import simulate_pass
from tests.runtime.cp import _plans
from tests.runtime.cp.conftest import WORLD


@pytest.mark.parametrize("name", _plans.CASES)
def test_runtime_and_simulator_walk_the_same_steps(engine_results, name):
    plan, routing = _plans.case(name)
    program = lower_cp(plan, routing)
    for direction in ("forward", "backward"):
        priced = simulate_pass(
            plan, _plans.topology(), _plans.costs(), backward=direction == "backward", routing=routing
        ).walked
        for rank in range(WORLD):
            ran = engine_results[rank]["float64"][name]["steps"][direction]
            tasks = program.ranks[rank].tasks
            assert sorted(ran) == sorted(t.group for t in tasks), f"{name} rank {rank}: groups run"
            for task in tasks:
                want = [str(s) for s in task.steps(direction == "backward")]
                where = f"{name} rank {rank} G{task.group} {direction}"
                assert ran[task.group] == want, f"{where}: the runtime ran other steps than the program's"
                assert priced[(rank, task.group)] == want, f"{where}: the simulator priced other steps"
            assert {g for r, g in priced if r == rank} == set(ran), f"{name} rank {rank}: groups priced"


def test_ring_steps_text():
    plan, _ = _plans.case("ring")
    task = lower_cp(plan).ranks[1].tasks[0]
    assert (
        ",".join(map(str, task.forward)) == "POST_KV1,ROUND,C0,ROUND,WAIT_KV1,POST_KV2,C1,ROUND,WAIT_KV2,"
        "POST_KV3,C2,ROUND,WAIT_KV3,C3"
    )
    assert [str(s) for s in task.backward][-3:] == ["ROUND", "POST_DKV4", "WAIT_DKV4"]
