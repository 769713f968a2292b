"""Steps 2 and 3 of Zeppelin's placement (``placement.py``) without the local search: sequences
with chosen splits into node buckets (longest-processing-time greedy), then rank buckets inside
each node.

The refinement calls ``greedy`` for every trial split, so it is written for speed without
changing a pick: ties break exactly as "the least-loaded node / rank, the lowest index among
equals" and every load is summed in the same order. A trial may stop early (``give_up_above``)
once it cannot beat the current placement, and may name the current placement (``like``), whose
work it reuses where the one changed sequence cannot have altered it: the inter-node phase when
the sequence is node-local before and after, and the rank filling of every node whose input
(starting load and pieces, the changed sequence not among them) is the same.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from itertools import chain

from megatron_slim.plan.cp.estimate import SplitOption
from megatron_slim.plan.cp.topology import CPTopology


@dataclass
class _Fill:
    """One node's rank filling: input (every rank's starting load, the pieces in order) and result."""

    start: float
    pieces: list[int]
    loads: list[float]


@dataclass
class _AfterInter:
    """Node loads and tokens after the inter-node phase, and the load it leaves on each node's ranks."""

    load: list[float]
    tokens: list[float]
    start: list[float]


@dataclass
class _Orders:
    """Per-sequence numbers of the splits and the two orders the greedy visits sequences in."""

    est: list[float]  # per-member cost
    span: list[int]
    work: list[float]  # est * span
    nodes: list[int]
    by_work: list[int]  # every sequence by decreasing work, then index
    by_est: list[int]  # every sequence by decreasing est, then decreasing span, then index


@dataclass
class Buckets:
    members: list[tuple[int, ...]]  # every sequence's ranks, ascending (hence node-major)
    loads: list[float]  # every rank's estimated load
    node_items: list[list[int]]  # node-local sequences of every node
    # what a later ``greedy(like=(this, i))`` may reuse; emptied once the buckets change (``forget``)
    splits: list[SplitOption] = field(default_factory=list)
    orders: _Orders | None = None
    after_inter: _AfterInter | None = None
    fills: list[_Fill] = field(default_factory=list)

    def forget(self) -> None:
        """Drop the reusable work: ``members`` and ``loads`` are about to change in place."""
        self.splits, self.orders, self.after_inter, self.fills = [], None, None, []


class _NodeState:
    def __init__(self, n: int, cap: int) -> None:
        self.load = [0.0] * n
        self.tokens = [0.0] * n
        self.cap = cap


def _inter_node(
    lengths: tuple[int, ...], splits: list[SplitOption], order: list[int], topo: CPTopology, state: _NodeState
) -> tuple[list[tuple[int, ...]], list[float]]:
    """Inter-node sequences, heaviest first, on the ``k`` least-loaded nodes (ties: lower index).
    Returns every sequence's members (inter-node ones only) and the load of each node's ranks:
    whole-node spans load every rank of a node alike."""
    m, n = topo.ranks_per_node, topo.num_nodes
    load, tokens = state.load, state.tokens
    per_rank = [0.0] * n
    members: list[tuple[int, ...]] = [()] * len(lengths)
    node_ranks = [topo.ranks_of_node(node) for node in range(n)] if order else []
    for i in order:
        split = splits[i]
        est = split.est_s
        nodes = sorted(sorted(range(n), key=load.__getitem__)[: split.nodes])  # stable: ties by index
        members[i] = tuple(chain.from_iterable(map(node_ranks.__getitem__, nodes)))
        share = lengths[i] / len(nodes)
        for node in nodes:
            load[node] += est * m
            tokens[node] += share
            per_rank[node] += est
    return members, per_rank


def _node_of_each(
    lengths: tuple[int, ...],
    local: list[int],
    est: list[float],
    work: list[float],
    overflow_s: float,
    state: _NodeState,
    give_up: tuple[list[float], float],
) -> list[int] | None:
    """Node-local sequences, in the given order, each to the node (lowest index on ties) where
    load plus the penalty for tokens beyond the node's share ends lowest; returns every
    sequence's node (-1: not node-local).

    ``give_up = (rank load each node starts with, limit)``: None once a sequence's per-member cost
    on top of its node's starting load exceeds the limit (its members end at least that high)."""
    node_load, node_tokens, cap = state.load, state.tokens, state.cap
    start, limit = give_up
    node_of = [-1] * len(lengths)
    for i in local:
        s = lengths[i]
        low = min(node_load)
        node = node_load.index(low)  # the first least-loaded node ends lowest unless it overflows
        if overflow_s and node_tokens[node] + s > cap:  # then a node can end lower only if its load
            end = low + overflow_s * (node_tokens[node] + s - cap)  # is at most this (ends >= loads)
            for j, load in enumerate(node_load):
                if load <= end and j != node:
                    tok = node_tokens[j]
                    e = load + overflow_s * (tok + s - cap) if tok + s > cap else load
                    if e < end or (e == end and j < node):  # the first of equal ends
                        end, node = e, j
        if start[node] + est[i] > limit:
            return None
        node_load[node] += work[i]
        node_tokens[node] += s
        node_of[i] = node
    return node_of


def _fill_ranks(
    ranks: tuple[int, ...],
    start: float,
    pieces: list[int],
    est: list[float],
    span: list[int],
    members: list[tuple[int, ...]],
) -> list[float]:
    """``pieces`` (by decreasing per-member cost, then span, then index), each on the node's
    least-loaded ranks ("least load, then lowest rank"). Every rank starts at ``start``; returns
    the ranks' loads."""
    # while one-rank pieces fit on untouched ranks, each takes the next one: an untouched rank is
    # the least loaded as long as a piece's cost raises its rank's load (est > 0 barring rounding)
    k = 0
    for i in pieces[: len(ranks)]:
        if span[i] != 1 or not start + est[i] > start:
            break
        members[i] = (ranks[k],)
        k += 1
    loads = [start + est[i] for i in pieces[:k]] + [start] * (len(ranks) - k)
    if k == len(pieces):
        return loads
    heap = list(zip(loads, ranks))  # a heap of (load, rank) pops "least load, then lowest rank"
    heapq.heapify(heap)
    for i in pieces[k:]:
        e, g = est[i], span[i]
        if g == 1:
            load, r = heap[0]
            heapq.heapreplace(heap, (load + e, r))
            members[i] = (r,)
        else:
            picked = [heapq.heappop(heap) for _ in range(g)]
            for load, r in picked:
                heapq.heappush(heap, (load + e, r))
            members[i] = tuple(sorted(r for _, r in picked))
    first = ranks[0]
    for load, r in heap:
        loads[r - first] = load
    return loads


def _orders(splits: list[SplitOption], like: tuple[Buckets, int] | None) -> _Orders:
    """The splits' numbers and orders; from ``like``'s by moving the changed sequence alone."""
    base = like[0].orders if like is not None else None
    if base is None or like is None:
        est = [sp.est_s for sp in splits]
        span = [sp.span for sp in splits]
        work = [e * g for e, g in zip(est, span)]
        by_work = sorted(range(len(splits)), key=work.__getitem__, reverse=True)  # stable: ties by index
        by_span = sorted(range(len(splits)), key=span.__getitem__, reverse=True)
        by_est = sorted(by_span, key=est.__getitem__, reverse=True)
        return _Orders(est, span, work, [sp.nodes for sp in splits], by_work, by_est)
    i, split = like[1], splits[like[1]]
    est, span, work, nodes = base.est.copy(), base.span.copy(), base.work.copy(), base.nodes.copy()
    est[i], span[i], work[i], nodes[i] = split.est_s, split.span, split.est_s * split.span, split.nodes
    by_work, by_est = base.by_work.copy(), base.by_est.copy()
    by_work.remove(i)
    by_work.insert(bisect.bisect_left(by_work, (-work[i], i), key=lambda j: (-work[j], j)), i)
    by_est.remove(i)
    by_est.insert(bisect.bisect_left(by_est, (-est[i], -span[i], i), key=lambda j: (-est[j], -span[j], j)), i)
    return _Orders(est, span, work, nodes, by_work, by_est)


def _fill_nodes(
    visit: list[int] | range,
    topo: CPTopology,
    start: list[float],
    pieces: list[list[int]],
    orders: _Orders,
    members: list[tuple[int, ...]],
    like: tuple[Buckets, int] | None,
    give_up_above: float,
) -> tuple[list[float], list[_Fill]] | None:
    """Step 3 in every node, in ``visit`` order; ``like``'s result for a node whose input is the
    same. Every rank's load and every node's fill, or None once a rank ends above ``give_up_above``."""
    old = like[0].fills if like is not None else []
    changed = like[1] if like is not None else -1
    fills: list[_Fill] = [_Fill(0.0, [], [])] * topo.num_nodes
    rank_load = [0.0] * topo.num_ranks
    for node in visit:
        ranks, first = topo.ranks_of_node(node), start[node]
        fill = old[node] if old else None
        if fill is not None and fill.start == first and fill.pieces == pieces[node] and changed not in fill.pieces:
            for i in fill.pieces:
                members[i] = like[0].members[i]  # type: ignore[index]  # old is empty without like
        else:
            loads = _fill_ranks(ranks, first, pieces[node], orders.est, orders.span, members)
            fill = _Fill(first, pieces[node], loads)
        if max(fill.loads) > give_up_above:
            return None
        fills[node] = fill
        rank_load[ranks[0] : ranks[-1] + 1] = fill.loads  # a node's ranks are a range
    return rank_load, fills


def _inter_phase(
    lengths: tuple[int, ...],
    splits: list[SplitOption],
    inter: list[int],
    topo: CPTopology,
    state: _NodeState,
    like: tuple[Buckets, int] | None,
) -> tuple[list[tuple[int, ...]], _AfterInter]:
    """``_inter_node``, or its result in ``like`` when the changed sequence is node-local in both."""
    if like is not None:
        base, changed = like
        after = base.after_inter
        if after is not None and splits[changed].nodes == 1 and base.splits[changed].nodes == 1:
            state.load, state.tokens = list(after.load), list(after.tokens)
            members: list[tuple[int, ...]] = [()] * len(lengths)
            for i in inter:
                members[i] = base.members[i]
            return members, after
    members, start = _inter_node(lengths, splits, inter, topo, state)
    return members, _AfterInter(list(state.load), list(state.tokens), start)


def greedy(
    lengths: tuple[int, ...],
    splits: list[SplitOption],
    topo: CPTopology,
    overflow_s: float = 0.0,
    give_up_above: float = math.inf,
    like: tuple[Buckets, int] | None = None,
) -> Buckets | None:
    """Node buckets, then rank buckets (no local search). ``overflow_s``: what a token beyond a
    node's balanced share ``ceil(L / N)`` costs the node (the remap must move it across nodes).

    None once some rank's load is certain to end above ``give_up_above``: loads only grow here,
    and a node's load is its ranks' sum (up to rounding, hence the margin on that check).

    ``like = (buckets, i)``: ``greedy``'s result for the same lengths, topology and ``overflow_s``
    with splits that differ from ``splits`` at sequence ``i`` only; its work is reused."""
    m, n = topo.ranks_per_node, topo.num_nodes
    state = _NodeState(n, -(-sum(lengths) // n))
    orders = _orders(splits, like)
    nodes = orders.nodes
    local = [i for i in orders.by_work if nodes[i] == 1]
    inter = [i for i in orders.by_work if nodes[i] > 1] if len(local) < len(nodes) else []
    members, after = _inter_phase(lengths, splits, inter, topo, state, like)
    limit = (after.start, give_up_above)
    node_of = _node_of_each(lengths, local, orders.est, orders.work, overflow_s, state, limit)
    if node_of is None or max(state.load) > m * give_up_above * (1 + 1e-9):
        return None
    node_items: list[list[int]] = [[] for _ in range(n)]
    for i in local:
        node_items[node_of[i]].append(i)
    pieces: list[list[int]] = [[] for _ in range(n)]  # every node's, by decreasing est
    for i in orders.by_est:
        if node_of[i] >= 0:
            pieces[node_of[i]].append(i)
    # nodes are independent from here on: a trial visits the busiest first, where it gives up soonest
    visit = range(n) if give_up_above == math.inf else sorted(range(n), key=state.load.__getitem__, reverse=True)
    filled = _fill_nodes(visit, topo, after.start, pieces, orders, members, like, give_up_above)
    if filled is None:
        return None
    return Buckets(members, filled[0], node_items, splits, orders, after, filled[1])
