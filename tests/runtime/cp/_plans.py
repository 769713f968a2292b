"""CP plans for the runtime tests: 4 CP ranks as 2 nodes x 2, packs of short and long sequences whose
lengths are mostly not multiples of 2*cp = 8 nor of 2g (odd lengths, lengths below 2g).

Zeppelin's planner decides by cost; its costs here are the 7B recipe's with the per-pair attention
time multiplied by ``SCALE`` and link latencies divided by it, which keeps the planner's decisions
for sequences ``SCALE`` times shorter: a few hundred tokens then span nodes, tens stay in a node,
a handful stay local, and the CPU tests stay small.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_slim.plan.cp.assemble import GroupSpec, assemble
from megatron_slim.plan.cp.baselines import plan_a2a_p2p, plan_allgather, plan_dynamic, plan_ring, plan_ulysses
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.engines import ENGINES, plan_pack
from megatron_slim.plan.cp.remap import plan_remap_for
from megatron_slim.plan.cp.routing import plan_routing
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.recipe import load_recipe

NODES, PER_NODE = 2, 2
SCALE = 150
# Candidate packs (first one whose Zeppelin plan has local, intra- and inter-node groups is used).
ZEPPELIN_PACKS = (
    (655, 170, 30, 20, 10, 5, 3),
    (411, 93, 57, 21, 13, 7, 5, 1),
    (301, 97, 45, 27, 11, 3),
    (517, 133, 61, 19, 9, 4, 2),
    (733, 201, 44, 23, 7, 3),
)
MIXED = (61, 3, 29, 1, 17, 6, 45)  # for the baselines: short and long, odd, some below 2g
ONES = (1,) * 6  # one-token documents only: ring, allgather and a2a+p2p put them all on one rank
FEW = (1, 2)  # fewer tokens than CP ranks: some rank holds nothing under every engine
EMPTY_RANK_CASES = tuple(f"{pack}-{engine}" for pack in ("ones", "few") for engine in ENGINES)
ROUTE_BYTES = 1e8  # bytes per K/V row that make routing pay off for every hop (forces it on)


def topology() -> CPTopology:
    return CPTopology.uniform(NODES, PER_NODE, nvlink_latency=3e-6 / SCALE, nic_latency=8e-6 / SCALE)


@functools.cache
def costs() -> CPCosts:
    base = CPCosts.from_recipe(load_recipe("zeppelin-7b-h800"))
    return dataclasses.replace(base, pair_fwd_s=base.pair_fwd_s * SCALE, pair_bwd_s=base.pair_bwd_s * SCALE)


def scopes(plan) -> set[str]:
    return {g.scope for g in plan.groups}


@functools.cache
def zeppelin_plan():
    for lengths in ZEPPELIN_PACKS:
        plan = plan_pack("zeppelin", lengths, topology(), costs())
        if scopes(plan) == {"local", "intra", "inter"}:
            return plan
    raise AssertionError("no candidate pack gives a Zeppelin plan with local, intra- and inter-node groups")


def forced_routing(plan):
    return plan_routing(plan, topology(), ROUTE_BYTES)


def routed_count(routing) -> int:
    return sum(h.route.routed for h in routing.hops)


def _routed(plan):
    """The same placement with every inter-node zigzag group marked routed."""
    specs = [
        GroupSpec(
            g.kind,
            g.ranks,
            g.seqs,
            a2a_size=g.a2a_size if g.kind == "hierarchical" else 1,
            routed=g.kind == "zigzag" and g.scope == "inter",
        )
        for g in plan.groups
    ]
    return assemble(plan.engine, plan.lengths, topology(), specs)


def _relay_plan():
    """Inter-node rings of one rank per node: the routing proxies are not ring members."""
    lengths = (37, 23, 5, 9)
    specs = [
        GroupSpec("zigzag", (0, 2), (0,), routed=True),
        GroupSpec("zigzag", (3, 1), (1,), routed=True),
        GroupSpec("local", (1,), (2,)),
        GroupSpec("local", (3,), (3,)),
    ]
    return assemble("relay-test", lengths, topology(), specs)


def _skewed_plan():
    """Far from token-balanced (83/23/52/4 tokens), so the remap moves many tokens, some across nodes."""
    specs = [
        GroupSpec("zigzag", (0, 1), (6,)),
        GroupSpec("local", (0,), (0,)),
        GroupSpec("local", (2,), (2, 4, 5)),
        GroupSpec("local", (3,), (1, 3)),
    ]
    return assemble("skewed-test", MIXED, topology(), specs)


def _picked_plan(picked: str):
    """Zeppelin plans as ``plan.cp.choose`` may keep them: its spread shape (one hierarchical group
    over every rank next to intra-node and local groups) and a baseline's placement (Ulysses)."""
    if picked == "ulysses":
        specs = [GroupSpec("ulysses", (0, 1, 2, 3), tuple(range(len(MIXED))))]
    else:
        specs = [
            GroupSpec("hierarchical", (0, 1, 2, 3), (0, 6), a2a_size=PER_NODE),
            GroupSpec("zigzag", (2, 3), (2,)),
            GroupSpec("local", (0,), (1, 3)),
            GroupSpec("local", (1,), (4, 5)),
        ]
    return assemble("zeppelin", MIXED, topology(), specs, picked)


def case(name: str):
    """``(plan, routing or None)`` of a named test case."""
    topo = topology()
    if name == "zeppelin":
        return zeppelin_plan(), None
    if name == "zeppelin-routed":
        plan = _routed(zeppelin_plan())
        return plan, forced_routing(plan)
    if name == "ring":
        return plan_ring(MIXED, topo), None
    if name == "ring-routed":
        plan = _routed(plan_ring(MIXED, topo))
        return plan, forced_routing(plan)
    if name == "hierarchical":
        return plan_a2a_p2p(MIXED, topo, costs()), None
    if name == "ulysses":
        return plan_ulysses(MIXED, topo, costs()), None
    if name == "allgather":
        return plan_allgather(MIXED, topo), None
    if name == "dynamic":
        return plan_dynamic(MIXED, topo), None
    if name == "tiny":  # fewer tokens than ranks: some ranks hold nothing and only pass blocks on
        return plan_ring((1, 2), topo), None
    if name == "tiny-a2a":
        return plan_a2a_p2p((2, 1), topo, costs()), None
    if name == "skewed":
        return _skewed_plan(), None
    if name in EMPTY_RANK_CASES:
        pack, engine = name.split("-", 1)
        return plan_pack(engine, ONES if pack == "ones" else FEW, topo, costs()), None
    if name in ("zeppelin-spread", "zeppelin-ulysses"):
        return _picked_plan({"zeppelin-spread": "zeppelin-spread", "zeppelin-ulysses": "ulysses"}[name]), None
    if name == "relay":
        plan = _relay_plan()
        return plan, forced_routing(plan)
    raise KeyError(name)


def remap_for(plan):
    return plan_remap_for(plan, topology())


CASES = (
    "zeppelin",
    "zeppelin-routed",
    "ring",
    "ring-routed",
    "hierarchical",
    "ulysses",
    "allgather",
    "dynamic",
    "relay",
    "skewed",
    "zeppelin-spread",
    "zeppelin-ulysses",
    "tiny",
    "tiny-a2a",
    *EMPTY_RANK_CASES,
)
