"""The readiness rules the validator and the simulator share (``plan/schedule/walk.py``)."""

import pytest

from megatron_slim.plan.schedule import Action, ScheduleError, add_communication, generate, lower, validate
from megatron_slim.plan.schedule.walk import Walker, describe, produced, required


def _rows(schedule, rows):
    return schedule.replace_ranks([[Action.parse(a) for a in r] for r in rows])


def test_a_remote_dependency_is_waited_for_through_this_ranks_receive():
    s = add_communication(generate("1f1b", 2, 1, 1, 1))
    f = Action.parse("F0.0")
    assert [describe(s, x) for x in required(s, 1, f)] == ["RECV_F0.0 on rank 1"]
    assert [describe(s, x) for x in required(s, 1, Action.parse("RECV_F0.0"))] == ["SEND_F0.0 on rank 0"]
    assert [describe(s, x) for x in required(s, 0, Action.parse("SEND_F0.0"))] == ["F0.0 on rank 0"]
    # compute-only: the same dependency is the other rank's compute itself
    plain = generate("1f1b", 2, 1, 1, 1)
    assert [describe(plain, x) for x in required(plain, 1, f)] == ["F0.0 on rank 0"]


def test_the_walk_records_each_fact_at_the_time_the_step_gives():
    s = lower(generate("slimpipe", 2, 1, 2, 2))
    clock = iter(range(1, 1000))
    walker = Walker(s)
    seen = []

    def step(rank, a, ready):
        seen.append((rank, a, ready))
        return float(next(clock))

    assert walker.run(step) == {}
    assert len(seen) == sum(len(r) for r in s.ranks)
    for rank, a, ready in seen:
        assert ready == max([walker.done[f] for f in walker.requires(rank, a)], default=0.0)
        assert produced(s, rank, a) in walker.done


def test_a_receive_before_its_send_names_the_send():
    s = add_communication(generate("1f1b", 2, 1, 1, 1))
    bad = _rows(s, [["F0.0", "RECV_B0.0", "B0.0", "SEND_F0.0"], ["RECV_F0.0", "F0.0", "B0.0", "SEND_B0.0"]])
    with pytest.raises(ScheduleError) as err:
        validate(bad)
    assert "rank 0 step 1 RECV_B0.0 waits for: SEND_B0.0 on rank 1" in str(err.value)
    assert "rank 1 step 0 RECV_F0.0 waits for: SEND_F0.0 on rank 0" in str(err.value)


def test_a_send_before_its_compute_names_what_it_sends():
    s = add_communication(generate("1f1b", 2, 1, 1, 1))
    bad = _rows(s, [["SEND_F0.0", "F0.0", "RECV_B0.0", "B0.0"], ["RECV_F0.0", "F0.0", "B0.0", "SEND_B0.0"]])
    with pytest.raises(ScheduleError, match=r"SEND_F0.0 waits for: F0.0 on rank 0 \(what it sends\)"):
        validate(bad)
