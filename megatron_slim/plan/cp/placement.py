"""Zeppelin's placement: per sequence local / intra-node / inter-node, then hierarchical balancing.

``plan_zeppelin(lengths, topo, costs)`` is pure and deterministic (ties break on indices), so
every rank computes the same ``CPPlan`` and can check it by ``digest()``.

Costs are per-member seconds of one layer's forward + backward from ``estimate.py``: causal
attention (~s^2), the token work done in the attention layout (~s: QKV/O with remapping, the MLP
too without) and the K/V traffic a split's ring cannot hide on its link class.

1. **Per-sequence split**: a rank's fair share is ``target = sum(local cost of every sequence) / C``.
   A sequence takes the smallest span whose per-member cost fits the target: one rank, ``g <= m``
   ranks of one node (zigzag over NVLink), or ``k`` whole nodes (zigzag with the routing layer, or
   all-to-all inside the nodes + ring across them, whichever is cheaper); when none fits, the
   cheapest per member. Short sequences stay local, medium ones split inside a node, long ones
   across nodes -- the split pays off only once a member's quadratic work hides its ring traffic.
2. **Node buckets first** (longest-processing-time greedy): inter-node sequences, heaviest first,
   take the ``k`` least-loaded nodes; every other sequence, by decreasing total cost, goes to the
   node whose load ends lowest, counting a penalty for tokens beyond the node's share
   ``ceil(L / N)`` (with remapping they must cross a NIC to reach the balanced layout).
3. **Then rank buckets inside each node**: pieces by decreasing per-member cost; a ``g``-rank piece
   takes the node's ``g`` least-loaded ranks, a local sequence the least-loaded one. A local search
   then moves one member of a piece from the node's busiest to its idlest rank, or swaps two
   pieces between them, while that lowers the pair's maximum.
4. **Refinement**: while it clearly lowers the estimated maximum rank load (or does not raise it
   and clearly lowers the load above the mean), a sequence on one of the busiest ranks moves to its next larger span
   and steps 2-3 are redone (trials without step 3's local search, which runs once at the end).
5. Sequences with the same kind and member set share one group (one ring).

Bound: steps 2-3 are list scheduling, so a node ends at most one sequence above the node average
and a rank, for single-rank pieces, at most one piece above its node's average; gang pieces
(``g > 1``) weaken the rank-level guarantee. The tests check ``max rank load <= 2 * max(total / C,
largest piece)`` on many random packs; on the benchmark's packs the busiest rank's estimated load
is typically 5-25% above ``total / C``.
"""

from __future__ import annotations

import bisect

from megatron_slim.plan.cp.assemble import GroupSpec
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import (
    ALL_LAYERS,
    SplitOption,
    SplitOptions,
    ZeppelinLayers,
    choose_split,
    local_time,
)
from megatron_slim.plan.cp.layout import GroupKind
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.schema import fail


def check_lengths(lengths: tuple[int, ...]) -> None:
    if not lengths:
        raise fail("lengths", lengths, "at least one sequence")
    for i, s in enumerate(lengths):
        if not isinstance(s, int) or s < 1:
            raise fail(f"lengths[{i}]", s, "a positive integer")


_REFINE_ROUNDS = 64
_REFINE_TRIES = 3
_REFINE_GAIN = 0.005  # of the per-rank target: smaller gains are not worth more communication


def _excess(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return sum(max(0.0, x - mean) ** 2 for x in loads)


def _better(new: list[float], old: list[float], target: float) -> bool:
    """A clearly lower maximum, or no higher maximum with clearly less load above the mean."""
    gain = _REFINE_GAIN * target
    if max(new) < max(old) - gain:
        return True
    return max(new) <= max(old) and _excess(new) < _excess(old) - gain * gain


def _target(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, remap: bool) -> float:
    return sum(local_time(s, topo, costs, remap) for s in lengths) / topo.num_ranks


def overflow_cost(topo: CPTopology, costs: CPCosts, remap: bool) -> float:
    """A token beyond its node's share crosses a NIC 4 times a layer (to and from the MLP layout, in
    forward and backward) inside a collective every rank waits for; in the worst case one rank's
    NIC share carries a node's whole overflow, and node loads add ``m`` ranks' seconds."""
    if not remap or topo.num_nodes == 1:
        return 0.0
    return 4 * costs.hidden_bytes / topo.nic.bandwidth * topo.ranks_per_node


def partition_pack(
    lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, layers: ZeppelinLayers = ALL_LAYERS
) -> tuple[list[SplitOption], list[tuple[int, ...]], list[float]]:
    """Steps 1-3 and the refinement: every sequence's split, its members, every rank's load."""
    remap = layers.remap
    by_length = {  # packs of many short documents repeat lengths: price each length once
        s: SplitOptions(s, topo, costs, remap=remap, routing=layers.routing, hierarchical=layers.hierarchical)
        for s in set(lengths)
    }
    options = [by_length[s] for s in lengths]  # read only: equal lengths share one list
    target = _target(lengths, topo, costs, remap)
    overflow_s = overflow_cost(topo, costs, remap)
    first = {s: opts.index(choose_split(opts, target)) for s, opts in by_length.items()}
    choice = [first[s] for s in lengths]
    splits = [options[i][c] for i, c in enumerate(choice)]
    # the refinement compares greedy partitions (step 3 without its local search, half the cost);
    # the local search runs once, on the final splits
    members, loads = partition(lengths, splits, topo, overflow_s, polish=False)
    for _ in range(_REFINE_ROUNDS):
        worst = sorted(range(len(loads)), key=lambda r: (-loads[r], r))[: topo.ranks_per_node]
        growable = [
            i
            for r in worst
            for i in sorted(
                (i for i, ranks in enumerate(members) if r in ranks and choice[i] + 1 < len(options[i])),
                key=lambda i: (-splits[i].est_s, i),
            )
        ]
        for i in list(dict.fromkeys(growable))[:_REFINE_TRIES]:
            trial = list(splits)
            trial[i] = options[i][choice[i] + 1]
            t_members, t_loads = partition(lengths, trial, topo, overflow_s, polish=False)
            if _better(t_loads, loads, target):
                choice[i] += 1
                splits, members, loads = trial, t_members, t_loads
                break
        else:
            break
    members, loads = partition(lengths, splits, topo, overflow_s)
    return splits, members, loads


def _least_loaded(loads: list[float], candidates: tuple[int, ...] | range, count: int) -> tuple[int, ...]:
    if count == 1:
        return (min(candidates, key=loads.__getitem__),)  # min keeps the first (lowest) of equals
    picked = sorted(candidates, key=lambda c: (loads[c], c))[:count]
    return tuple(sorted(picked))


def partition(
    lengths: tuple[int, ...],
    splits: list[SplitOption],
    topo: CPTopology,
    overflow_s: float = 0.0,
    *,
    polish: bool = True,
) -> tuple[list[tuple[int, ...]], list[float]]:
    """Steps 2 and 3: members of every sequence (ascending ranks, hence node-major) and the
    estimated load of every rank. ``overflow_s``: what a token beyond a node's balanced share
    ``ceil(L / N)`` costs the node (the remap must move it across nodes); a node-local sequence
    goes to the node where load plus that penalty ends lowest."""
    m, n = topo.ranks_per_node, topo.num_nodes
    cap = -(-sum(lengths) // n)
    node_load = [0.0] * n
    node_tokens = [0.0] * n
    rank_load = [0.0] * topo.num_ranks
    members: list[tuple[int, ...]] = [()] * len(lengths)
    weight = [-sp.est_s * sp.span for sp in splits]
    by_total = sorted(range(len(lengths)), key=weight.__getitem__)  # stable: equal weights by index
    node_items: list[list[int]] = [[] for _ in range(n)]
    for i in (i for i in by_total if splits[i].nodes > 1):
        nodes = _least_loaded(node_load, range(n), splits[i].nodes)
        members[i] = tuple(r for node in nodes for r in topo.ranks_of_node(node))
        for node in nodes:
            node_load[node] += splits[i].est_s * m
            node_tokens[node] += lengths[i] / len(nodes)
        for r in members[i]:
            rank_load[r] += splits[i].est_s
    for i in (i for i in by_total if splits[i].nodes == 1):
        s = lengths[i]  # to the node (lowest index on ties) where load + penalty ends lowest
        ends = [
            load + overflow_s * (tok + s - cap) if tok + s > cap else load for load, tok in zip(node_load, node_tokens)
        ]
        node = ends.index(min(ends))
        node_load[node] += splits[i].est_s * splits[i].span
        node_tokens[node] += lengths[i]
        node_items[node].append(i)
    for node, items in enumerate(node_items):
        ranks = topo.ranks_of_node(node)
        for i in sorted(items, key=lambda i: (-splits[i].est_s, -splits[i].span, i)):
            members[i] = _least_loaded(rank_load, ranks, splits[i].span)
            for r in members[i]:
                rank_load[r] += splits[i].est_s
        if polish:
            _polish(ranks, node_items[node], splits, members, rank_load)
    return members, rank_load


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


def zeppelin_specs(
    lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, layers: ZeppelinLayers = ALL_LAYERS
) -> list[GroupSpec]:
    """Zeppelin's own placement (steps 1-5) as group specs."""
    splits, members, _ = partition_pack(lengths, topo, costs, layers)
    return specs_of(splits, members, topo, layers)


def specs_of(
    splits: list[SplitOption], members: list[tuple[int, ...]], topo: CPTopology, layers: ZeppelinLayers
) -> list[GroupSpec]:
    """Step 5: sequences with the same kind and member set share one group."""
    groups: dict[tuple[GroupKind, tuple[int, ...]], list[int]] = {}
    for i, ranks in enumerate(members):
        kind: GroupKind = "local" if len(ranks) == 1 else splits[i].kind
        groups.setdefault((kind, ranks), []).append(i)
    specs = []
    for (kind, ranks), seqs in groups.items():
        inter = len({topo.node_of(r) for r in ranks}) > 1
        specs.append(
            GroupSpec(
                kind,
                ranks,
                tuple(seqs),
                a2a_size=topo.ranks_per_node if kind == "hierarchical" else 1,
                routed=layers.routing and inter and kind == "zigzag",
            )
        )
    return specs
