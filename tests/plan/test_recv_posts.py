"""Receives are posted one compute ahead of the RECV that waits for them (plan/schedule/recv_posts.py)."""

import pytest

from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.ir import Kind
from megatron_slim.plan.schedule.recv_posts import posted_before, receive_posts
from megatron_slim.plan.sim.engine import _Run
from tests.plan.test_simulator_in_flight import UnitCosts

SHAPES = [("1f1b", 4, 1, 6, 1), ("slimpipe", 4, 1, 4, 3), ("slimpipe", 2, 2, 3, 2), ("interleaved", 2, 2, 4, 1)]


def _expected_post_index(row, index):
    """Independently: the nearest compute action strictly before ``index``, else ``index``."""
    for k in range(index - 1, -1, -1):
        if row[k].kind.is_compute:
            return k
    return index


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_every_receive_is_posted_once_just_before_the_compute_ahead_of_it(shape):
    schedule = executable(*shape)
    for rank, row in enumerate(schedule.ranks):
        posts = receive_posts(schedule)[rank]
        listed = [(index, a) for index, recvs in posts.items() for a in recvs]
        receives = [(i, a) for i, a in enumerate(row) if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        assert sorted(a for _, a in listed) == sorted(a for _, a in receives)
        where = {a: index for index, a in listed}
        for i, a in receives:
            assert where[a] == _expected_post_index(row, i)
            assert where[a] == i or row[where[a]].kind.is_compute
        # posting order equals RECV order, so every link still sees its messages in checked order
        order = [a for index in sorted(posts) for a in posts[index]]
        assert order == [a for _, a in receives]
        ahead = [a for i, a in receives if where[a] < i]
        assert len(ahead) >= len(receives) - 1  # only a row's first receive may lack a compute before it


def test_posted_before_names_the_action_the_receive_is_posted_before():
    schedule = executable("slimpipe", 2, 1, 2, 2)
    row = schedule.ranks[1]
    before = posted_before(schedule, 1)
    first = next(a for a in row if a.kind is Kind.RECV_F)
    assert before[first] == first  # nothing computed before rank 1's first receive
    later = [a for a in row if a.kind is Kind.RECV_F][1]
    assert before[later].kind.is_compute and row.index(before[later]) < row.index(later)


def test_the_simulator_holds_a_received_buffer_from_its_posting():
    """Each receive buffer appears in rank memory when the compute it is posted before starts
    (or at its own RECV, for a row's first receive), not when its RECV action is reached."""
    schedule = executable("slimpipe", 4, 1, 4, 3)
    run = _Run(schedule, UnitCosts())
    run.run()
    starts = {(e.rank, e.name): e.start for e in run.events if e.stream == "compute"}
    for rank, row in enumerate(schedule.ranks):
        got = sorted(d[0] for d in run.mem[rank] if len(d) == 5 and d[4] > 0)
        before = posted_before(schedule, rank)
        want = []
        for a in row:
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                want.append(starts[(rank, str(before[a]))] if before[a] != a else None)
        ahead = sorted(t for t in want if t is not None)
        assert len(ahead) >= len(want) - 1
        # a receive posted in place is its row's first action, posted at time 0
        assert got == sorted(ahead + [0.0] * (len(want) - len(ahead))), rank
