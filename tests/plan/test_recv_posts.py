"""Receives are posted right after the compute ahead of the RECV that waits for them, with that
compute's sends (plan/schedule/recv_posts.py)."""

import pytest

from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.ir import Kind
from megatron_slim.plan.schedule.recv_posts import posted_before, receive_posts
from megatron_slim.plan.sim.engine import _Run
from tests.plan.test_simulator_in_flight import UnitCosts

SHAPES = [("1f1b", 4, 1, 6, 1), ("slimpipe", 4, 1, 4, 3), ("slimpipe", 2, 2, 3, 2), ("interleaved", 2, 2, 4, 1)]


def _expected_post_index(row, index):
    """Independently: right after the nearest compute action strictly before ``index``, else ``index``."""
    for k in range(index - 1, -1, -1):
        if row[k].kind.is_compute:
            return k + 1
    return index


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_every_receive_is_posted_once_right_after_the_compute_ahead_of_it(shape):
    schedule = executable(*shape)
    for rank, row in enumerate(schedule.ranks):
        posts = receive_posts(schedule)[rank]
        listed = [(index, a) for index, recvs in posts.items() for a in recvs]
        receives = [(i, a) for i, a in enumerate(row) if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        assert sorted(a for _, a in listed) == sorted(a for _, a in receives)
        where = {a: index for index, a in listed}
        for i, a in receives:
            assert where[a] == _expected_post_index(row, i)
            assert where[a] == i or row[where[a] - 1].kind.is_compute
        # posting order equals RECV order, so every link still sees its messages in checked order
        order = [a for index in sorted(posts) for a in posts[index]]
        assert order == [a for _, a in receives]
        first_compute = next(i for i, a in enumerate(row) if a.kind.is_compute)
        assert all(row[where[a] - 1].kind.is_compute for i, a in receives if i > first_compute)


def test_posted_before_names_the_action_the_receive_is_posted_before():
    schedule = executable("slimpipe", 2, 1, 2, 2)
    row = schedule.ranks[1]
    before = posted_before(schedule, 1)
    first = next(a for a in row if a.kind is Kind.RECV_F)
    assert before[first] == first  # nothing computed before rank 1's first receive
    later = [a for a in row if a.kind is Kind.RECV_F][1]
    at = row.index(before[later])
    assert row[at - 1].kind.is_compute and at <= row.index(later)


def test_the_simulator_holds_a_received_buffer_from_its_posting():
    """Each receive buffer appears in rank memory when the compute it is posted after ends (or at
    its own RECV, for a row's first receive), not when its RECV action is reached."""
    schedule = executable("slimpipe", 4, 1, 4, 3)
    run = _Run(schedule, UnitCosts())
    run.run()
    ends = {(e.rank, e.name): e.end for e in run.events if e.stream == "compute"}
    for rank, row in enumerate(schedule.ranks):
        got = sorted(d[0] for d in run.mem[rank] if len(d) == 5 and d[4] > 0)
        before = posted_before(schedule, rank)
        want = []
        for a in row:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                computed = [c for c in row[: row.index(before[a])] if c.kind.is_compute]
                want.append(ends[(rank, str(computed[-1]))] if computed else 0.0)
        assert got == sorted(want), rank
