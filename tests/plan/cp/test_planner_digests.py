"""Zeppelin's planner picks exactly what it picked before it was made faster.

The digests below were recorded from the planner at commit dfc8a53 (before the speed work of
``buckets.py``, the trials that give up early, the one-pass assembly and pricing); every plan of
three packs per length mix, topology and ablation must hash the same. The 4x8 short and long-tailed
ones were re-recorded when the refinement got a budget of greedy passes per pack (issue 10's 50 ms
planner budget; ``placement._REFINE_PASSES``, ``_REFINE_TRIES``), which changes picks on packs that
kept refining past it. All were re-recorded when Zeppelin began to partition every pack with its
whole layer balanced (``choose.whole_layer``: the MLP counted in the attention layout) and to keep
the remap only where it prices lower on that placement, with every rank that moves tokens charged
the busiest mover's remap time among the ranks it exchanges with (``price._remap``); the
``no-remap`` ablation's digests stayed.
``scripts/bench_cp_planner.py``
checks the same on the benchmark's own 4M-token batches (``benchmarks/results/cp_planner_digests.json``).
"""

import hashlib

import pytest

from megatron_slim.plan.cp.choose import plan_zeppelin
from megatron_slim.plan.cp.estimate import ZeppelinLayers
from megatron_slim.plan.cp.lengths import make_packs, parse_lengths
from megatron_slim.plan.cp.topology import CPTopology

MIXES = {
    "short": "lognormal:mean=4096,sigma=1.2,min=256,max=65536",
    "long-tailed": "mix:0.9*lognormal(mean=4096,sigma=1.0,min=256,max=32768)"
    "+0.1*lognormal(mean=65536,sigma=1.0,min=16384,max=262144)",
    "bimodal": "mix:0.7*lognormal(mean=2048,sigma=0.8,min=128,max=16384)"
    "+0.3*lognormal(mean=49152,sigma=0.6,min=16384,max=262144)",
    "uniform": "uniform:min=16384,max=131072",
}
LAYERS = {
    "all": ZeppelinLayers(),
    "own": ZeppelinLayers(baselines=False),
    "no-remap": ZeppelinLayers(remap=False),
    "no-routing": ZeppelinLayers(routing=False),
    "no-hier": ZeppelinLayers(hierarchical=False),
}
RECORDED = {
    "4x8 short all": "cea0afb60aa6200e",
    "4x8 short own": "b65df0b1b375b5e8",
    "4x8 short no-remap": "cea0afb60aa6200e",
    "4x8 short no-routing": "cea0afb60aa6200e",
    "4x8 short no-hier": "cea0afb60aa6200e",
    "4x8 long-tailed all": "aca5a9972bdc4b99",
    "4x8 long-tailed own": "3cc97974f2a8a2c1",
    "4x8 long-tailed no-remap": "970b384440089362",
    "4x8 long-tailed no-routing": "aca5a9972bdc4b99",
    "4x8 long-tailed no-hier": "aca5a9972bdc4b99",
    "4x8 bimodal all": "41b1e91a5856a069",
    "4x8 bimodal own": "b6e994f25d9ad5ec",
    "4x8 bimodal no-remap": "51b3495e6a148869",
    "4x8 bimodal no-routing": "41b1e91a5856a069",
    "4x8 bimodal no-hier": "7c073469129a6788",
    "4x8 uniform all": "6a59cf5db129e6d7",
    "4x8 uniform own": "c024873474a28f00",
    "4x8 uniform no-remap": "6a59cf5db129e6d7",
    "4x8 uniform no-routing": "6a59cf5db129e6d7",
    "4x8 uniform no-hier": "6196814be6c878d6",
    "2x4 short all": "cdf9400cfe7d7e89",
    "2x4 short own": "cdf9400cfe7d7e89",
    "2x4 short no-remap": "4988c524f8aebea6",
    "2x4 short no-routing": "cdf9400cfe7d7e89",
    "2x4 short no-hier": "cdf9400cfe7d7e89",
    "2x4 long-tailed all": "8cb57cab27830e72",
    "2x4 long-tailed own": "8cb57cab27830e72",
    "2x4 long-tailed no-remap": "fa65c4509615542a",
    "2x4 long-tailed no-routing": "74baf3a8ffcf3036",
    "2x4 long-tailed no-hier": "8cb57cab27830e72",
    "2x4 bimodal all": "073c9f1d132f7c31",
    "2x4 bimodal own": "115c611a796c80aa",
    "2x4 bimodal no-remap": "4ce80bafd618076d",
    "2x4 bimodal no-routing": "170ae234990be116",
    "2x4 bimodal no-hier": "35d92a48f21e95de",
    "2x4 uniform all": "46b0be9ecdfa5a39",
    "2x4 uniform own": "46b0be9ecdfa5a39",
    "2x4 uniform no-remap": "46b0be9ecdfa5a39",
    "2x4 uniform no-routing": "29ef7f44b53ae3fc",
    "2x4 uniform no-hier": "bb8bfa48d4e47d31",
}


@pytest.mark.parametrize("topology", ["4x8", "2x4"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_plans_hash_as_recorded(costs, topology, mix):
    nodes, per_node = map(int, topology.split("x"))
    topo = CPTopology.uniform(nodes, per_node)
    packs = make_packs(parse_lengths(MIXES[mix]), 131072, 3, seed=1)
    for name, layers in LAYERS.items():
        digest = hashlib.sha256()
        for pack in packs:
            digest.update(plan_zeppelin(pack, topo, costs, layers).digest().encode())
        assert digest.hexdigest()[:16] == RECORDED[f"{topology} {mix} {name}"], name
