"""Where stage 0 meets every rank over the input embedding (``embedding_exchange_steps``), which
embedding gradients each meeting hands over, and that no rank waits forever: the schedule walked
with blocking receives, the output exchange's rendezvous of all ranks per microbatch, and the
embedding joins (stage 0 waits for every rank to reach its join; a rank waits for stage 0's)."""

import pytest

from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.plan.schedule.ir import Kind
from megatron_slim.plan.schedule.vocab import EmbeddingJoin, embedding_exchange_steps, vocab_exchange_steps
from megatron_slim.plan.schedule.walk import produced, required


def _events(schedule, rank, joins_of=embedding_exchange_steps) -> list:
    embedding, _ = joins_of(schedule, rank)
    output = vocab_exchange_steps(schedule, rank)
    out: list = []
    for step, a in enumerate(schedule.ranks[rank]):
        if step in embedding:
            out.append(("emb", embedding[step].lookup))
        out.append(a)
        if step in output:
            out.append(("out", output[step]))
    return out


def _may_pass(event, r: int, heads: list, passed: list) -> bool:
    reached = [h == event or event in passed[q] for q, h in enumerate(heads)]
    if event[0] == "out":  # a collective: every rank has come to it
        return all(reached)
    return all(reached[1:]) if r == 0 else reached[0]  # stage 0 waits for every rank, the others for it


def _walk(schedule, joins_of=embedding_exchange_steps) -> list[int]:
    rows = [_events(schedule, r, joins_of) for r in range(schedule.pp)]
    pos, done, passed = [0] * len(rows), set(), [set() for _ in rows]
    moved = True
    while moved:
        moved = False
        heads = [row[p] if p < len(row) else None for row, p in zip(rows, pos)]
        for r, row in enumerate(rows):
            if pos[r] >= len(row):
                continue
            e = row[pos[r]]
            if isinstance(e, tuple):
                ok = _may_pass(e, r, heads, passed)
            else:
                ok = all(f in done for f in required(schedule, r, e))
            if ok:
                if isinstance(e, tuple):
                    passed[r].add(e)
                else:
                    done.add(produced(schedule, r, e))
                pos[r] += 1
                moved = True
                break  # heads changed
    return [p - len(row) for p, row in zip(pos, rows)]


SHAPES = [("slimpipe", m, n) for m, n in [(1, 1), (2, 2), (3, 4), (5, 3)]] + [("1f1b", m, 1) for m in (1, 3, 6)]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("kind,microbatches,slices", SHAPES)
def test_every_rank_reaches_the_end_with_the_embedding_and_output_exchanges(kind, pp, microbatches, slices):
    schedule = executable(kind, pp, 1, microbatches, slices)
    assert _walk(schedule) == [0] * pp
    assert _walk(executable_forward_only(schedule)) == [0] * pp


def test_the_walk_finds_a_rank_serving_after_it_waits_for_the_forward_input():
    def too_late(schedule, rank):  # serve right after RECV_F instead of before it
        joins, tail = embedding_exchange_steps(schedule, rank)
        return ({s + 1: j for s, j in joins.items()} if rank else joins), tail

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
