"""Consolidation planning: the fewest stages that fit the memory cap (against brute force over every
stage count and split), with the exact min-max split at that count, and which ranks leave."""

import random

import pytest

from megatron_slim.plan.dynmo.consolidate import fewest_stages, released_ranks
from megatron_slim.plan.dynmo.costs import LayerCost, StageExtras
from megatron_slim.plan.dynmo.partition import StageLoads
from tests.plan.test_dynmo_partition import brute_force


def _in_flight(k):
    return tuple(k - s for s in range(k))  # 1F1B: stage s holds k - s microbatches at its peak


@pytest.mark.parametrize("seed", range(12))
def test_fewest_stages_is_the_smallest_count_with_any_fitting_split(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    layers = [
        LayerCost(rng.uniform(0.1, 2), rng.uniform(0.1, 4), rng.uniform(1, 4), rng.uniform(0, 1)) for _ in range(n)
    ]
    extras = StageExtras(first_s=0.5, last_s=1.0, first_bytes=2.0, last_bytes=3.0)
    top = min(n, 4)
    cap = rng.uniform(4, 30)
    feasible = {k: brute_force(StageLoads(layers, extras, _in_flight(k)), cap) for k in range(1, top + 1)}
    counts = [k for k in feasible if feasible[k]]
    if not counts:
        with pytest.raises(ValueError, match="no split over 1..[0-9]+ stages fits memory_cap"):
            fewest_stages(layers, extras, _in_flight, cap, top)
        return
    split = fewest_stages(layers, extras, _in_flight, cap, top)
    k = min(counts)
    loads = StageLoads(layers, extras, _in_flight(k))
    assert split.num_stages == k and split.num_layers == n and min(split.layers_per_stage) >= 1
    assert max(loads.stage_memory(split)) <= cap
    assert max(loads.stage_times(split)) == pytest.approx(min(t for t, _ in feasible[k]), rel=1e-12)


def test_bad_ranges_and_released_ranks():
    layers = [LayerCost(1.0, 1.0)] * 4
    with pytest.raises(ValueError, match="allowed: 1 <= min_stages <= max_stages <= 4"):
        fewest_stages(layers, StageExtras(), _in_flight, 1.0, 5)
    with pytest.raises(ValueError, match=r"in_flight\(1\) gave 2 counts; allowed: 1"):
        fewest_stages(layers, StageExtras(), lambda k: (1, 1), 1.0, 2)
    assert fewest_stages(layers, StageExtras(), _in_flight, 1e9, 4).layers_per_stage == (4,)
    assert released_ranks(4, 2) == (2, 3)
    with pytest.raises(ValueError, match="allowed: 1 <= after < now"):
        released_ranks(2, 2)
