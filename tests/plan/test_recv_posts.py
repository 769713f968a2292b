"""Where receives are posted (plan/schedule/recv_posts.py) and why: the two ranks of every pair
post their messages in an order NCCL can run (plan/schedule/pair_order.py)."""

import pytest

from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.ir import Kind
from megatron_slim.plan.schedule.pair_order import pair_order_problems
from megatron_slim.plan.schedule.recv_posts import posted_before, receive_posts
from megatron_slim.plan.schedule.validate import comm_key
from megatron_slim.plan.schedule.vocab import every_rank_joins
from megatron_slim.plan.sim.engine import _Run
from tests.plan.test_simulator_in_flight import UnitCosts

SHAPES = [
    ("1f1b", 4, 1, 6, 1),
    ("slimpipe", 2, 1, 5, 4),
    ("slimpipe", 4, 1, 4, 3),
    ("slimpipe", 2, 2, 3, 2),
    ("slimpipe", 4, 2, 4, 8),
    ("slimpipe", 8, 1, 16, 8),
    ("interleaved", 2, 2, 4, 1),
    ("interleaved", 4, 2, 8, 1),
]
_RECEIVES = (Kind.RECV_F, Kind.RECV_B)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_every_receive_is_posted_once_at_or_before_its_wait_in_link_order(shape):
    schedule = executable(*shape)
    for rank, row in enumerate(schedule.ranks):
        posts = receive_posts(schedule)[rank]
        listed = [(index, a) for index in sorted(posts) for a in posts[index]]
        receives = [(i, a) for i, a in enumerate(row) if a.kind in _RECEIVES]
        assert sorted(a for _, a in listed) == sorted(a for _, a in receives)
        where = {a: index for index, a in listed}
        assert all(where[a] <= i for i, a in receives)
        for peer in range(len(schedule.ranks)):  # each directed link: posted in its RECV order

            def sender(a):
                key = comm_key(schedule, rank, a)
                return schedule.placement(key[1] + (1 if a.kind is Kind.RECV_B else -1))[0]

            posted = [a for _, a in listed if sender(a) == peer]
            assert posted == [a for _, a in receives if sender(a) == peer]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_every_pair_posts_its_messages_in_an_order_nccl_can_run(shape):
    assert pair_order_problems(executable(*shape)) == []


def _after_the_compute_ahead(schedule, behind=False):
    """The earlier rules: each receive right after (or, ``behind``, right before) the last compute ahead of its RECV."""
    out = []
    for row in schedule.ranks:
        posts, last = {}, None
        for index, a in enumerate(row):
            if a.kind.is_compute:
                last = index
            elif a.kind in _RECEIVES:
                posts.setdefault(index if last is None else last + (0 if behind else 1), []).append(a)
        out.append({i: tuple(v) for i, v in posts.items()})
    return tuple(out)


def test_the_earlier_placements_cross_the_two_directions():
    """Posted before the compute ahead, 1F1B's steady state crosses; right after it, interleaving does."""
    one_f_one_b = executable("1f1b", 2, 1, 4, 1)
    assert pair_order_problems(one_f_one_b, _after_the_compute_ahead(one_f_one_b, behind=True))
    interleaved = executable("slimpipe", 2, 2, 2, 2)
    assert pair_order_problems(interleaved, _after_the_compute_ahead(interleaved)) != []


def test_posted_before_names_the_action_the_receive_is_posted_before():
    schedule = executable("slimpipe", 2, 1, 2, 2)
    row = schedule.ranks[1]
    before = posted_before(schedule, 1)
    first = next(a for a in row if a.kind is Kind.RECV_F)
    assert before[first] == first  # nothing computed before rank 1's first receive
    assert all(row.index(before[a]) <= row.index(a) for a in row if a.kind in _RECEIVES)


def test_the_simulator_holds_a_received_buffer_from_its_posting():
    """Each receive buffer appears in rank memory when the action it is posted before starts: a
    compute's start, else when the rank's previous compute or wait ended."""
    schedule = executable("slimpipe", 4, 1, 4, 3)
    run = _Run(schedule, UnitCosts())
    run.run()
    for rank, row in enumerate(schedule.ranks):
        got = sorted(d[0] for d in run.mem[rank] if len(d) >= 5 and d[4] > 0)
        mine = [e for e in run.events if e.rank == rank and e.stream in ("compute", "recv")]
        starts = {e.name: e.start for e in mine if e.stream == "compute"}
        want = []
        for a in row:
            if a.kind in _RECEIVES:
                post = row.index(posted_before(schedule, rank)[a])
                if row[post].kind.is_compute:
                    want.append(starts[str(row[post])])
                else:
                    earlier = {str(x) for x in row[:post]}
                    want.append(max((e.end for e in mine if e.name in earlier), default=0.0))
        assert got == pytest.approx(sorted(want)), rank


@pytest.mark.parametrize(
    "shape", [("slimpipe", 2, 1, 3, 2), ("slimpipe", 2, 2, 3, 2), ("interleaved", 2, 2, 4, 1), ("1f1b", 4, 1, 4, 1)]
)
def test_the_vocabulary_exchanges_hold_ranks_in_the_walk_and_pairs_still_agree(shape):
    """Under ``vocab_parallel`` every rank meets the exchanges; no rank passes one alone, and the
    runtime ends a communication point there."""
    schedule = executable(*shape)
    joins = every_rank_joins(schedule)
    assert all(joins[rank] for rank in range(schedule.pp))
    assert pair_order_problems(schedule, joins=joins) == []
    assert receive_posts(schedule, joins) != receive_posts(schedule) or shape[0] == "1f1b"
