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
Steps 2-3 live in ``buckets.py``.

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
   and steps 2-3 are redone (trials without step 3's local search, which runs once at the end;
   a trial stops as soon as its busiest rank is certain to end above today's, ``buckets.greedy``).
   A round tries the first ``_REFINE_TRIES`` candidates; a pack gets ``_REFINE_PASSES`` trials in
   all (the planner's time budget), which ends the refinement early on packs that keep improving.
5. Sequences with the same kind and member set share one group (one ring).

Bound: steps 2-3 are list scheduling, so a node ends at most one sequence above the node average
and a rank, for single-rank pieces, at most one piece above its node's average; gang pieces
(``g > 1``) weaken the rank-level guarantee. The tests check ``max rank load <= 2 * max(total / C,
largest piece)`` on many random packs; on the benchmark's packs the busiest rank's estimated load
is typically 5-25% above ``total / C``.
"""

from __future__ import annotations

from typing import Iterator

from megatron_slim.plan.cp.assemble import GroupSpec
from megatron_slim.plan.cp.buckets import polish
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import (
    ALL_LAYERS,
    NodeRates,
    SplitOption,
    SplitOptions,
    ZeppelinLayers,
)
from megatron_slim.plan.cp.greedy import Buckets, greedy
from megatron_slim.plan.cp.layout import GroupKind
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.schema import fail


def check_lengths(lengths: tuple[int, ...]) -> None:
    if not lengths:
        raise fail("lengths", lengths, "at least one sequence")
    for i, s in enumerate(lengths):
        if not isinstance(s, int) or s < 1:
            raise fail(f"lengths[{i}]", s, "a positive integer")


# the refinement's greedy passes per pack: the planner's time budget (issue 10: 50 ms per 4M-token
# batch over 64 ranks) holds about 12 a pack; on the benchmark most of the gain comes in the first few
_REFINE_PASSES = 12
_REFINE_TRIES = 2  # a round's tries; the last round of every pack fails them all
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


def overflow_cost(topo: CPTopology, costs: CPCosts, remap: bool) -> float:
    """A token beyond its node's share crosses a NIC 4 times a layer (to and from the MLP layout, in
    forward and backward) inside a collective every rank waits for; in the worst case one rank's
    NIC share carries a node's whole overflow, and node loads add ``m`` ranks' seconds."""
    if not remap or topo.num_nodes == 1:
        return 0.0
    return 4 * costs.hidden_bytes / topo.nic.bandwidth * topo.ranks_per_node


def _busiest(loads: list[float], m: int) -> Iterator[int]:
    """The ``m`` busiest ranks, busiest first (ties: the lower rank); the first without sorting."""
    first = loads.index(max(loads))
    yield first
    for r in sorted(range(len(loads)), key=loads.__getitem__, reverse=True)[:m]:  # stable: ties by rank
        if r != first:
            yield r


def _growable(current: Buckets, splits: list[SplitOption], can_grow: list[bool], m: int) -> list[int]:
    """The refinement's tries: sequences on the ``m`` busiest ranks (busiest first, ties: the lower
    rank) that have a larger span, each rank's by decreasing per-member cost (ties: the lower
    index), the first ``_REFINE_TRIES`` distinct ones. A rank holds its node's node-local
    sequences and inter-node ones."""
    out: list[int] = []
    inter = [i for i, sp in enumerate(splits) if sp.nodes > 1]
    for r in _busiest(current.loads, m):
        near = current.node_items[r // m] + inter
        held = [i for i in near if can_grow[i] and r in current.members[i]]
        for i in sorted(held, key=lambda i: (-splits[i].est_s, i)):
            if i not in out:
                out.append(i)
                if len(out) == _REFINE_TRIES:
                    return out
    return out


def partition_pack(
    lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, layers: ZeppelinLayers = ALL_LAYERS
) -> tuple[list[SplitOption], list[tuple[int, ...]], list[float]]:
    """Steps 1-3 and the refinement: every sequence's split, its members, every rank's load."""
    remap = layers.remap
    rates = NodeRates.of(topo, costs, remap)
    by_length = {  # packs of many short documents repeat lengths: price each length once
        s: SplitOptions(
            s, topo, costs, remap=remap, routing=layers.routing, hierarchical=layers.hierarchical, rates=rates
        )
        for s in set(lengths)
    }
    options = [by_length[s] for s in lengths]  # read only: equal lengths share one list
    local = {s: opts[0].est_s for s, opts in by_length.items()}
    target = sum([local[s] for s in lengths]) / topo.num_ranks  # a fair share of local costs
    overflow_s = overflow_cost(topo, costs, remap)
    first = {s: opts.fitting_index(target) for s, opts in by_length.items()}
    choice = [first[s] for s in lengths]
    first_split = {s: by_length[s][c] for s, c in first.items()}
    splits = [first_split[s] for s in lengths]
    # the refinement compares greedy partitions (step 3 without its local search, half the cost);
    # the local search runs once, on the final splits
    current = greedy(lengths, splits, topo, overflow_s)
    assert current is not None  # nothing to give up on
    last = len(options[0]) - 1  # every sequence has the same number of options
    passes = 0
    while passes < _REFINE_PASSES:
        for i in _growable(current, splits, [c < last for c in choice], topo.ranks_per_node)[: _REFINE_PASSES - passes]:
            passes += 1
            trial = list(splits)
            trial[i] = options[i][choice[i] + 1]
            # a trial whose busiest rank ends above today's cannot be better (_better): stop it early;
            # it differs from the current placement at sequence i only: reuse what i leaves alone
            tried = greedy(lengths, trial, topo, overflow_s, give_up_above=max(current.loads), like=(current, i))
            if tried is not None and _better(tried.loads, current.loads, target):
                choice[i] += 1
                splits, current = trial, tried
                break
        else:
            break
    polish(current, splits, topo)
    return splits, current.members, current.loads


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
    m = topo.ranks_per_node
    groups: dict[tuple[GroupKind, tuple[int, ...]], list[int]] = {}
    for i, ranks in enumerate(members):
        kind: GroupKind = "local" if len(ranks) == 1 else splits[i].kind
        groups.setdefault((kind, ranks), []).append(i)
    specs = []
    for (kind, ranks), seqs in groups.items():
        inter = min(ranks) // m != max(ranks) // m  # nodes are rank ranges
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
