"""Zeppelin per pack: its own placement or any baseline engine's, whichever prices lowest.

The candidates are Zeppelin's hierarchical placement (``placement.zeppelin_specs``, partitioned
with every rank's whole layer balanced: ``whole_layer``) with the remap, the same with
its inter-node sequences spread over every rank in one group (``spread_specs``), its own placement
without the remap (``zeppelin-unremapped``: when moving tokens to the balanced layout costs more
than it saves, e.g. over a slow NIC), and the
placements ``ulysses``, ``a2a+p2p``, ``ring``, ``dynamic`` and ``allgather`` would make for the
same pack (``baselines.*_specs``), all scored by one cost model (``price.price_specs``); the
cheapest is kept (ties: the earlier in ``CANDIDATES``) and the plan names it in ``CPPlan.picked``.
A baseline's placement is kept as that engine builds it (its groups unrouted, no remap:
``remap.plan_remap_for`` gives such a plan the identity), so a pack that picks it runs exactly as
under that engine and is priced so. Every candidate is a list of group kinds
the step programs (``program.lower_cp``) and the runtime already execute, so any pick lowers and
runs. Candidates a model cannot run are skipped: ``ulysses`` when ``C`` does not divide the heads,
``a2a+p2p`` when the ranks per node do not (or with the hierarchical layer switched off).

Pruning (the picks are the same as when every candidate is priced in full): every candidate
spends at least the pack's compute spread evenly and its own communication floor; a baseline whose
floor already exceeds the best price so far is not priced in full (``_floor``). ``zeppelin-spread``
is not partitioned when its mean rank load's floor reaches Zeppelin's price (``_spread_floor``),
and ``dynamic``'s placement stops once one rank's floor does (``_dynamic_below``). A pruned
candidate is named in ``Choice.pruned`` instead of ``Choice.priced``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from megatron_slim.plan.cp.assemble import GroupSpec, assemble
from megatron_slim.plan.cp.baselines import (
    a2a_p2p_specs,
    allgather_specs,
    dynamic_groups,
    dynamic_placements,
    dynamic_specs,
    ring_specs,
    ulysses_specs,
)
from megatron_slim.plan.cp.buckets import partition
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import ALL_LAYERS, SplitOption, ZeppelinLayers, hierarchical_allowed
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.placement import check_lengths, overflow_cost, partition_pack, specs_of
from megatron_slim.plan.cp.price import PackCost, price_both, price_group, price_specs
from megatron_slim.plan.cp.topology import CPTopology

CANDIDATES = (
    "zeppelin",
    "zeppelin-spread",
    "zeppelin-unremapped",
    "ulysses",
    "a2a+p2p",
    "ring",
    "dynamic",
    "allgather",
)
Specs = Callable[[tuple[int, ...], CPTopology], list[GroupSpec]]
_BASELINES: dict[str, Specs] = {
    "ulysses": ulysses_specs,
    "a2a+p2p": a2a_p2p_specs,
    "ring": ring_specs,
    "dynamic": dynamic_specs,
    "allgather": allgather_specs,
}


@dataclass(frozen=True)
class Choice:
    picked: str
    specs: list[GroupSpec]
    priced: dict[str, PackCost] = field(default_factory=dict)  # every candidate priced in full
    pruned: tuple[str, ...] = ()  # candidates whose floor exceeded the best price


def whole_layer(layers: ZeppelinLayers) -> ZeppelinLayers:
    """The layers Zeppelin partitions a pack under: each rank's whole layer balanced, MLP included
    in the attention layout, with or without the remap. The remap is then priced on that placement
    (``zeppelin`` against ``zeppelin-unremapped``) and kept only where it pays. Partitioning for
    the remap instead (attention-layout work balanced, the MLP assumed even) leaves token counts far
    from the balanced share, and the remap that settles them costs more NVLink and NIC time than the
    balance it buys: on the hopper-cudnn benchmark's batches that placement, remapped or not, was
    priced and simulated 0-6% above this one (docs/cp-placement-choice.md, "The remap")."""
    return dataclasses.replace(layers, remap=False)


def runnable(name: str, topo: CPTopology, costs: CPCosts, layers: ZeppelinLayers) -> bool:
    """Whether candidate ``name`` can run this model on this topology under ``layers``."""
    if name in ("zeppelin", "zeppelin-spread", "zeppelin-unremapped"):
        return name == "zeppelin" or (topo.num_nodes > 1 if name == "zeppelin-spread" else layers.remap)
    if not layers.baselines or topo.num_ranks == 1:
        return False
    if name == "ulysses":
        return costs.heads % topo.num_ranks == 0
    if name == "a2a+p2p":
        return layers.hierarchical and costs.heads % topo.ranks_per_node == 0
    return True


def _even(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts) -> float:
    """The pack's compute spread evenly over the ranks: no placement does less."""
    pairs = sum(s * (s + 1) / 2 for s in lengths)
    return (pairs * costs.pair_s() + costs.token_s(sum(lengths), remap=False)) / topo.num_ranks


def _floor(name: str, even: float, lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts) -> float:
    """A lower bound of ``name``'s price: ``even`` (``_even``), plus, for ``allgather``, its
    un-overlapped K/V all-gather (one third of it)."""
    total = sum(lengths)
    if name != "allgather" or topo.num_nodes == 1:
        return even
    own = total / topo.num_ranks * costs.kv_bytes
    return even + own * (topo.num_nodes - 1) / topo.nic.bandwidth


def _dynamic_below(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, limit: float) -> list[GroupSpec] | None:
    """``dynamic``'s placement, or None once some rank's load is certain to reach ``limit``: a
    piece of ``s`` tokens on ``g`` ranks loads each at least with its ``s^2 / (2 g)`` attention
    pairs (a local one: ``s (s + 1) / 2``) and its ``s / g`` tokens' work (dynamic CP does not
    remap), rings and all-gathers only add. Loads only grow as sequences are placed."""
    pair_s, token_s = costs.pair_s(), costs.token_s(1.0, remap=False)
    floor = [0.0] * topo.num_ranks
    stop = limit / (1 - 1e-9)  # a margin for the rounding the full price adds differently
    blocks: dict[tuple[int, ...], list[int]] = {}
    for i, block in dynamic_placements(lengths, topo):
        s, g = lengths[i], len(block)
        piece = (s * (s + 1) / 2 if g == 1 else s * s / (2 * g)) * pair_s + s / g * token_s
        for r in block:
            floor[r] += piece
            if floor[r] >= stop:
                return None
        blocks.setdefault(block, []).append(i)
    return dynamic_groups(blocks)


def _spread_parts(members: list[tuple[int, ...]], topo: CPTopology) -> tuple[tuple[int, ...], list[int]] | None:
    """(Zeppelin's inter-node sequences, the others), or None when either is empty."""
    m = topo.ranks_per_node  # node of rank r: r // m
    spread = tuple(i for i, ranks in enumerate(members) if ranks[0] // m != ranks[-1] // m)
    spread_set = set(spread)
    rest = [i for i in range(len(members)) if i not in spread_set]
    return (spread, rest) if spread and rest else None


def _spread_group(spread: tuple[int, ...], topo: CPTopology, costs: CPCosts, layers: ZeppelinLayers) -> GroupSpec:
    everyone = tuple(range(topo.num_ranks))
    if layers.hierarchical and hierarchical_allowed(topo, costs):
        return GroupSpec("hierarchical", everyone, spread, a2a_size=topo.ranks_per_node)
    return GroupSpec("zigzag", everyone, spread, routed=layers.routing)


def _spread_floor(
    lengths: tuple[int, ...],
    parts: tuple[tuple[int, ...], list[int]],
    topo: CPTopology,
    costs: CPCosts,
    layers: ZeppelinLayers,
) -> float:
    """A lower bound of ``zeppelin-spread``'s price: the mean rank load, counting the group over
    every rank in full, the others' attention pairs only (their rings and the remap cost at least
    nothing more; a split sequence's members compute its ``s^2 / 2`` pairs together) and the
    pack's token work."""
    spread, rest = parts
    first = price_group(lengths, _spread_group(spread, topo, costs, layers), topo, costs)
    pairs = sum(lengths[i] * lengths[i] / 2 for i in rest)
    return first + (pairs * costs.pair_s() + costs.token_s(sum(lengths), remap=False)) / topo.num_ranks


def spread_specs(
    lengths: tuple[int, ...],
    topo: CPTopology,
    costs: CPCosts,
    layers: ZeppelinLayers,
    own: tuple[list[SplitOption], list[tuple[int, ...]]],
) -> list[GroupSpec] | None:
    """Zeppelin's inter-node sequences in one group over all ranks (all-to-all inside the nodes +
    ring across them where the heads allow, else a routed zigzag ring), the others partitioned
    around it with the splits Zeppelin chose for them. Whole-node spans leave ranks idle when
    several long sequences share a pack (two of 116K tokens on 4 nodes: one on 4 nodes, one on 3,
    the fourth node's ranks filled with short ones at 45% of the others' load); one group over
    every rank loads them evenly. None when there is nothing to spread or nothing else to place."""
    splits, members = own
    parts = _spread_parts(members, topo)
    if parts is None:
        return None
    spread, rest = parts
    rest_splits = [splits[i] for i in rest]
    rest_members, _ = partition(
        tuple(lengths[i] for i in rest), rest_splits, topo, overflow_cost(topo, costs, whole_layer(layers).remap)
    )
    others = specs_of(rest_splits, rest_members, topo, layers)
    first = _spread_group(spread, topo, costs, layers)
    return [first] + [GroupSpec(s.kind, s.ranks, tuple(rest[j] for j in s.seqs), s.a2a_size, s.routed) for s in others]


def choose_placement(
    lengths: tuple[int, ...],
    topo: CPTopology,
    costs: CPCosts,
    layers: ZeppelinLayers = ALL_LAYERS,
    *,
    price_all: bool = False,
) -> Choice:
    """The cheapest candidate. ``price_all``: price in full every candidate ``_floor`` does not rule
    out, for reports that show losing candidates' prices (``scripts/cp_pack_breakdown.py``); the
    pick is the same either way."""
    remap = layers.remap
    splits, members, _ = partition_pack(lengths, topo, costs, whole_layer(layers))
    own = specs_of(splits, members, topo, layers)
    unremapped = runnable("zeppelin-unremapped", topo, costs, layers)
    own_prices = price_both(lengths, own, topo, costs, (remap, False) if unremapped else (remap,))
    priced = {"zeppelin": own_prices[0]}
    best, best_specs = "zeppelin", own
    pruned: list[str] = []
    parts = _spread_parts(members, topo) if topo.num_nodes > 1 else None
    if (
        parts is not None
        and not price_all
        and _spread_floor(lengths, parts, topo, costs, layers) * (1 - 1e-9) >= priced[best].time_s
    ):
        pruned.append("zeppelin-spread")
    elif parts is not None:
        spread = spread_specs(lengths, topo, costs, layers, (splits, members))
        assert spread is not None
        priced["zeppelin-spread"] = price_specs(lengths, spread, topo, costs, remap=remap)
        if priced["zeppelin-spread"].time_s < priced[best].time_s:
            best, best_specs = "zeppelin-spread", spread
    if unremapped:
        priced["zeppelin-unremapped"] = own_prices[1]
        if priced["zeppelin-unremapped"].time_s < priced[best].time_s:
            best, best_specs = "zeppelin-unremapped", own
    even = _even(lengths, topo, costs) if layers.baselines else 0.0
    for name in CANDIDATES[3:]:
        if not runnable(name, topo, costs, layers):
            continue
        if _floor(name, even, lengths, topo, costs) >= priced[best].time_s:
            pruned.append(name)
            continue
        # dynamic CP's placement is costly to build in full: it stops once it cannot win
        limit = math.inf if price_all else priced[best].time_s
        found = _dynamic_below(lengths, topo, costs, limit) if name == "dynamic" else None
        if name == "dynamic" and found is None:
            pruned.append(name)
            continue
        specs = found if found is not None else _BASELINES[name](lengths, topo)
        priced[name] = price_specs(lengths, specs, topo, costs, remap=False)
        if priced[name].time_s < priced[best].time_s:
            best, best_specs = name, specs
    return Choice(best, best_specs, priced, tuple(pruned))


def plan_zeppelin(
    lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts, layers: ZeppelinLayers = ALL_LAYERS
) -> CPPlan:
    """Zeppelin's plan of one pack: the cheapest candidate placement, named in ``plan.picked``."""
    lengths = tuple(lengths)
    check_lengths(lengths)
    choice = choose_placement(lengths, topo, costs, layers)
    return assemble("zeppelin", lengths, topo, choice.specs, choice.picked)
