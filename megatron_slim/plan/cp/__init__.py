"""Context-parallel planning for variable-length packs. Pure Python; imports no torch.

* ``lengths``   -- ``--lengths FILE|SPEC``: distributions, files, packing into packs of ``L`` tokens
* ``topology``  -- the CP domain as nodes x ranks; NVLink / NIC-share links
* ``costs``     -- per-token / per-pair / per-byte costs of one layer, from a recipe's cost model
* ``layout``    -- the plan values: ``Segment``, ``CPGroup``, ``RankLayout``, ``CPPlan``
* ``placement`` -- Zeppelin's own placement; ``estimate`` -- its split costs and
                   ``ZeppelinLayers`` (which layers it uses)
* ``price``     -- one cost model for any placement (per rank: compute, intra, inter, idle)
* ``choose``    -- Zeppelin's planner (``plan_zeppelin``): its own or a baseline's placement,
                   whichever prices lowest
* ``baselines`` -- ring, ulysses, a2a+p2p, allgather, dynamic; ``engines`` -- one entry point
* ``remap``     -- attention layout -> token-balanced layout (``RemapPlan``)
* ``routing``   -- inter-node hops spread over every NIC of the node (``RoutingPlan``)
* ``program``   -- the plan lowered to per-rank step programs (``lower_cp``): what the runtime
                   executes and the simulator prices

The simulator that prices these plans is ``megatron_slim.plan.sim.cp.sim``.
"""

from megatron_slim.plan.cp.choose import plan_zeppelin
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.engines import ENGINES, plan_pack
from megatron_slim.plan.cp.estimate import ZeppelinLayers
from megatron_slim.plan.cp.layout import CPGroup, CPPlan, RankLayout, Segment
from megatron_slim.plan.cp.lengths import LengthSource, make_packs, parse_lengths
from megatron_slim.plan.cp.remap import RemapPlan, Transfer, plan_remap, plan_remap_for
from megatron_slim.plan.cp.routing import Route, RoutedHop, RoutePart, RoutingPlan, plan_routing, route_transfer
from megatron_slim.plan.cp.topology import CPTopology

__all__ = [
    "CPCosts",
    "CPGroup",
    "CPPlan",
    "CPTopology",
    "ENGINES",
    "LengthSource",
    "RankLayout",
    "RemapPlan",
    "Route",
    "RoutePart",
    "RoutedHop",
    "RoutingPlan",
    "Segment",
    "Transfer",
    "ZeppelinLayers",
    "make_packs",
    "parse_lengths",
    "plan_pack",
    "plan_remap",
    "plan_remap_for",
    "plan_routing",
    "plan_zeppelin",
    "route_transfer",
]
