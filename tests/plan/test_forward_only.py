"""The forward-only schedule an evaluation step runs: derived in the plan, validated like any other."""

import pytest

from megatron_slim.plan.schedule import Kind, Schedule, ScheduleError, forward_only, generate, validate
from megatron_slim.plan.schedule.executable import executable, executable_forward_only

SHAPES = [
    ("1f1b", 4, 1, 5, 1),
    ("interleaved", 2, 2, 4, 1),
    ("slimpipe", 4, 1, 3, 4),
    ("slimpipe", 2, 2, 5, 1),
    ("slimpipe", 3, 2, 4, 3),
    ("slimpipe", 1, 2, 3, 2),
]


@pytest.mark.parametrize("kind,pp,vpp,m,n", SHAPES)
def test_forward_only_keeps_each_ranks_forwards_and_their_messages_in_training_order(kind, pp, vpp, m, n):
    full = executable(kind, pp, vpp, m, n)
    evaluation = executable_forward_only(full)
    assert evaluation.forward_only and not full.forward_only
    for row, full_row in zip(evaluation.ranks, full.ranks):
        assert list(row) == [a for a in full_row if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)]
    assert sum(a.kind is Kind.F for row in evaluation.ranks for a in row) == pp * vpp * m * n


def test_forward_only_survives_the_text_form_and_has_its_own_digest():
    full = executable("slimpipe", 2, 1, 2, 2)
    evaluation = forward_only(full)
    assert "forward_only=1" in evaluation.to_text().splitlines()[0]
    assert "forward_only" not in full.to_text()
    assert Schedule.from_text(evaluation.to_text()) == evaluation
    assert evaluation.digest() != full.digest()


def test_a_backward_left_in_a_forward_only_schedule_is_refused():
    evaluation = forward_only(generate("1f1b", 2, 1, 2, 1))
    rows = [list(r) for r in evaluation.ranks]
    rows[1].append(generate("1f1b", 2, 1, 2, 1).ranks[1][-1])  # a B
    with pytest.raises(ScheduleError, match="forward-only schedule has no backward"):
        validate(evaluation.replace_ranks(rows))


def test_a_missing_forward_in_a_forward_only_schedule_is_refused():
    evaluation = forward_only(generate("slimpipe", 2, 1, 2, 2))
    with pytest.raises(ScheduleError, match="missing"):
        validate(evaluation.replace_ranks([evaluation.ranks[0], evaluation.ranks[1][:-1]]))
