"""Where stage 0 meets every rank over the input embedding (``vocab_joins``' ``EmbeddingJoin``),
which embedding gradients each meeting hands over, and that no rank waits forever: the schedule
walked with blocking receives, the output exchange's rendezvous of all ranks per microbatch, and
the embedding joins (stage 0 waits for every rank to reach its join; a rank waits for stage 0's)."""

import pytest

from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.plan.schedule.ir import Action, Kind
from megatron_slim.plan.schedule.vocab import EmbeddingJoin, OutputJoin, vocab_joins
from tests.plan._vocab_walk import walk as _walk


def embedding_exchange_steps(schedule, rank):
    """``({position: join}, tail)``: the embedding joins alone (one per position here)."""
    joins, tail = vocab_joins(schedule, rank)
    found = {p: [j for j in js if isinstance(j, EmbeddingJoin)] for p, js in joins.items()}
    assert all(len(js) <= 1 for js in found.values())
    return {p: js[0] for p, js in found.items() if js}, tail


SHAPES = [("slimpipe", m, n) for m, n in [(1, 1), (2, 2), (3, 4), (5, 3)]] + [("1f1b", m, 1) for m in (1, 3, 6)]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("kind,microbatches,slices", SHAPES)
def test_every_rank_reaches_the_end_with_the_embedding_and_output_exchanges(kind, pp, microbatches, slices):
    schedule = executable(kind, pp, 1, microbatches, slices)
    assert _walk(schedule) == [0] * pp
    assert _walk(executable_forward_only(schedule)) == [0] * pp


def test_the_walk_finds_a_rank_serving_after_it_waits_for_the_forward_input():
    def too_late(schedule, rank):  # serve right after RECV_F instead of before it
        joins, tail = vocab_joins(schedule, rank)
        moved = {p + (rank > 0 and isinstance(js[0], EmbeddingJoin)): js for p, js in joins.items()}
        return moved, tail

    assert _walk(executable("1f1b", 2, 1, 3, 1), too_late)[0] < 0


def test_1f1b_pp2_by_hand():
    # stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 RECV_B2 B2
    # rank 1:  RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2
    schedule = executable("1f1b", 2, 1, 3, 1)
    first = {0: EmbeddingJoin((0, 0), ()), 2: EmbeddingJoin((1, 0), ()), 6: EmbeddingJoin((2, 0), ((0, 0),))}
    assert embedding_exchange_steps(schedule, 0) == (first, ((1, 0), (2, 0)))
    served = {0: first[0], 4: first[2], 8: first[6]}
    assert embedding_exchange_steps(schedule, 1) == (served, ((1, 0), (2, 0)))


@pytest.mark.parametrize("kind,microbatches,slices", [("slimpipe", 4, 3), ("1f1b", 5, 1)])
def test_every_gradient_is_handed_over_once_after_stage_0_computed_it(kind, microbatches, slices):
    schedule = executable(kind, 3, 1, microbatches, slices)
    row = schedule.ranks[0]
    for rank in range(3):
        joins, tail = embedding_exchange_steps(schedule, rank)
        lookups = sorted(j.lookup for j in joins.values())
        assert lookups == [(m, j) for m in range(microbatches) for j in range(slices)]
        handed = [k for j in joins.values() for k in j.grads] + list(tail)
        assert sorted(handed) == lookups
        for step, join in embedding_exchange_steps(schedule, 0)[0].items():
            backwards = {(a.microbatch, a.slice) for a in row[:step] if a.kind is Kind.B}
            assert set(join.grads) <= backwards
        a = schedule.ranks[rank]
        assert all(a[s].kind is (Kind.F if rank == 0 else Kind.RECV_F) for s in joins)


def test_forward_only_hands_over_no_gradients():
    joins, tail = embedding_exchange_steps(executable_forward_only(executable("slimpipe", 2, 1, 3, 2)), 1)
    assert tail == () and all(j.grads == () for j in joins.values())


def test_interleaved_a_rank_serves_before_waiting_for_a_gradient_stage_0_sends_after_the_lookup():
    # interleaved pp3 vpp2, 6 microbatches: rank 2 waits for the chunk-1 backward of microbatch 0
    # (stage 3, on rank 0) before it receives microbatch 4's forward, and rank 0 runs that backward
    # only after its forward (lookup) of microbatch 4: rank 2 serves microbatch 4 before that wait
    schedule = executable("interleaved", 3, 2, 6, 1)
    row = schedule.ranks[2]
    serves = {j.lookup: p for p, j in embedding_exchange_steps(schedule, 2)[0].items()}
    assert row[serves[(4, 0)]] == Action(Kind.RECV_B, 0, 0, 0)
    assert row.index(Action(Kind.RECV_F, 0, 4, 0)) > serves[(4, 0)]
    assert row[serves[(3, 0)]] == Action(Kind.RECV_F, 0, 3, 0)  # where it would wait for stage 0 anyway
    assert _walk(schedule) == [0, 0, 0]


@pytest.mark.parametrize("kind,pp,vpp,microbatches,slices", [("interleaved", 2, 2, 4, 1), ("slimpipe", 3, 2, 3, 3)])
def test_interleaved_lookups_and_gradients_are_those_of_stage_0_on_the_first_chunk(kind, pp, vpp, microbatches, slices):
    schedule = executable(kind, pp, vpp, microbatches, slices)
    every = [(m, j) for m in range(microbatches) for j in range(slices)]
    for rank in range(pp):
        joins, tail = embedding_exchange_steps(schedule, rank)
        assert sorted(j.lookup for j in joins.values()) == every
        assert sorted([k for j in joins.values() for k in j.grads] + list(tail)) == every
        outputs = [
            j.microbatch for js in vocab_joins(schedule, rank)[0].values() for j in js if isinstance(j, OutputJoin)
        ]
        assert outputs == list(range(microbatches))
    stage0 = schedule.ranks[0]
    for position, join in embedding_exchange_steps(schedule, 0)[0].items():
        assert stage0[position] == Action(Kind.F, 0, *join.lookup)
