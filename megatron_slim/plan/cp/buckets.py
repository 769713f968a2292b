"""Steps 2 and 3 of Zeppelin's placement (``placement.py``): sequences with chosen splits into node
buckets, then rank buckets inside each node, then a local search per node.

``greedy`` is the list-scheduling part; the refinement calls it for every trial split, so it is
written for speed without changing a pick: ties break exactly as "the least-loaded node / rank,
the lowest index among equals" and every load is summed in the same order. A trial may stop it
early (``give_up_above``) once it cannot beat the current placement.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

from megatron_slim.plan.cp.estimate import SplitOption
from megatron_slim.plan.cp.topology import CPTopology


@dataclass
class Buckets:
    members: list[tuple[int, ...]]  # every sequence's ranks, ascending (hence node-major)
    loads: list[float]  # every rank's estimated load
    node_items: list[list[int]]  # node-local sequences of every node


class _NodeState:
    def __init__(self, n: int, cap: int) -> None:
        self.load = [0.0] * n
        self.tokens = [0.0] * n
        self.cap = cap


def _inter_node(
    lengths: tuple[int, ...], splits: list[SplitOption], order: list[int], topo: CPTopology, state: _NodeState
) -> tuple[list[tuple[int, ...]], list[float]]:
    """Inter-node sequences, heaviest first, on the ``k`` least-loaded nodes (ties: lower index)."""
    m, n = topo.ranks_per_node, topo.num_nodes
    rank_load = [0.0] * topo.num_ranks
    members: list[tuple[int, ...]] = [()] * len(lengths)
    for i in order:
        est = splits[i].est_s
        nodes = sorted(sorted(range(n), key=lambda c: (state.load[c], c))[: splits[i].nodes])
        members[i] = tuple(r for node in nodes for r in topo.ranks_of_node(node))
        for node in nodes:
            state.load[node] += est * m
            state.tokens[node] += lengths[i] / len(nodes)
        for r in members[i]:
            rank_load[r] += est
    return members, rank_load


def _node_of_each(
    lengths: tuple[int, ...],
    local: list[int],
    est: list[float],
    work: list[float],
    overflow_s: float,
    state: _NodeState,
    give_up: tuple[list[float], float],
) -> list[list[int]] | None:
    """Node-local sequences, in the given order, each to the node (lowest index on ties) where
    load plus the penalty for tokens beyond the node's share ends lowest.

    ``give_up = (rank load each node starts with, limit)``: None once a sequence's per-member cost
    on top of its node's starting load exceeds the limit (its members end at least that high)."""
    node_load, node_tokens, cap = state.load, state.tokens, state.cap
    start, limit = give_up
    node_items: list[list[int]] = [[] for _ in node_load]
    for i in local:
        s = lengths[i]
        node = node_load.index(min(node_load))  # the first least-loaded node ends lowest unless it
        if overflow_s and node_tokens[node] + s > cap:  # overflows: ends are never below loads
            ends = [
                load + overflow_s * (tok + s - cap) if tok + s > cap else load
                for load, tok in zip(node_load, node_tokens)
            ]
            node = ends.index(min(ends))
        if start[node] + est[i] > limit:
            return None
        node_load[node] += work[i]
        node_tokens[node] += s
        node_items[node].append(i)
    return node_items


def _fill_ranks(
    ranks: tuple[int, ...],
    items: list[int],
    est: list[float],
    span: list[int],
    rank_load: list[float],
    members: list[tuple[int, ...]],
    order: list[tuple[float, int, int]],
) -> None:
    """Pieces by decreasing per-member cost (``order[i]`` = ``(-est, -span, i)``), each on the
    node's least-loaded ranks: a heap of ``(load, rank)`` pops them as "least load, then lowest rank"."""
    heap = [(rank_load[r], r) for r in ranks]
    heapq.heapify(heap)
    for i in sorted(items, key=order.__getitem__):
        e = est[i]
        if span[i] == 1:
            load, r = heap[0]
            heapq.heapreplace(heap, (load + e, r))
            members[i] = (r,)
        else:
            picked = [heapq.heappop(heap) for _ in range(span[i])]
            for load, r in picked:
                heapq.heappush(heap, (load + e, r))
            members[i] = tuple(sorted(r for _, r in picked))
    for load, r in heap:
        rank_load[r] = load


def greedy(
    lengths: tuple[int, ...],
    splits: list[SplitOption],
    topo: CPTopology,
    overflow_s: float = 0.0,
    give_up_above: float = math.inf,
) -> Buckets | None:
    """Node buckets, then rank buckets (no local search). ``overflow_s``: what a token beyond a
    node's balanced share ``ceil(L / N)`` costs the node (the remap must move it across nodes).

    None once some rank's load is certain to end above ``give_up_above``: loads only grow here,
    and a node's load is its ranks' sum (up to rounding, hence the margin on that check)."""
    m, n = topo.ranks_per_node, topo.num_nodes
    state = _NodeState(n, -(-sum(lengths) // n))
    est = [sp.est_s for sp in splits]
    span = [sp.span for sp in splits]
    work = [e * g for e, g in zip(est, span)]
    by_total = sorted(range(len(lengths)), key=work.__getitem__, reverse=True)  # stable: ties by index
    nodes = [sp.nodes for sp in splits]
    local = [i for i in by_total if nodes[i] == 1]
    inter = [i for i in by_total if nodes[i] > 1] if len(local) < len(by_total) else []
    members, rank_load = _inter_node(lengths, splits, inter, topo, state)
    # every rank of a node starts with the same load: the inter-node sequences span whole nodes
    start = rank_load[::m]  # node k's first rank is k * m
    node_items = _node_of_each(lengths, local, est, work, overflow_s, state, (start, give_up_above))
    if node_items is None or max(state.load) > m * give_up_above * (1 + 1e-9):
        return None
    # nodes are independent from here on: a trial visits the busiest first, where it gives up soonest
    visit = range(n) if give_up_above == math.inf else sorted(range(n), key=state.load.__getitem__, reverse=True)
    order = list(zip([-e for e in est], [-g for g in span], range(len(est))))
    for node in visit:
        items, ranks = node_items[node], topo.ranks_of_node(node)
        _fill_ranks(ranks, items, est, span, rank_load, members, order)
        if max(rank_load[ranks[0] : ranks[-1] + 1]) > give_up_above:  # a node's ranks are a range
            return None
    return Buckets(members, rank_load, node_items)


def polish(buckets: Buckets, splits: list[SplitOption], topo: CPTopology) -> None:
    """Step 3's local search in every node, in place. Nodes are independent: a node-local
    sequence's moves touch only its own node's ranks."""
    for node, items in enumerate(buckets.node_items):
        _polish(topo.ranks_of_node(node), items, splits, buckets.members, buckets.loads)


def partition(
    lengths: tuple[int, ...],
    splits: list[SplitOption],
    topo: CPTopology,
    overflow_s: float = 0.0,
    *,
    polish_nodes: bool = True,
) -> tuple[list[tuple[int, ...]], list[float]]:
    """Steps 2 and 3: members of every sequence and the estimated load of every rank."""
    buckets = greedy(lengths, splits, topo, overflow_s)
    assert buckets is not None  # nothing to give up on
    if polish_nodes:
        polish(buckets, splits, topo)
    return buckets.members, buckets.loads


def _polish(
    ranks: tuple[int, ...],
    items: list[int],
    splits: list[SplitOption],
    members: list[tuple[int, ...]],
    load: list[float],
) -> None:
    """Local search inside a node after the greedy pass: move one member of a piece from the
    busiest rank to the idlest (or swap two pieces between them) while that lowers the pair's
    maximum; a bounded number of moves, each the one closest to halving the gap."""
    held: dict[int, set[int]] = {r: set() for r in ranks}
    for i in items:
        for r in members[i]:
            held[r].add(i)
    est = {i: splits[i].est_s for i in items}
    for _ in range(8 * len(ranks)):
        hi = max(ranks, key=load.__getitem__)  # the first of equals: the lowest rank
        lo = min(ranks, key=load.__getitem__)
        gap = load[hi] - load[lo]
        if gap <= 0:
            return
        on_hi = sorted(held[hi] - held[lo], key=lambda i: (est[i], i))
        on_lo = sorted(held[lo] - held[hi], key=lambda i: (est[i], i))
        lo_costs = [est[j] for j in on_lo]
        largest_lo = lo_costs[-1] if lo_costs else 0.0
        best, best_delta = None, 0.0
        for i in on_hi:  # moving e from hi to lo lowers the pair's maximum iff 0 < e < gap
            e_i = est[i]
            if e_i - largest_lo >= gap:
                break  # this and every later (costlier) piece moves too much with any partner
            # the partner j whose cost is closest to e_i - gap / 2 (none: a plain move)
            k = bisect.bisect_left(lo_costs, e_i - gap / 2)
            for j in [None] + [on_lo[x] for x in (k - 1, k) if 0 <= x < len(on_lo)]:
                e = e_i - (est[j] if j is not None else 0.0)
                if 0 < e < gap and abs(gap / 2 - e) < abs(gap / 2 - best_delta):
                    best, best_delta = (i, j), e
        if best is None or best_delta < 1e-12:
            return
        for moved, src, dst in ((best[0], hi, lo), (best[1], lo, hi)):
            if moved is None:
                continue
            members[moved] = tuple(sorted(dst if r == src else r for r in members[moved]))
            held[src].discard(moved)
            held[dst].add(moved)
            load[src] -= est[moved]
            load[dst] += est[moved]
