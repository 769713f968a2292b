"""Steps 2 and 3 of Zeppelin's placement (``placement.py``): sequences with chosen splits into node
buckets, then rank buckets inside each node (``greedy.py``), then a local search per node.
"""

from __future__ import annotations

import bisect

from megatron_slim.plan.cp.estimate import SplitOption
from megatron_slim.plan.cp.greedy import Buckets, greedy
from megatron_slim.plan.cp.topology import CPTopology


def polish(buckets: Buckets, splits: list[SplitOption], topo: CPTopology) -> None:
    """Step 3's local search in every node, in place. Nodes are independent: a node-local
    sequence's moves touch only its own node's ranks."""
    buckets.forget()
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
