"""SlimPack's solver: never worse than its phase 1 nor than any baseline; the MILP never worse."""

import numpy as np
import pytest

from megatron_slim.plan.pack.baselines import BASELINES, plan_baseline
from megatron_slim.plan.pack.evaluate import evaluate, plan_score
from megatron_slim.plan.pack.heuristic import Unit, loads_of, lpt, normalised, phase1
from megatron_slim.plan.pack.milp import refine
from megatron_slim.plan.pack.plan import Piece
from megatron_slim.plan.pack.slimpack import solve
from tests.plan.test_packing import CAP, COSTS, random_lengths

SEEDS = range(5)


def worst_imbalance(plan):
    m = evaluate(plan)
    return max(m.fwd_imbalance, m.bwd_imbalance)


@pytest.mark.parametrize("seed", SEEDS)
def test_slimpack_is_no_worse_than_its_phase_one_or_any_baseline(seed):
    lengths = random_lengths(seed, count=200)
    result = solve(lengths, COSTS, 8, CAP, budget_s=0.3)
    assert plan_score(result.plan) <= plan_score(result.phase1)
    ours = worst_imbalance(result.plan)
    for method in BASELINES:
        assert ours <= worst_imbalance(plan_baseline(method, lengths, COSTS, 8, CAP)), method
    assert ours < 1.1


def test_forward_and_backward_are_balanced_apart():
    """Two kinds of units: attention-heavy (backward 4x forward) and GEMM-heavy (2x). Balancing
    the sum alone may pile the attention-heavy ones on one rank; the max of both loads may not."""
    units = [Unit((Piece(i, 0, 1),), 1.0, 4.0) for i in range(4)] + [
        Unit((Piece(4 + i, 0, 1),), 5.0 / 3, 10.0 / 3) for i in range(4)
    ]
    f, b = normalised(units, 2)
    loads = loads_of(phase1(units, 2), f, b, 2)
    assert loads.score() == pytest.approx(1.0)
    per_sum = [0, 0, 0, 0, 1, 1, 1, 1]  # equal fwd+bwd per rank (20 each), fwd 4 vs 6.67
    assert loads_of(per_sum, f, b, 2).score() > 1.2


def test_the_milp_reaches_the_optimum_lpt_misses():
    # LPT on (3, 3, 2, 2, 2) over two ranks gives 7 | 5; the optimum is 6 | 6.
    f = np.array([3.0, 3.0, 2.0, 2.0, 2.0]) / 6.0
    start = lpt(f, f, 2)
    assert loads_of(start, f, f, 2).score() == pytest.approx(7 / 6)
    pytest.importorskip("scipy")
    refined = refine(start, f, f, 2, budget_s=5.0)
    assert refined.solver == "highs" and refined.rounds_taken >= 1
    assert loads_of(list(refined.assign), f, f, 2).score() == pytest.approx(1.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_milp_never_returns_worse_than_phase_one(seed):
    pytest.importorskip("scipy")
    rng = np.random.default_rng(seed)
    units = [Unit((Piece(i, 0, 1),), float(x), float(x * y)) for i, (x, y) in enumerate(rng.lognormal(0, 1, (60, 2)))]
    f, b = normalised(units, 6)
    start = phase1(units, 6)
    for budget in (0.0, 0.01, 0.5):
        refined = refine(start, f, b, 6, budget_s=budget)
        assert loads_of(list(refined.assign), f, b, 6).score() <= loads_of(start, f, b, 6).score() + 1e-12
        assert sorted(refined.assign) != [] and len(refined.assign) == len(units)
