"""Where each pipeline rank joins a microbatch's output exchange (``plan/schedule/vocab.py``,
``vocab_cuts.py``), and that no rank waits forever: the schedule walked with blocking receives,
send windows, one rendezvous of all ranks per microbatch and the embedding lookups must reach the
end, with one model chunk per rank and with several (interleaved)."""

import pytest

from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.vocab import EmbeddingJoin, OutputJoin, vocab_joins
from tests.plan._vocab_walk import walk


def _outputs(schedule, rank) -> dict[int, tuple[int, ...]]:
    joins, _ = vocab_joins(schedule, rank)
    found = {p: tuple(j.microbatch for j in js if isinstance(j, OutputJoin)) for p, js in joins.items()}
    return {p: ms for p, ms in found.items() if ms}


SHAPES = [("slimpipe", m, n) for m, n in [(1, 1), (2, 2), (3, 4), (5, 3), (8, 2)]] + [("1f1b", m, 1) for m in (1, 3, 6)]
INTERLEAVED = [("interleaved", m, 1) for m in (2, 5, 6, 8)] + [("slimpipe", m, n) for m, n in [(2, 3), (4, 2), (3, 4)]]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("kind,microbatches,slices", SHAPES)
def test_every_rank_reaches_the_end_with_one_exchange_per_microbatch(kind, pp, microbatches, slices):
    schedule = executable(kind, pp, 1, microbatches, slices)
    assert walk(schedule) == [0] * pp
    assert walk(executable_forward_only(schedule)) == [0] * pp


@pytest.mark.parametrize("pp,vpp", [(2, 2), (3, 2), (4, 2), (3, 3)])
@pytest.mark.parametrize("kind,microbatches,slices", INTERLEAVED)
def test_interleaved_schedules_reach_the_end_with_the_exchanges(kind, pp, vpp, microbatches, slices):
    schedule = executable(kind, pp, vpp, microbatches, slices)
    assert walk(schedule) == [0] * pp
    assert walk(executable_forward_only(schedule)) == [0] * pp
    for rank in range(pp):
        joined = [m for ms in _outputs(schedule, rank).values() for m in ms]
        assert joined == list(range(microbatches))  # once each, in microbatch order


def test_the_last_rank_joins_after_its_last_forward_of_a_microbatch_the_others_after_sending_it():
    schedule = executable("slimpipe", 2, 1, 2, 2)
    for rank, kind in ((0, Kind.SEND_F), (1, Kind.F)):
        steps = _outputs(schedule, rank)
        assert sorted(steps.values()) == [(0,), (1,)]
        for position, (mb,) in steps.items():
            a = schedule.ranks[rank][position - 1]
            assert (a.kind, a.microbatch, a.slice) == (kind, mb, 1)


def test_interleaved_pp3_a_rank_first_sends_the_gradient_a_peer_waits_for():
    # rank 0 sends the last forward of microbatch 1 (chunk 1) before the chunk-1 backward of
    # microbatch 0 that rank 2 waits for before its own last forward of microbatch 1: rank 0 joins
    # exchange 1 only after sending that gradient (joining right after the forward would deadlock)
    schedule = executable("slimpipe", 3, 2, 2, 3)
    row = schedule.ranks[0]
    (position,) = [p for p, ms in _outputs(schedule, 0).items() if ms == (1,)]
    assert row[position - 1] == Action(Kind.SEND_B, 1, 0, 0)
    assert row.index(Action(Kind.SEND_F, 1, 1, 2)) < position - 1


def test_the_walk_finds_a_rank_joining_before_it_sends_its_last_forward():
    def too_early(schedule, rank):  # every rank joins right after its forward, before sending it
        row, last = schedule.ranks[rank], schedule.num_slices - 1
        return {
            i + 1: (OutputJoin(a.microbatch),) for i, a in enumerate(row) if a.kind is Kind.F and a.slice == last
        }, ()

    stuck = walk(executable("slimpipe", 2, 1, 2, 2), too_early)
    assert stuck[0] < 0 and stuck[1] < 0


def test_a_schedule_without_a_cut_is_refused():
    # stage 0 waits for the backward of microbatch 0 before sending its forward: the last rank's
    # backward would have to run before the exchange it needs
    rows = (
        tuple(Action.parse(t) for t in ("F0.0", "RECV_B0.0", "SEND_F0.0", "B0.0")),
        tuple(Action.parse(t) for t in ("RECV_F0.0", "F0.0", "B0.0", "SEND_B0.0")),
    )
    with pytest.raises(ValueError, match="microbatch 0's output exchange after its backward"):
        vocab_joins(Schedule("1f1b", 2, 1, 1, 1, rows), 0)


def test_joins_are_typed():
    joins, _ = vocab_joins(executable("1f1b", 2, 1, 1, 1), 1)
    assert joins == {0: (EmbeddingJoin((0, 0), ()),), 2: (OutputJoin(0),)}
