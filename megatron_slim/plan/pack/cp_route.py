"""The CP route of an outlier: the whole sample on one DP replica, split over that replica's CP group
by Zeppelin's placement, priced with the CP cost model; and the choice between it and DP-merge.

A replica of ``cp`` ranks runs a CP-routed sample's slices in order (its K/V stays on the replica).
One layer's forward + backward is what Zeppelin's planner prices for a pack holding that sample
alone (``cp.choose.choose_placement``: the picked placement's busiest rank -- attention pairs and
token work as placed, plus the ring / all-to-all / remap traffic it cannot hide). That time is
split into forward and backward in the proportion of the sample's forward and backward compute
(``CPCosts``), since the CP cost model prices the two passes together. Per pipeline stage: times
the stage's decoder layers, the backward also repeating the recomputed share of the forward
(``train.recompute``), plus the stage's embedding / output-layer work per token (the same under
any CP split: the tokens stay evenly spread).

The choice (``choose_routes``): each outlier is priced both ways -- the CP route as above, DP-merge
as ``slimpack`` prices its slices (their work at their prefix plus the prefix K/V they receive) --
and goes CP when that is cheaper and not on its own longer than a replica's share of the batch: a
CP-routed sample cannot be spread over DP ranks, so a replica holding more than its share would set
the iteration time.

``cp_plan`` gives the runtime (``megatron-slim train``, ``train/packed_routes.py``) the CP plan of
that very placement; ``layers_used`` names the Zeppelin layers it runs (there: no remap layer), so
the price is that of what runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.assemble import assemble
from megatron_slim.plan.cp.choose import Choice, choose_placement
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import ALL_LAYERS, ZeppelinLayers
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.pack.plan import Route


@dataclass(frozen=True)
class CPRoute:
    """Prices a sample placed by Zeppelin over one replica's CP group, per pipeline stage."""

    topology: CPTopology
    costs: CPCosts
    layers: int  # decoder layers of the pipeline stage
    recompute: float = 0.0  # share of a layer's forward that its backward repeats
    other_fwd_per_token: float = 0.0  # the stage's embedding / output-layer seconds per token
    other_bwd_per_token: float = 0.0
    layers_used: ZeppelinLayers = ALL_LAYERS  # Zeppelin's layers the runtime runs (train: no remap)

    @classmethod
    def from_cost_model(cls, cost: CostModel, tokens: int, layers_used: ZeppelinLayers = ALL_LAYERS) -> "CPRoute":
        """The route of ``cost``'s recipe on the stage ``fit_slice_costs`` prices (a middle one);
        the per-token and recompute shares are read at ``tokens`` (the MicroPack cap)."""
        stage = min(1, cost.num_stages - 1)
        p = cost.recipe.parallel
        layers = cost.layers_per_stage
        layer_fwd = cost.decoder_layer_time(tokens, 0.0, False) * layers
        return cls(
            CPTopology.from_hardware(cost.hw, p.cp, p.tp),
            CPCosts.from_recipe(cost.recipe, cost),
            layers,
            cost.recompute_time(tokens, 0.0) / layer_fwd if layer_fwd > 0 else 0.0,
            cost.vocab.forward_time(stage, tokens) / tokens,
            cost.vocab.backward_time(stage, tokens) / tokens,
            layers_used,
        )

    def placement(self, length: int) -> str:
        """The placement Zeppelin picks for the sample alone (``CPPlan.picked``'s names)."""
        return _layer(self.topology, self.costs, length, self.layers_used)[0]

    def cp_plan(self, length: int) -> CPPlan:
        """The CP plan of the sample alone, assembled from the very ``choose_placement`` result that
        ``sample_work`` priced (one cached call), as ``cp.choose.plan_zeppelin`` assembles its pick."""
        choice = _choice(self.topology, self.costs, length, self.layers_used)
        return assemble("zeppelin", (length,), self.topology, choice.specs, choice.picked)

    def sample_work(self, length: int) -> tuple[float, float]:
        """(forward, backward) seconds of the whole sample on one stage, as ``SliceCosts.sample_work``."""
        _, fwd, bwd = _layer(self.topology, self.costs, length, self.layers_used)
        return (
            self.layers * fwd + self.other_fwd_per_token * length,
            self.layers * (bwd + self.recompute * fwd) + self.other_bwd_per_token * length,
        )


@lru_cache(maxsize=4096)
def _choice(topo: CPTopology, costs: CPCosts, length: int, layers: ZeppelinLayers) -> Choice:
    return choose_placement((length,), topo, costs, layers)


def _layer(topo: CPTopology, costs: CPCosts, length: int, layers: ZeppelinLayers) -> tuple[str, float, float]:
    """Zeppelin's pick for ``(length,)`` and one layer's (forward, backward) seconds of it."""
    choice = _choice(topo, costs, length, layers)
    total = choice.priced[choice.picked].time_s
    pairs = length * (length + 1) / 2
    fwd = pairs * costs.pair_fwd_s + length * (costs.pre_fwd_s + costs.post_fwd_s + costs.mlp_fwd_s)
    bwd = pairs * costs.pair_bwd_s + length * (costs.pre_bwd_s + costs.post_bwd_s + costs.mlp_bwd_s)
    share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.5
    return choice.picked, total * share, total * (1 - share)


def choose_routes(
    outliers: Sequence[int],
    work: Sequence[float],
    by_dp: Mapping[int, float],
    by_cp: Mapping[int, float],
    dp: int,
) -> dict[int, Route]:
    """Each outlier's route. ``work``: every sample's forward + backward seconds on one replica;
    ``by_dp`` / ``by_cp``: an outlier's seconds DP-merged / CP-routed. A replica's share counts every
    other outlier at its cheaper price and this one DP-merged (what it is compared against)."""
    cheaper = {s: min(by_dp[s], by_cp[s]) for s in outliers}
    rest = math.fsum(w for s, w in enumerate(work) if s not in cheaper) + math.fsum(cheaper.values())
    routes: dict[int, Route] = {}
    for s in sorted(outliers):
        share = (rest - cheaper[s] + by_dp[s]) / dp
        routes[s] = "cp" if by_cp[s] < by_dp[s] and by_cp[s] <= share else "dp-merge"
    return routes
