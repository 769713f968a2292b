"""DP-merge in ``megatron-slim train`` (``plan/pack/dp_merge.py``): SlimPack splits an outlier into a
head and a tail on two DP ranks, the transfers name their rows, and the order check refuses exactly
the schedules whose K/V receives can never be served (checked against an independent cycle search)."""

import itertools
import random

import pytest

from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.dp_merge import MergeEnd, MergeTransfer, check_merge_order, merge_transfers
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece
from megatron_slim.plan.pack.training import Sample, Window, _slimpipe_steps, pack_iteration
from megatron_slim.plan.schema import ConfigError

COSTS = SliceCosts(1e-6, 1e-8, 2e-6, 2.5e-8, 1.0, 1e-9)
SEQ = 128
SLICES = (32, 32, 32, 32)


def _samples(lengths):
    return [Sample(i, 0, n, True) for i, n in enumerate(lengths)]


def test_slimpack_splits_the_outlier_over_two_replicas_when_allowed():
    lengths = [128, 7, 45, 20, 9, 13]
    packing = pack_iteration("slimpack", _samples(lengths), COSTS, 2, SEQ, merge_slices=SLICES)
    (t,) = packing.merges
    assert t.sample == 0 and t.head.rank != t.tail.rank and t.prefix == 64 and t.tail.length == 64
    head = packing.windows[t.head.rank][t.head.window].pieces
    tail = packing.windows[t.tail.rank][t.tail.window].pieces
    assert Piece(0, 0, 64) in head and Piece(0, 64, 64) in tail
    assert sum(p.length for p in head[: head.index(Piece(0, 0, 64))]) == t.head.row
    assert sum(p.length for p in tail[: tail.index(Piece(0, 64, 64))]) == t.tail.row
    assert packing.record()["dp_merged"] == [0] and "1 DP-merged" in packing.summary()
    plain = pack_iteration("slimpack", _samples(lengths), COSTS, 2, SEQ)
    assert plain.merges == () and all(p.length == n for p in plain.plan.ranks[0][0].pieces for n in [lengths[p.sample]])


def test_without_an_outlier_or_a_merge_runtime_nothing_is_merged():
    small = pack_iteration("slimpack", _samples([30, 40, 20, 25, 35, 30]), COSTS, 2, SEQ, merge_slices=SLICES)
    assert small.merges == ()
    for method in ("megatron", "bfd"):
        assert pack_iteration(method, _samples([128, 7, 45]), COSTS, 2, SEQ, merge_slices=SLICES).merges == ()


def _plan(ranks):
    lengths = {}
    for packs in ranks:
        for pack in packs:
            for p in pack:
                lengths[p.sample] = max(lengths.get(p.sample, 0), p.start + p.length)
    packs = tuple(tuple(MicroPack(tuple(m), 0.0, 0.0, 0.0) for m in r) for r in ranks)
    return PackingPlan("slimpack", tuple(lengths[s] for s in sorted(lengths)), SEQ, float("inf"), packs)


def test_transfers_name_rows_and_refuse_more_than_two_pieces():
    plan = _plan([[[Piece(1, 0, 10), Piece(0, 0, 40)]], [[Piece(0, 40, 30)]]])
    windows = [[Window(tuple(m.pieces), SEQ - m.tokens) for m in r] for r in plan.ranks]
    assert merge_transfers(plan, windows) == (MergeTransfer(0, MergeEnd(0, 0, 10, 40), MergeEnd(1, 0, 0, 30)),)
    three = _plan([[[Piece(0, 0, 10)], [Piece(0, 30, 5)]], [[Piece(0, 10, 20)]]])
    windows = [[Window(tuple(m.pieces), SEQ - m.tokens) for m in r] for r in three.ranks]
    with pytest.raises(ConfigError, match="DP-merged sample 0 has 3 pieces.*allowed: two pieces"):
        merge_transfers(three, windows)


def _deadlocks(transfers, orders, slice_lengths) -> bool:
    """Independent: a cycle in the graph of every rank's program order plus the transfer edges."""
    edges = {}
    for r, order in enumerate(orders):
        for a, b in zip(order, order[1:]):
            edges.setdefault((r, a), []).append((r, b))
    for t in transfers:
        send, receive = t.head.slice_at(slice_lengths, True), t.tail.slice_at(slice_lengths, False)
        h, tl = t.head, t.tail
        edges.setdefault((h.rank, ("F", h.window, send)), []).append((tl.rank, ("F", tl.window, receive)))
        edges.setdefault((tl.rank, ("B", tl.window, receive)), []).append((h.rank, ("B", h.window, send)))
    state = {}

    def cyclic(node):
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1 or (nxt not in state and cyclic(nxt)):
                return True
        state[node] = 2
        return False

    return any(node not in state and cyclic(node) for node in list(edges))


def _refused(transfers, orders, slice_lengths) -> bool:
    try:
        check_merge_order(transfers, orders, slice_lengths)
    except ConfigError:
        return True
    return False


def test_order_check_refuses_exactly_the_cyclic_orders():
    rng, seen = random.Random(7), {True: 0, False: 0}
    for _ in range(300):
        windows = [rng.randint(1, 3), rng.randint(1, 3)]
        slices = tuple(rng.choice([[SEQ], [64, 64], [32, 32, 32, 32], [50, 40, 38]]))
        transfers = []
        for sample in range(rng.randint(1, 3)):
            h, t = rng.sample([0, 1], 2)
            head = MergeEnd(h, rng.randrange(windows[h]), rng.randrange(SEQ - 20), 20)
            tail = MergeEnd(t, rng.randrange(windows[t]), rng.randrange(SEQ - 20), 20)
            transfers.append(MergeTransfer(sample, head, tail))
        orders = [_slimpipe_steps(n, len(slices)) for n in windows]
        want = _deadlocks(transfers, orders, slices)
        assert _refused(transfers, orders, slices) == want, (transfers, windows, slices)
        seen[want] += 1
    assert min(seen.values()) > 10  # both outcomes were exercised


def test_a_deadlock_is_refused_with_each_stuck_rank_named():
    # rank 0's head waits in B0.0 for rank 1's B1.0, which runs after rank 1's F1.0 waits for rank 0's F1.0
    orders = [_slimpipe_steps(2, 1), _slimpipe_steps(2, 1)]
    transfers = [
        MergeTransfer(0, MergeEnd(0, 0, 0, 10), MergeEnd(1, 1, 0, 10)),
        MergeTransfer(1, MergeEnd(1, 0, 0, 10), MergeEnd(0, 1, 0, 10)),
        MergeTransfer(2, MergeEnd(0, 1, 20, 10), MergeEnd(1, 0, 20, 10)),
    ]
    with pytest.raises(ConfigError, match=r"deadlocks.*\n  rank 0: .* waits for rank 1"):
        check_merge_order(transfers, orders, (SEQ,))
    assert not _refused(transfers[:1], orders, (SEQ,))
    assert list(itertools.chain(*orders))  # the schedules are not empty
