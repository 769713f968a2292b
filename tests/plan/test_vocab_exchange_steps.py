"""Where each pipeline rank joins a microbatch's vocabulary exchange (``plan/schedule/vocab.py``),
and that no rank waits forever: the schedule walked with blocking receives (every send completes at
once) plus one rendezvous of all ranks per microbatch at the planned points must reach the end."""

import pytest

from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.plan.schedule.ir import Kind
from megatron_slim.plan.schedule.vocab import vocab_exchange_steps
from megatron_slim.plan.schedule.walk import produced, required


def _events(schedule, rank) -> list:
    """The rank's row with ``("join", m)`` after the step where it joins microbatch m's exchange."""
    points = vocab_exchange_steps(schedule, rank)
    out: list = []
    for step, a in enumerate(schedule.ranks[rank]):
        out.append(a)
        if step in points:
            out.append(("join", points[step]))
    return out


def _walk_with_exchanges(schedule) -> list[int]:
    """How far each rank's events get: a receive waits for its send, an exchange for every rank."""
    rows = [_events(schedule, r) for r in range(schedule.pp)]
    pos, done = [0] * len(rows), set()
    moved = True
    while moved:
        moved = False
        heads = [row[p] if p < len(row) else None for row, p in zip(rows, pos)]
        if isinstance(heads[0], tuple) and all(h == heads[0] for h in heads):
            pos = [p + 1 for p in pos]  # every rank is at the same exchange: it runs
            moved = True
            continue
        for r, row in enumerate(rows):
            while pos[r] < len(row) and not isinstance(row[pos[r]], tuple):
                a = row[pos[r]]
                if any(f not in done for f in required(schedule, r, a)):
                    break
                done.add(produced(schedule, r, a))
                pos[r] += 1
                moved = True
    assert sum(isinstance(e, tuple) for e in rows[0]) == schedule.num_microbatches
    return [p - len(row) for p, row in zip(pos, rows)]  # 0 everywhere: every rank finished


SHAPES = [("slimpipe", m, n) for m, n in [(1, 1), (2, 2), (3, 4), (5, 3), (8, 2)]] + [("1f1b", m, 1) for m in (1, 3, 6)]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("kind,microbatches,slices", SHAPES)
def test_every_rank_reaches_the_end_with_one_exchange_per_microbatch(kind, pp, microbatches, slices):
    schedule = executable(kind, pp, 1, microbatches, slices)
    assert _walk_with_exchanges(schedule) == [0] * pp
    assert _walk_with_exchanges(executable_forward_only(schedule)) == [0] * pp


def test_the_last_rank_joins_after_its_last_forward_of_a_microbatch_the_others_after_sending_it():
    schedule = executable("slimpipe", 2, 1, 2, 2)
    for rank, kind in ((0, Kind.SEND_F), (1, Kind.F)):
        steps = vocab_exchange_steps(schedule, rank)
        assert sorted(steps.values()) == [0, 1]
        for step, mb in steps.items():
            a = schedule.ranks[rank][step]
            assert (a.kind, a.microbatch, a.slice) == (kind, mb, 1)


def test_the_walk_finds_a_rank_joining_before_it_sends_its_last_forward(monkeypatch):
    from tests.plan import test_vocab_exchange_steps as here

    def too_early(schedule, rank):  # every rank joins right after its forward, before sending it
        row = schedule.ranks[rank]
        last = schedule.num_slices - 1
        return {i: a.microbatch for i, a in enumerate(row) if a.kind is Kind.F and a.slice == last}

    monkeypatch.setattr(here, "vocab_exchange_steps", too_early)
    stuck = _walk_with_exchanges(executable("slimpipe", 2, 1, 2, 2))
    assert stuck[0] < 0 and stuck[1] < 0


def test_interleaved_schedules_are_refused():
    with pytest.raises(ValueError, match="allowed: parallel.vpp=1"):
        vocab_exchange_steps(executable("slimpipe", 2, 2, 2, 2), 0)
