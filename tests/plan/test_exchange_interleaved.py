"""Context exchange on the interleaved SlimPipe schedule (vpp > 1): the unit-time pairing and the
group plan ``megatron-slim train`` runs ("timed") run to the end under a rendezvous walk written
here independently of ``walk.py`` and ``validate``, and they cover both model chunks.

A block may couple actions of different model chunks: the taker attends to the sender's Q/K/V of
the sender's own layer (attention has no weights), so chunk identity only has to keep messages
apart, which the runtime does by block (an action either sends or takes, and names its chunk)."""

import pytest

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule import ScheduleError, validate
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.executable import executable_with_exchange
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.sim.exchange_timing import timed_exchange_schedule

# (pp, vpp, microbatches, slices)
SHAPES = [(2, 2, 4, 4), (2, 2, 3, 8), (4, 2, 4, 4), (4, 2, 8, 8), (3, 2, 3, 6), (2, 3, 4, 4)]


def _message(schedule: Schedule, rank: int, a: Action) -> tuple[str, int, int, int]:
    """(pass, receiving stage, microbatch, slice): the same for a SEND and the RECV it meets."""
    stage = schedule.stage(rank, a.chunk)
    to = {Kind.SEND_F: stage + 1, Kind.RECV_F: stage, Kind.SEND_B: stage - 1, Kind.RECV_B: stage}[a.kind]
    return ("F" if a.kind in (Kind.SEND_F, Kind.RECV_F) else "B", to, a.microbatch, a.slice)


def _runs_to_the_end(schedule: Schedule) -> bool:
    """Every rank finishes when sends never block, a RECV waits for its SEND, and a paired compute
    runs only together with its partner, both next on their ranks."""
    plan = ExchangePlan.from_text(schedule.exchange)
    heads, sent = [0] * schedule.pp, set()

    def head(rank: int):
        return schedule.ranks[rank][heads[rank]] if heads[rank] < len(schedule.ranks[rank]) else None

    progressed = True
    while progressed:
        progressed = False
        for rank in range(schedule.pp):
            a = head(rank)
            if a is None or (a.kind in (Kind.RECV_F, Kind.RECV_B) and _message(schedule, rank, a) not in sent):
                continue
            others = [m for m in plan.group_of(rank, a) if m != (rank, a)]
            if any(head(r) != other for r, other in others):
                continue
            for r, _ in others:
                heads[r] += 1
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                sent.add(_message(schedule, rank, a))
            heads[rank] += 1
            progressed = True
    return all(head(rank) is None for rank in range(schedule.pp))


def _unit(shape) -> Schedule:
    pp, vpp, m, n = shape
    return executable_with_exchange("slimpipe", pp, vpp, m, tuple(uniform_slices(64 * n, n)))


def _timed(shape) -> Schedule:
    pp, vpp, m, n = shape
    sets = [f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"model.num_layers={2 * pp * vpp}", f"schedule.num_slices={n}"]
    sets += [f"model.seq_length={64 * n}", "schedule.slice_policy=exchange"]
    return timed_exchange_schedule(load_recipe("tiny-cpu", sets), m, tuple(uniform_slices(64 * n, n)))


@pytest.mark.parametrize("pairing", [_unit, _timed], ids=["unit", "timed"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "p{}v{}m{}n{}".format(*s))
def test_the_interleaved_pairing_runs_to_the_end(shape, pairing):
    schedule = pairing(shape)
    plan = ExchangePlan.from_text(schedule.exchange)
    assert plan.blocks and validate(schedule) is schedule
    assert _runs_to_the_end(schedule)
    for p in plan.blocks:  # both ends are actions of their ranks' own lowered schedules
        assert p.sender_action in schedule.ranks[p.sender] and p.taker_action in schedule.ranks[p.taker]


def test_a_pairing_that_cannot_run_is_caught_by_the_independent_walk():
    schedule = _unit((2, 2, 4, 4))
    # rank 1 reaches 1F3.3 only after rank 0 has long passed F0.0
    crossed = "0 1 1F3.3 0 F0.0 0 64\n"
    broken = Schedule.from_text(schedule.to_text().replace(schedule.exchange, crossed))
    assert broken.exchange == crossed and not _runs_to_the_end(broken)
    with pytest.raises(ScheduleError, match="context-exchange group member"):
        validate(broken)


@pytest.mark.parametrize("pairing", [_unit, _timed], ids=["unit", "timed"])
def test_the_pairing_covers_both_chunks(pairing):
    pairs = ExchangePlan.from_text(pairing((4, 2, 4, 4)).exchange).blocks
    for backward in (False, True):
        of_pass = [p for p in pairs if p.sender_action.kind.is_backward == backward]
        assert {p.sender_action.chunk for p in of_pass} == {0, 1}, backward
        assert {p.taker_action.chunk for p in of_pass} == {0, 1}, backward
    assert any(p.sender_action.chunk != p.taker_action.chunk for p in pairs)


def test_one_hand_checked_interleaved_pair():
    # slimpipe pp2 vpp2 m4 n4 (64-token slices), unit time: slot 8 runs rank 1's 1F0.3 (prefix 192) beside
    # rank 0's F1.0 (prefix 0), the only forward step of two ranks (the steady state runs a forward beside a
    # backward); causal pairs 64*192 + 2080 vs 2080: moving m tokens leaves 64*|192 - 2m| apart, 64*64 for
    # m = 64 or 128, and the smaller move wins. The pair couples chunk 1 with chunk 0.
    assert _unit((2, 2, 4, 4)).exchange == "8 1 1F0.3 0 F1.0 0 64\n"
