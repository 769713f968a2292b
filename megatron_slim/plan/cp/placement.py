"""Zeppelin's placement: per sequence local / intra-node / inter-node, then hierarchical balancing.

``plan_zeppelin(lengths, topo, costs)`` is pure and deterministic (ties break on indices), so
every rank computes the same ``CPPlan`` and can check it by ``digest()``.

1. **Per-sequence split** (``estimate.py``): a rank's fair share is
   ``target = sum(local cost of every sequence) / C``, where a sequence's cost is its causal
   attention (~s^2) plus the token work done in the attention layout (~s; with remapping only
   QKV/O, without it the MLP too). A sequence takes the smallest span whose per-member cost
   (including the K/V traffic its ring cannot hide on that link class) fits the target: one rank,
   ``g <= m`` ranks of one node (zigzag over NVLink), or ``k`` whole nodes (zigzag with the
   routing layer, or all-to-all inside nodes + ring across nodes, whichever is cheaper). When no
   span fits, the cheapest per member.
2. **Nodes first** (longest-processing-time greedy): inter-node sequences, heaviest first, take
   the ``k`` least-loaded nodes; every other sequence, by decreasing total cost, goes to the
   least-loaded node.
3. **Then ranks inside each node**: pieces by decreasing per-member cost; a ``g``-rank group takes
   the node's ``g`` least-loaded ranks, a local sequence the least-loaded one.
4. Sequences with the same kind and the same member set share one group (one ring).

Bound: both passes are greedy list scheduling, so a node ends at most one piece above the node
average (``load <= total/N + largest node piece``) and, for single-rank pieces, a rank at most one
piece above its node's average. Gang pieces (``g > 1``) weaken the rank-level guarantee; the
tests check ``max rank load <= 2 * max(total / C, largest piece)`` on many random packs, and
typical packs come within a few percent of ``total / C``.
"""
from __future__ import annotations

from megatron_slim.plan.cp.assemble import GroupSpec, assemble
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import SplitOption, choose_split, local_time, split_options
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.schema import fail


def check_lengths(lengths: tuple[int, ...]) -> None:
    if not lengths:
        raise fail("lengths", lengths, "at least one sequence")
    for i, s in enumerate(lengths):
        if not isinstance(s, int) or s < 1:
            raise fail(f"lengths[{i}]", s, "a positive integer")


def choose_splits(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, *, remap: bool = True,
                  routing: bool = True, hierarchical: bool = True) -> list[SplitOption]:
    target = sum(local_time(s, costs, remap) for s in lengths) / topo.num_ranks
    return [choose_split(split_options(s, topo, costs, remap=remap, routing=routing, hierarchical=hierarchical),
                         target) for s in lengths]


def _least_loaded(loads: list[float], candidates: tuple[int, ...] | range, count: int) -> tuple[int, ...]:
    picked = sorted(candidates, key=lambda c: (loads[c], c))[:count]
    return tuple(sorted(picked))


def partition(lengths: tuple[int, ...], splits: list[SplitOption], topo: CPTopology) -> tuple[
        list[tuple[int, ...]], list[float]]:
    """Members of every sequence (ring order: ascending rank, hence node-major) and rank loads."""
    m, n = topo.ranks_per_node, topo.num_nodes
    node_load = [0.0] * n
    rank_load = [0.0] * topo.num_ranks
    members: list[tuple[int, ...]] = [()] * len(lengths)
    by_total = sorted(range(len(lengths)), key=lambda i: (-splits[i].est_s * splits[i].span, i))
    node_items: list[list[int]] = [[] for _ in range(n)]
    for i in (i for i in by_total if splits[i].nodes > 1):
        nodes = _least_loaded(node_load, range(n), splits[i].nodes)
        members[i] = tuple(r for node in nodes for r in topo.ranks_of_node(node))
        for node in nodes:
            node_load[node] += splits[i].est_s * m
        for r in members[i]:
            rank_load[r] += splits[i].est_s
    for i in (i for i in by_total if splits[i].nodes == 1):
        node = _least_loaded(node_load, range(n), 1)[0]
        node_load[node] += splits[i].est_s * splits[i].span
        node_items[node].append(i)
    for node, items in enumerate(node_items):
        ranks = topo.ranks_of_node(node)
        for i in sorted(items, key=lambda i: (-splits[i].est_s, -splits[i].span, i)):
            members[i] = _least_loaded(rank_load, ranks, splits[i].span)
            for r in members[i]:
                rank_load[r] += splits[i].est_s
    return members, rank_load


def plan_zeppelin(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, *, remap: bool = True,
                  routing: bool = True, hierarchical: bool = True) -> CPPlan:
    lengths = tuple(lengths)
    check_lengths(lengths)
    splits = choose_splits(lengths, topo, costs, remap=remap, routing=routing, hierarchical=hierarchical)
    members, _ = partition(lengths, splits, topo)
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, ranks in enumerate(members):
        kind = "local" if len(ranks) == 1 else splits[i].kind
        groups.setdefault((kind, ranks), []).append(i)
    specs = []
    for (kind, ranks), seqs in groups.items():
        inter = len({topo.node_of(r) for r in ranks}) > 1
        specs.append(GroupSpec(kind, ranks, tuple(seqs), a2a_size=topo.ranks_per_node if kind == "hierarchical" else 1,
                               routed=routing and inter and kind == "zigzag"))
    return assemble("zeppelin", lengths, topo, specs)
