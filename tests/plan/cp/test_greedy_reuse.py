"""What the refinement reuses must give what it replaces.

``greedy(like=(current, i))`` reuses the current placement's work; it must give exactly what a
fresh ``greedy`` gives for the same splits (members, every rank's load, node buckets), whether the
changed sequence stays node-local, becomes inter-node or grows across more nodes."""

import random

import pytest

from megatron_slim.plan.cp.estimate import NodeRates, SplitOptions, local_time, zigzag_time
from megatron_slim.plan.cp.greedy import greedy
from megatron_slim.plan.cp.placement import overflow_cost
from megatron_slim.plan.cp.topology import CPTopology

from .conftest import random_pack, topology


def _options(lengths, topo, costs):
    return [SplitOptions(s, topo, costs, remap=True, routing=True, hierarchical=True) for s in lengths]


@pytest.mark.parametrize("name", ["2x2", "4x8", "3x4"])
@pytest.mark.parametrize("kind", ["mixed", "odd"])
def test_reuse_matches_a_fresh_greedy(name, kind, costs):
    rng = random.Random(f"{name}-{kind}")
    topo = topology(name)
    overflow_s = overflow_cost(topo, costs, remap=True)
    checked = {"local": 0, "inter": 0}
    for _ in range(4):
        lengths = random_pack(rng, kind, 4096 * topo.num_ranks)
        options = _options(lengths, topo, costs)
        choice = [rng.randrange(min(3, len(opts))) for opts in options]
        splits = [opts[c] for opts, c in zip(options, choice)]
        current = greedy(lengths, splits, topo, overflow_s)
        for i in rng.sample(range(len(lengths)), min(12, len(lengths))):
            if choice[i] + 1 >= len(options[i]):
                continue
            trial = list(splits)
            trial[i] = options[i][choice[i] + 1]
            fresh = greedy(lengths, trial, topo, overflow_s)
            reused = greedy(lengths, trial, topo, overflow_s, like=(current, i))
            assert fresh is not None and reused is not None
            assert reused.members == fresh.members
            assert reused.loads == fresh.loads  # exact: the same sums in the same order
            assert reused.node_items == fresh.node_items
            checked["inter" if trial[i].nodes > 1 else "local"] += 1
            if rng.random() < 0.5:  # walk on, so later trials reuse a reused placement
                splits, current, choice[i] = trial, reused, choice[i] + 1
    assert checked["local"] > 0


def test_reuse_gives_up_exactly_when_a_fresh_greedy_does(costs):
    rng = random.Random(7)
    topo = topology("4x8")
    overflow_s = overflow_cost(topo, costs, remap=True)
    outcomes = set()
    for _ in range(6):
        lengths = random_pack(rng, "mixed", 4096 * 32)
        options = _options(lengths, topo, costs)
        splits = [opts[0] for opts in options]
        current = greedy(lengths, splits, topo, overflow_s)
        for i in range(len(lengths)):
            limit = max(current.loads) * rng.choice([0.97, 1.0, 1.05])
            trial = list(splits)
            trial[i] = options[i][1]
            fresh = greedy(lengths, trial, topo, overflow_s, give_up_above=limit)
            reused = greedy(lengths, trial, topo, overflow_s, give_up_above=limit, like=(current, i))
            assert (fresh is None) == (reused is None)
            if fresh is not None:
                assert (reused.members, reused.loads) == (fresh.members, fresh.loads)
            outcomes.add(fresh is None)
    assert outcomes == {True, False}  # both kinds of trial were exercised


@pytest.mark.parametrize("remap", [True, False])
def test_node_rates_price_as_the_helpers_do(remap, costs):
    """``NodeRates`` (what ``SplitOptions`` prices a pack's lengths with) gives the very floats of
    ``local_time`` and ``zigzag_time`` inside a node."""
    rng = random.Random(3)
    for topo in (topology("4x8"), CPTopology.uniform(3, 4, 123e9, 37e9, 2.5e-6, 9e-6)):
        rates = NodeRates.of(topo, costs, remap)
        for s in [1, 2, 3, 255, 4096] + [rng.randint(1, 1 << 20) for _ in range(500)]:
            assert rates.local(s) == local_time(s, topo, costs, remap)
            for g in range(2, topo.ranks_per_node + 1):
                assert rates.zigzag(s, g) == zigzag_time(s, g, topo, costs, remap, inter=False, routed=False)
