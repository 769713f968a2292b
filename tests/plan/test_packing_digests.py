"""SlimPack's phase 1 returns exactly the plans it returned before it was made faster.

Digests recorded from the solver at commit dfc8a53 (before the LPT without per-unit arrays and the
units shared by the DP-merge candidates); ``benchmarks/packing_solver.py`` checks the same on its
4M-token batch (``benchmarks/results/packing_solver_digests.json``).
"""

import pytest

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.lengths import parse_lengths
from megatron_slim.plan.pack.costs import fit_slice_costs
from megatron_slim.plan.pack.evaluate import draw_global_batch
from megatron_slim.plan.pack.slimpack import solve
from megatron_slim.plan.recipe import load_recipe

SPEC = "mix:0.9*lognormal(mean=4096,sigma=1,min=64,max=65536)+0.1*lognormal(mean=65536,sigma=0.6,min=8192,max=262144)"
RECORDED = {
    (0, 16): "cd69216bfd9c76f9",
    (0, 7): "c2d262438ccfbc35",
    (1, 16): "c60cf445acc2965a",
    (1, 7): "bdaf1d453236af3c",
    (2, 16): "189097e4454060d6",
    (2, 7): "31cb16baa5d61087",
}


@pytest.fixture(scope="module")
def cost_model():
    return CostModel(load_recipe("llama2-7b-64k"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_phase_one_plans_hash_as_recorded(cost_model, seed):
    lengths = draw_global_batch(parse_lengths(SPEC), 1 << 20, seed=seed)
    costs = fit_slice_costs(cost_model, 16384, max(lengths))
    for dp in (16, 7):
        assert solve(lengths, costs, dp, 16384, budget_s=0.0).phase1.digest() == RECORDED[(seed, dp)], dp
