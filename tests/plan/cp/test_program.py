"""The CP step program: a pure value with a text form and a digest, one per rank, which the
simulator walks step by step (the runtime side of the check is tests/runtime/cp/test_same_steps.py)."""

import pytest

from megatron_slim.plan.cp.engines import ENGINES, plan_pack
from megatron_slim.plan.cp.program import lower_cp, lower_rank
from megatron_slim.plan.sim.cp.layer import simulate_pass

from .conftest import packs, topology


@pytest.mark.parametrize("engine", ENGINES)
def test_simulator_prices_every_step_of_every_rank_once(engine, costs):
    topo = topology("2x2")
    for lengths in packs(seed=4, count=3, total=9_000):
        plan = plan_pack(engine, lengths, topo, costs)
        program = lower_cp(plan)
        assert program == lower_cp(plan) and program.digest() == lower_cp(plan).digest()
        for backward in (False, True):
            walked = simulate_pass(plan, topo, costs, backward=backward).walked
            want = {(rs.rank, t.group): [str(s) for s in t.steps(backward)] for rs in program.ranks for t in rs.tasks}
            assert walked == want


def test_text_names_every_task_and_the_digest_follows_it(costs):
    topo = topology("2x2")
    a = lower_cp(plan_pack("ring", (100, 37), topo, costs))
    b = lower_cp(plan_pack("ring", (101, 36), topo, costs))
    assert "G0:zigzag" in a.to_text() and "fwd: POST_KV1,ROUND,C0" in a.to_text()
    assert a.to_text() == b.to_text() and a.digest() == b.digest()  # same protocol, other lengths
    u = lower_cp(plan_pack("ulysses", (100, 36), topo, costs))
    assert "fwd: POST_QKV,ROUND,WAIT_QKV,ROUND,C0,POST_OUT,ROUND,WAIT_OUT" in u.to_text()
    assert u.digest() != a.digest()


def test_rank_out_of_range_is_refused(costs):
    plan = plan_pack("ring", (64,), topology("2x2"), costs)
    with pytest.raises(ValueError, match="the plan has ranks 0..3"):
        lower_rank(plan, 4)
